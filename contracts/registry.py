"""The tool registry: each tool declared as data, one YAML file per tool.

Files are validated with pydantic at start-up; a bad file stops start-up
with a message naming the file and the field. The Python function behind a
tool is named by the operator in the file (`function: package.module:attr`)
and resolved only by the executor: never from a string the model sent.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from .subjects import TOOL_NAME_PATTERN

BUILTIN_TOOLS_DIR = Path(__file__).parent / "tools"
# libyaml's safe loader where PyYAML has it (its wheels do): it reads the same documents
# about ten times faster than the pure-Python one, and every process a gateway starts
# reads the whole registry at start-up, some several times.
_YAML_LOADER: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Risk = Literal["low", "medium", "high", "critical"]
AuditMode = Literal["full", "hash", "none"]
# What a tool does to what it acts on (the seed's action dimension). A tool that
# declares none reads when read_only, else writes.
ActionClass = Literal["read", "write", "delete", "send", "publish", "execute"]
ACTION_CLASSES: tuple[str, ...] = ("read", "write", "delete", "send", "publish", "execute")
# Actions with a side effect: at risk high or critical they always need approval.
SIDE_EFFECT_ACTIONS = frozenset({"write", "delete", "send", "publish", "execute"})
# Entity types the policy engine builds itself; a tool's resources name others.
ENGINE_ENTITY_TYPES = frozenset({"User", "Agent", "Tool", "Task", "Action"})
RESOURCE_TYPE_PATTERN = r"^[A-Z][A-Za-z0-9_]{0,63}$"
# RFC 6901, at least one step: "/order_id", "/orders/0/id", "/items" (a list of ids).
JSON_POINTER_PATTERN = r"^(/([^~/]|~[01])*)+$"


class RegistryError(Exception):
    """A registry file is missing, unreadable or invalid."""


class RateLimit(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    calls: int = Field(gt=0)
    per_seconds: float = Field(gt=0)


class AuditSpec(BaseModel):
    """What the audit store keeps of this tool's arguments and results."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    arguments: AuditMode = "full"
    result: AuditMode = "full"


class ResourceSpec(BaseModel):
    """A resource the tool acts on: its entity type, and where its id is in the arguments.

    `id` is a JSON pointer into the arguments; the value there is one id (a
    string) or a list of ids. The policy engine looks each one up through the
    entity provider of `type` (declared in the policy bundle) before deciding.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    type: str = Field(pattern=RESOURCE_TYPE_PATTERN)
    id: str = Field(pattern=JSON_POINTER_PATTERN)

    @field_validator("type")
    @classmethod
    def _not_an_engine_type(cls, value: str) -> str:
        if value in ENGINE_ENTITY_TYPES:
            raise ValueError(
                f"{value} is built by the policy engine itself; name another type "
                "(a task-scoped tool declares task_scope instead)"
            )
        return value


def pointer_steps(pointer: str) -> list[str]:
    """The unescaped steps of a JSON pointer ("/a~1b/0" -> ["a/b", "0"])."""
    return [step.replace("~1", "/").replace("~0", "~") for step in pointer.split("/")[1:]]


def _schema_at(schema: Any, steps: list[str]) -> Any:
    """The subschema a pointer into the arguments reaches, or None where it cannot reach."""
    for step in steps:
        if not isinstance(schema, dict):
            return None
        properties = schema.get("properties")
        if isinstance(properties, dict) and step in properties:
            schema = properties[step]
        elif step.isdigit() and isinstance(schema.get("items"), dict):
            schema = schema["items"]
        else:
            return None
    return schema


def _names_ids(schema: Any) -> bool:
    """Whether a subschema may hold a resource id: a string, or a list of strings."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string":
        return True
    if kind == "array":
        items = schema.get("items")
        return isinstance(items, dict) and items.get("type") == "string"
    return False


HEADER_NAME_PATTERN = r"^[A-Za-z0-9-]{1,64}$"
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,127}$"


SECRET_REFERENCE_HELP = "exactly one of `{0}_file` (a file only the executor reads) or `{0}_env`"


def _one_secret(file: str | None, env: str | None, what: str) -> None:
    if (file is None) == (env is None):
        raise ValueError(SECRET_REFERENCE_HELP.format(what))


class ClientCredentials(BaseModel):
    """The gateway's own OAuth client (RFC 6749 client credentials grant): its secret is
    read by the executor from a file or its environment, never written in the registry."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    token_endpoint: str = Field(pattern=r"^https?://[^\s]+$")
    client_id: str = Field(min_length=1, max_length=256)
    client_secret_file: str | None = Field(default=None, min_length=1)
    client_secret_env: str | None = Field(default=None, pattern=ENV_NAME_PATTERN)
    scope: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="after")
    def _one_secret(self) -> ClientCredentials:
        _one_secret(self.client_secret_file, self.client_secret_env, "client_secret")
        return self


class TokenExchange(ClientCredentials):
    """RFC 8693: the end user's verified token (ToolContext.subject_token) exchanged at
    `token_endpoint` for one with audience `audience`, the gateway authenticating as the
    client; a call without a user token is refused (USER_TOKEN_REQUIRED)."""

    audience: str = Field(min_length=1, max_length=1024)


class UpstreamAuth(BaseModel):
    """How the executor authenticates to an upstream (an `http:` tool or an `mcp:` server):
    exactly one of a bearer token (from a file or the environment), the client credentials
    grant, or a token exchange on the user's behalf."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    bearer_file: str | None = Field(default=None, min_length=1)
    bearer_env: str | None = Field(default=None, pattern=ENV_NAME_PATTERN)
    oauth_client_credentials: ClientCredentials | None = None
    token_exchange: TokenExchange | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> UpstreamAuth:
        chosen = [
            name
            for name in ("bearer_file", "bearer_env", "oauth_client_credentials", "token_exchange")
            if getattr(self, name) is not None
        ]
        if len(chosen) != 1:
            raise ValueError(
                "declare exactly one of bearer_file, bearer_env, oauth_client_credentials, "
                f"token_exchange (got {', '.join(chosen) or 'none'})"
            )
        return self


HttpMethod = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE"]
# Methods whose remaining arguments go into the query string (the others: a JSON body).
QUERY_METHODS = frozenset({"GET", "HEAD", "DELETE"})
URL_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.-]{0,127})\}")
# Headers the transport or the auth sets: a registry file never writes them.
RESERVED_HEADERS = frozenset(
    {"authorization", "host", "content-length", "transfer-encoding", "connection", "cookie"}
)
# The largest response an HTTP tool reads (a result holds at most 4 MiB of output).
MAX_HTTP_RESPONSE_BYTES = 4 * 1024 * 1024


class HttpUpstream(BaseModel):
    """A tool that is one HTTP request, run by the executor (services/executor/upstream_http.py).

    `url` is fixed by the operator but for `{name}` placeholders in its path, each filled
    (percent-encoded, `/` included) from the argument of that name. The other arguments
    go into the query string for GET, HEAD and DELETE, into a JSON object body otherwise;
    `query` names arguments sent in the query whatever the method, `body` the one argument
    whose value is the whole JSON body. `headers` are static (no header comes from the
    model); `headers_from_env` maps a header to an executor environment variable.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    method: HttpMethod
    url: str = Field(pattern=r"^https?://[^\s/?#{}]+(/[^\s?#]*)?(\?[^\s#]*)?$")
    headers: dict[str, str] = {}
    headers_from_env: dict[str, str] = {}
    # Seconds for the whole request (None: the entry's timeout_s).
    timeout: float | None = Field(default=None, gt=0, le=3600)
    auth: UpstreamAuth | None = None
    query: list[str] = []
    body: str | None = None
    max_response_bytes: int = Field(default=1024 * 1024, gt=0, le=MAX_HTTP_RESPONSE_BYTES)

    @field_validator("headers", "headers_from_env")
    @classmethod
    def _headers_are_safe(cls, value: dict[str, str]) -> dict[str, str]:
        for header in value:
            if not re.fullmatch(HEADER_NAME_PATTERN, header):
                raise ValueError(f"{header!r} is not an HTTP header name")
            if header.lower() in RESERVED_HEADERS:
                raise ValueError(
                    f"{header} is set by the transport or by `auth`, never by a registry file"
                )
        return value

    @field_validator("headers")
    @classmethod
    def _header_values_are_plain(cls, value: dict[str, str]) -> dict[str, str]:
        for header, text in value.items():
            if any(ch in text for ch in "\r\n\0"):
                raise ValueError(f"the value of header {header} holds a line break")
        return value

    @field_validator("headers_from_env")
    @classmethod
    def _variables_are_names(cls, value: dict[str, str]) -> dict[str, str]:
        for variable in value.values():
            if not re.fullmatch(ENV_NAME_PATTERN, variable):
                raise ValueError(f"{variable!r} is not an environment variable name")
        return value

    @field_validator("url")
    @classmethod
    def _placeholders_in_path_only(cls, value: str) -> str:
        before_query, _, query = value.split("://", 1)[1].partition("?")
        path = before_query.partition("/")[2]
        if "{" in query or "}" in query:
            raise ValueError("{placeholders} may only be in the path, never the query")
        if URL_PLACEHOLDER.sub("", path).count("{") or URL_PLACEHOLDER.sub("", path).count("}"):
            raise ValueError("a `{` or `}` in the path that is not a {name} placeholder")
        return value

    @property
    def path_parameters(self) -> list[str]:
        """The argument names the url's `{name}` placeholders take, in order."""
        return URL_PLACEHOLDER.findall(self.url)


def http_origin_and_path(url: str) -> tuple[str, str]:
    """("https://api.example.com:8443", "/v1/orders/{id}") of an http: entry's url."""
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.partition('?')[0]}", (slash + path.partition("?")[0]) or "/"


class PinnedDefinition(BaseModel):
    """The upstream tool's definition as it was reviewed: what `definition_sha256` hashes
    (besides the name), kept so a changed one can be shown against it (`toolgate tools
    diff`). `output_schema` is None when the upstream declares none."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    description: str = ""
    input_schema: dict[str, Any] = {}
    output_schema: dict[str, Any] | None = None


class McpUpstream(BaseModel):
    """A tool served by an upstream MCP server, run by the executor: over Streamable HTTP
    (`url`) or over stdio (`command`, a process the executor starts and keeps).

    `definition_sha256` pins what an operator imported and reviewed (see
    `mcp_definition_sha256`; `definition` is that definition itself): an upstream that
    later serves another name, description or schema for `tool` is refused
    (UPSTREAM_CHANGED, naming what changed) until `toolgate tools accept` pins it anew.
    `headers_from_env` (HTTP) maps an HTTP header to the environment variable of the
    executor that holds its value (a secret never sits in a registry file).

    stdio: `command` and `args` start the server in `cwd` (default: the executor's own).
    Its environment is exactly `env` (literal values: no secrets here) plus the variables
    named in `env_from_gateway`, copied from the executor's environment: nothing else of
    the gateway's reaches it (not even PATH or HOME unless named).

    `error_results_retryable`: whether an `isError` answer of the upstream may be retried
    as is (default false: the arguments were wrong, a retry gets the same answer). The
    entry's top-level `retryable_errors` still covers an unreachable upstream and timeouts.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    url: str | None = Field(default=None, pattern=r"^https?://[^\s]+$")
    command: str | None = Field(default=None, min_length=1)
    args: list[str] = []
    env: dict[str, str] = {}
    env_from_gateway: list[str] = []
    cwd: str | None = None
    tool: str = Field(min_length=1, max_length=128)
    definition_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    definition: PinnedDefinition | None = None
    headers_from_env: dict[str, str] = {}
    # How the executor authenticates to the server (token_exchange: not for MCP servers yet).
    auth: UpstreamAuth | None = None
    error_results_retryable: bool = False

    @field_validator("headers_from_env")
    @classmethod
    def _headers_are_names(cls, value: dict[str, str]) -> dict[str, str]:
        for header, variable in value.items():
            if not re.fullmatch(HEADER_NAME_PATTERN, header):
                raise ValueError(f"{header!r} is not an HTTP header name")
            if not re.fullmatch(ENV_NAME_PATTERN, variable):
                raise ValueError(f"{variable!r} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _one_authorization(self) -> McpUpstream:
        if self.auth is not None and any(
            h.lower() == "authorization" for h in self.headers_from_env
        ):
            raise ValueError("Authorization comes from `auth` or from headers_from_env, not both")
        return self

    @field_validator("auth")
    @classmethod
    def _no_token_exchange(cls, value: UpstreamAuth | None) -> UpstreamAuth | None:
        if value is not None and value.token_exchange is not None:
            raise ValueError(
                "token_exchange is for http: tools only (an MCP session to an upstream is "
                "not per user); use bearer_file, bearer_env or oauth_client_credentials"
            )
        return value

    @field_validator("env_from_gateway")
    @classmethod
    def _env_names(cls, value: list[str]) -> list[str]:
        for variable in value:
            if not re.fullmatch(ENV_NAME_PATTERN, variable):
                raise ValueError(f"{variable!r} is not an environment variable name")
        return value

    @field_validator("env")
    @classmethod
    def _env_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for variable in value:
            if not re.fullmatch(ENV_NAME_PATTERN, variable):
                raise ValueError(f"{variable!r} is not an environment variable name")
        return value

    @model_validator(mode="after")
    def _one_transport(self) -> McpUpstream:
        if (self.url is None) == (self.command is None):
            raise ValueError("declare exactly one of `url` (Streamable HTTP) or `command` (stdio)")
        if self.url is not None and (self.args or self.env or self.env_from_gateway or self.cwd):
            raise ValueError("args, env, env_from_gateway and cwd are for a stdio `command`")
        if self.command is not None and (self.headers_from_env or self.auth is not None):
            raise ValueError("headers_from_env and auth are for an HTTP `url`")
        if self.definition is not None:
            pinned = mcp_definition_sha256(
                self.tool,
                self.definition.description,
                self.definition.input_schema,
                self.definition.output_schema,
            )
            if pinned != self.definition_sha256:
                raise ValueError(
                    "definition does not hash to definition_sha256 (re-import, or "
                    "toolgate tools accept)"
                )
        return self

    @property
    def server(self) -> str:
        """The upstream as people name it: its URL, or its command line."""
        if self.url is not None:
            return self.url
        import shlex

        return shlex.join([self.command or "", *self.args])


def mcp_definition_sha256(
    name: str,
    description: str | None,
    input_schema: Any,
    output_schema: Any,
) -> str:
    """The pinned hash of an upstream MCP tool's definition: name, description, schemas."""
    canonical = json.dumps(
        {
            "name": name,
            "description": description or "",
            "inputSchema": input_schema,
            "outputSchema": output_schema,
        },
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def http_arguments_fit(http: HttpUpstream, input_schema: dict[str, Any]) -> None:
    """An HTTP tool's url placeholders, `query` and `body` name arguments the input_schema
    declares; a path argument is required and a string, integer or number (ValueError)."""
    properties = input_schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = input_schema.get("required") or []
    for name in http.path_parameters:
        kind = properties.get(name, {}).get("type") if name in properties else None
        if name not in required or kind not in ("string", "integer", "number"):
            raise ValueError(
                f"http.url placeholder {{{name}}} must be a required string, integer or number "
                "property of the input_schema"
            )
    for name in [*http.query, *([http.body] if http.body else [])]:
        if name not in properties:
            raise ValueError(f"http: {name!r} is not a property of the input_schema")
        if name in http.path_parameters:
            raise ValueError(f"http: {name!r} fills the url path; it cannot be sent again")
    if http.body is not None and http.body in http.query:
        raise ValueError(f"http: {http.body!r} cannot be both the body and in the query")
    if http.body is not None and http.method in ("GET", "HEAD"):
        raise ValueError(f"http: a {http.method} request carries no body")


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = Field(min_length=1)
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    # Exactly one of: the Python function behind the tool, an upstream MCP tool, or one
    # HTTP request.
    function: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    mcp: McpUpstream | None = None
    http: HttpUpstream | None = None
    read_only: bool
    timeout_s: float = Field(gt=0, le=3600)
    risk: Risk
    requires_approval: bool = False
    # Whether running the function again for the same call_id is harmless
    # (it dedupes on call_id itself, or has no side effect). The executor
    # re-runs an interrupted call only when this is true.
    idempotent: bool = False
    retryable_errors: bool = True
    # The argument that names the task the call writes into; when set, the
    # policy requires it to equal the call's own task_id (no cross-task writes).
    task_scope: str | None = None
    allowed_agents: list[str] = Field(min_length=1)
    rate_limit: RateLimit | None = None
    audit: AuditSpec = AuditSpec()
    # Tool-specific settings, passed to the function's context (hosts, paths, ...).
    settings: dict[str, Any] = {}
    # What the tool does (None: read when read_only, else write); the request's Cedar action.
    action: ActionClass | None = None
    # The resources it acts on, each looked up before the decision (see ResourceSpec).
    resources: list[ResourceSpec] = []
    # Whether the tool acts for the call's end user. With an OIDC issuer configured, a
    # call to such a tool needs the user's verified token (and the tool gets it in
    # `ToolContext.subject_token`); false: the tool needs no user token.
    acts_for_user: bool = True

    @field_validator("name")
    @classmethod
    def _name_is_subject_safe(cls, value: str) -> str:
        if not TOOL_NAME_PATTERN.fullmatch(value):
            raise ValueError("must match ^[a-z][a-z0-9_]{0,63}$ (it names a subject)")
        return value

    @field_validator("input_schema", "output_schema")
    @classmethod
    def _is_valid_json_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        import jsonschema_rs

        try:
            jsonschema_rs.validator_for(value)
        except Exception as exc:  # jsonschema_rs raises ValidationError / ValueError
            raise ValueError(f"not a valid JSON Schema: {exc}") from exc
        return value

    @model_validator(mode="after")
    def _one_implementation(self) -> ToolSpec:
        if [self.function, self.mcp, self.http].count(None) != 2:
            raise ValueError(
                "declare exactly one of `function` (package.module:attr), `mcp` "
                "({url, tool, definition_sha256}: an upstream MCP tool) or `http` "
                "({method, url, ...}: one HTTP request)"
            )
        if self.http is not None:
            http_arguments_fit(self.http, self.input_schema)
            auth = self.http.auth
            if auth is not None and auth.token_exchange is not None and not self.acts_for_user:
                raise ValueError(
                    "an http tool with auth token_exchange acts for the call's user: "
                    "acts_for_user cannot be false (it exchanges the user's token)"
                )
        return self

    @model_validator(mode="after")
    def _action_and_resources_fit(self) -> ToolSpec:
        if self.read_only and self.action not in (None, "read"):
            raise ValueError(f"a read_only tool cannot declare action {self.action!r}")
        seen: set[tuple[str, str]] = set()
        for resource in self.resources:
            if (resource.type, resource.id) in seen:
                raise ValueError(f"resource {resource.type} at {resource.id} is declared twice")
            seen.add((resource.type, resource.id))
            reached = _schema_at(self.input_schema, pointer_steps(resource.id))
            if not _names_ids(reached):
                raise ValueError(
                    f"resource {resource.type}: {resource.id} must point at a string (or a list "
                    "of strings) property of the input_schema"
                )
        return self

    @property
    def action_class(self) -> str:
        """The Cedar action of this tool's calls: declared, else read or write."""
        if self.action is not None:
            return self.action
        return "read" if self.read_only else "write"

    def agent_allowed(self, agent: str) -> bool:
        return "*" in self.allowed_agents or agent in self.allowed_agents


class Registry:
    """The loaded tools, by name, and a content hash that versions them."""

    def __init__(self, tools: dict[str, ToolSpec]) -> None:
        self._tools = dict(tools)
        canonical = json.dumps(
            {name: spec.model_dump(mode="json") for name, spec in sorted(tools.items())},
            sort_keys=True,
        )
        self.version = hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def get(self, name: str) -> ToolSpec | None:
        return self._tools.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def visible_to(self, agent: str) -> list[ToolSpec]:
        """The tools `agent` may call, by name: what an agent-facing listing shows.

        MCP's tools/list and the framework toolkits show exactly these; policy
        still decides each call (a listed tool can be denied, never the reverse).
        """
        return [
            self._tools[name] for name in self.names() if self._tools[name].agent_allowed(agent)
        ]

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)


def read_yaml(text: str) -> Any:
    """One YAML document, as `yaml.safe_load` reads it (with libyaml when there)."""
    return yaml.load(text, Loader=_YAML_LOADER)


def load_tool_file(path: Path) -> ToolSpec:
    try:
        text = path.read_text()
    except OSError as exc:
        raise RegistryError(f"{path}: cannot read: {exc}") from exc
    return load_tool_text(text, str(path))


def load_tool_text(text: str, where: str) -> ToolSpec:
    """One tool file's text (`where` names it in errors: a path, or a pushed file's name)."""
    try:
        raw = read_yaml(text)
    except yaml.YAMLError as exc:
        raise RegistryError(f"{where}: cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise RegistryError(f"{where}: expected a mapping at the top level")
    try:
        return ToolSpec.model_validate(raw)
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '<root>'}': {err['msg']}"
            for err in exc.errors()
        )
        raise RegistryError(f"{where}: {problems}") from exc


def tool_dirs(dirs: Iterable[Path] = (), builtin_tools: bool = True) -> list[Path]:
    """The directories a registry is loaded from: the built-in tools (unless dropped,
    `--no-builtin-tools`), then `dirs`, each directory once.

    RegistryError if that leaves none (no built-in tools and no directory).
    """
    found: list[Path] = []
    seen: set[Path] = set()
    for directory in [*([BUILTIN_TOOLS_DIR] if builtin_tools else []), *dirs]:
        key = directory.resolve()
        if key not in seen:
            seen.add(key)
            found.append(directory)
    if not found:
        raise RegistryError(
            "no tools: without the built-in tools (--no-builtin-tools) name a directory "
            "of tool files (--registry DIR or $TOOLGATE_REGISTRY)"
        )
    return found


def load_registry(*dirs: Path) -> Registry:
    """Load every `*.yaml` in `dirs` (none: the built-in tools). Directories add up; a
    tool name declared twice is refused, naming both files (`tool_dirs` says which
    directories a gateway reads: the built-in tools and its --registry directories)."""
    tools: dict[str, ToolSpec] = {}
    declared_in: dict[str, Path] = {}
    for directory in dirs or (BUILTIN_TOOLS_DIR,):
        if not directory.is_dir():
            raise RegistryError(f"{directory}: not a directory")
        for path in sorted(directory.glob("*.yaml")):
            spec = load_tool_file(path)
            if spec.name in tools:
                first = declared_in[spec.name]
                hint = (
                    " (a built-in tool: leave it out, or replace the built-in tools with "
                    "--no-builtin-tools and copy the ones you keep)"
                    if first.parent.resolve() == BUILTIN_TOOLS_DIR.resolve()
                    else ""
                )
                raise RegistryError(
                    f"{path}: tool '{spec.name}' is declared twice, also in {first}{hint}"
                )
            tools[spec.name] = spec
            declared_in[spec.name] = path
    return Registry(tools)
