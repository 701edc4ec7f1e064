"""`toolgate tools import-openapi SPEC --prefix P --out DIR`: one `http:` registry file per
operation of an OpenAPI 3.0 or 3.1 document (JSON or YAML, a local file only).

Each entry: the name from the operationId (else method and path), subject-safe and
prefixed; the description from the summary and description; the input schema from the
path and query parameters and the JSON request body (as the argument `body`); the output
schema from the first 2xx JSON response (`null` for one without content); the url from
the server (or --base-url) and the path. Local `$ref`s are resolved; a recursive schema,
an external `$ref`, a required header or cookie parameter, a body that is not JSON and
the like are refused per operation: skipped, with the reason on stderr. GET and HEAD
come in read-only at risk low; everything else at risk high with approval required until
an operator reviews the file.

The pure part (`import_operations`) takes the parsed document and returns entries and
skips; `cmd_import_openapi` reads, writes and reports.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

METHODS = ("get", "head", "post", "put", "patch", "delete")
READ_METHODS = frozenset({"GET", "HEAD"})
# A schema expanded from $refs larger than this many nodes is refused (a document can
# make a small file expand into a huge schema without any cycle).
MAX_EXPANDED_NODES = 20_000
MAX_DESCRIPTION_CHARS = 2000
DEFAULT_TIMEOUT_S = 30
# OpenAPI-only keywords with no meaning in JSON Schema 2020-12.
OPENAPI_ONLY_KEYWORDS = frozenset({"nullable", "discriminator", "xml", "externalDocs", "example"})


class NotImportable(Exception):
    """This operation (or the whole document) cannot become a registry entry: why."""


@dataclass
class Imported:
    entries: list[dict[str, Any]] = field(default_factory=list)
    # (operation, reason): "GET /orders/{id} (getOrder)", "a required header parameter ..."
    skipped: list[tuple[str, str]] = field(default_factory=list)
    # operation -> what was left out of an entry that was written (optional headers, ...)
    notes: dict[str, list[str]] = field(default_factory=dict)


# ---------------------------------------------------------------- reading


def load_document(path: Path) -> dict[str, Any]:
    """The parsed OpenAPI document (JSON or YAML); NotImportable if it is not one."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise NotImportable(f"cannot read {path}: {exc}") from None
    try:
        document = yaml.safe_load(text)  # YAML 1.1 reads JSON documents too
    except yaml.YAMLError as exc:
        raise NotImportable(f"{path} is neither JSON nor YAML: {exc}") from None
    if not isinstance(document, dict):
        raise NotImportable(f"{path}: expected a mapping at the top level")
    version = str(document.get("openapi", ""))
    if not re.match(r"^3\.[01]\.\d+", version):
        found = f"openapi {version!r}" if version else f"swagger {document.get('swagger')!r}"
        if "openapi" not in document and "swagger" not in document:
            found = "no `openapi` field"
        raise NotImportable(f"{path}: not an OpenAPI 3.0 or 3.1 document ({found})")
    if not isinstance(document.get("paths"), dict):
        raise NotImportable(f"{path}: no `paths`")
    return document


# ---------------------------------------------------------------- $ref and schemas


def _pointer(document: dict[str, Any], ref: str) -> Any:
    if not ref.startswith("#"):
        raise NotImportable(f"external $ref {ref!r} (only refs inside the file are resolved)")
    node: Any = document
    for raw in unquote(ref[1:]).split("/")[1:]:
        step = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            raise NotImportable(f"$ref {ref!r} points at nothing")
    return node


class Resolver:
    """Expands local `$ref`s; refuses cycles and expansions past MAX_EXPANDED_NODES."""

    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.nodes = 0

    def expand(self, node: Any, seen: tuple[str, ...] = ()) -> Any:
        self.nodes += 1
        if self.nodes > MAX_EXPANDED_NODES:
            raise NotImportable(
                f"its schemas expand to more than {MAX_EXPANDED_NODES} nodes through $refs"
            )
        if isinstance(node, list):
            return [self.expand(item, seen) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in seen:
                chain = " -> ".join([*seen[seen.index(ref) :], ref])
                raise NotImportable(
                    f"its schema is recursive ($ref cycle {chain}): a tool's schema must be finite"
                )
            target = self.expand(_pointer(self.document, ref), (*seen, ref))
            siblings = {k: self.expand(v, seen) for k, v in node.items() if k != "$ref"}
            if not siblings:
                return target
            if isinstance(target, dict):
                return {**target, **siblings}
            raise NotImportable(f"$ref {ref!r} points at no object")
        return {key: self.expand(value, seen) for key, value in node.items()}


def json_schema(schema: Any, openapi_30: bool) -> Any:
    """An (expanded) OpenAPI schema as JSON Schema 2020-12: 3.0's `nullable` and boolean
    exclusive bounds translated, OpenAPI-only keywords and `x-` extensions dropped."""
    if isinstance(schema, list):
        return [json_schema(item, openapi_30) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in OPENAPI_ONLY_KEYWORDS or key.startswith("x-"):
            continue
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
            out[key] = (
                {k: json_schema(v, openapi_30) for k, v in value.items()}
                if isinstance(value, dict)
                else value
            )
        elif key in ("enum", "const", "default", "examples", "required"):
            out[key] = value
        else:
            out[key] = json_schema(value, openapi_30)
    if openapi_30:
        for bound, exclusive in (("maximum", "exclusiveMaximum"), ("minimum", "exclusiveMinimum")):
            if out.get(exclusive) is True and bound in out:
                out[exclusive] = out.pop(bound)
            elif isinstance(out.get(exclusive), bool):
                out.pop(exclusive)
        if schema.get("nullable") is True:
            kind = out.get("type")
            if isinstance(kind, str):
                out["type"] = [kind, "null"]
                if "enum" in out and None not in out["enum"]:
                    out["enum"] = [*out["enum"], None]
            elif kind is None:
                out = {"anyOf": [out, {"type": "null"}]}
    return out


# ---------------------------------------------------------------- operations


def tool_name(prefix: str, method: str, path: str, operation_id: str | None) -> str:
    """PREFIX_<operationId in snake case>, else PREFIX_<method>_<path words>; at most 64."""
    words = operation_id or f"{method.lower()}_{path}"
    words = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", words)
    words = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", words)
    slug = re.sub(r"[^a-z0-9]+", "_", words.lower()).strip("_") or method.lower()
    return f"{prefix}_{slug}"[:64].rstrip("_")


def _json_media(content: Any) -> tuple[bool, Any]:
    """(has JSON content, its schema) of a `content` map."""
    if not isinstance(content, dict):
        return False, None
    for media, value in content.items():
        mime = str(media).split(";", 1)[0].strip().lower()
        if mime == "application/json" or (
            mime.startswith("application/") and mime.endswith("+json")
        ):
            schema = value.get("schema", {}) if isinstance(value, dict) else {}
            return True, schema
    return False, None


def _parameters(path_item: dict[str, Any], operation: dict[str, Any]) -> list[dict[str, Any]]:
    """The path's parameters overridden by the operation's, by (name, in)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for source in (path_item.get("parameters") or [], operation.get("parameters") or []):
        if not isinstance(source, list):
            raise NotImportable("`parameters` is not a list")
        for parameter in source:
            if not isinstance(parameter, dict) or not isinstance(parameter.get("name"), str):
                raise NotImportable("a parameter without a name")
            merged[(parameter["name"], str(parameter.get("in")))] = parameter
    return list(merged.values())


def _input_schema(
    parameters: list[dict[str, Any]],
    body: dict[str, Any] | None,
    method: str,
    openapi_30: bool,
    notes: list[str],
) -> tuple[dict[str, Any], list[str], str | None]:
    """(input_schema, query names, body argument name)."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    query: list[str] = []
    for parameter in parameters:
        name, where = parameter["name"], parameter.get("in")
        if where in ("header", "cookie"):
            if parameter.get("required"):
                raise NotImportable(
                    f"it needs the {where} parameter {name!r}: no header or cookie value comes "
                    "from the model (set a static header or `auth` in the entry by hand)"
                )
            notes.append(f"optional {where} parameter {name!r} left out")
            continue
        if where not in ("path", "query"):
            raise NotImportable(f"parameter {name!r} is in {where!r} (path or query only)")
        if name in properties:
            raise NotImportable(f"two parameters are named {name!r}")
        if "schema" not in parameter:
            raise NotImportable(f"parameter {name!r} has `content`, not a `schema`")
        schema = json_schema(parameter["schema"], openapi_30)
        if not isinstance(schema, dict):
            raise NotImportable(f"parameter {name!r} has no schema object")
        kind = schema.get("type")
        if where == "path":
            if kind not in ("string", "integer", "number"):
                raise NotImportable(f"path parameter {name!r} is not a string or a number")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,127}", name):
                raise NotImportable(f"path parameter {name!r} is not a plain name")
            parameter = {**parameter, "required": True}
        else:
            style = parameter.get("style", "form")
            explode = parameter.get("explode", style == "form")
            if kind in ("object",) or "properties" in schema:
                raise NotImportable(f"query parameter {name!r} is an object (not supported)")
            if kind == "array" and (style != "form" or not explode):
                raise NotImportable(
                    f"query parameter {name!r} is an array of style {style!r}, explode "
                    f"{explode} (form, exploded, only)"
                )
            query.append(name)
        description = parameter.get("description")
        if isinstance(description, str) and description.strip() and "description" not in schema:
            schema = {**schema, "description": description.strip()}
        properties[name] = schema
        if parameter.get("required"):
            required.append(name)
    body_name: str | None = None
    if body is not None:
        is_json, schema = _json_media(body.get("content"))
        if not is_json:
            kinds = ", ".join(map(str, (body.get("content") or {}).keys())) or "no content"
            if body.get("required"):
                raise NotImportable(f"its request body is {kinds} (JSON only)")
            notes.append(f"optional request body ({kinds}) left out")
        elif method in READ_METHODS:
            raise NotImportable(f"a {method} request with a body")
        else:
            body_name = "body" if "body" not in properties else "request_body"
            if body_name in properties:
                raise NotImportable("parameters named both `body` and `request_body`")
            properties[body_name] = json_schema(schema, openapi_30)
            if isinstance(body.get("description"), str) and isinstance(properties[body_name], dict):
                properties[body_name].setdefault("description", body["description"].strip())
            if body.get("required"):
                required.append(body_name)
    schema_out: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
    if required:
        schema_out["required"] = required
    return schema_out, query, body_name


def _output_schema(responses: Any, method: str, openapi_30: bool) -> dict[str, Any] | bool:
    if method == "HEAD":
        return {"type": "null"}
    if not isinstance(responses, dict):
        raise NotImportable("no `responses`")
    codes = sorted(
        str(code) for code in responses if re.fullmatch(r"2(\d\d|XX)", str(code).upper())
    )
    if not codes:
        raise NotImportable("it declares no 2xx response")
    response = responses.get(codes[0]) if codes[0] in responses else responses.get(int(codes[0]))
    if not isinstance(response, dict):
        raise NotImportable(f"its {codes[0]} response is not an object")
    content = response.get("content")
    if not content:
        return {"type": "null"}
    is_json, schema = _json_media(content)
    if not is_json:
        raise NotImportable(
            f"its {codes[0]} response is {', '.join(map(str, content))} (JSON only)"
        )
    converted = json_schema(schema, openapi_30)
    return converted if isinstance(converted, dict | bool) else {}


def _server_url(
    document: dict[str, Any], path_item: dict[str, Any], operation: dict[str, Any]
) -> str:
    for holder in (operation, path_item, document):
        servers = holder.get("servers")
        if isinstance(servers, list) and servers and isinstance(servers[0], dict):
            server = servers[0]
            url = str(server.get("url", ""))
            for name, variable in (server.get("variables") or {}).items():
                if isinstance(variable, dict) and "default" in variable:
                    url = url.replace("{" + str(name) + "}", str(variable["default"]))
            if not re.match(r"^https?://", url):
                raise NotImportable(
                    f"its server {url!r} is not an absolute http(s) URL: pass --base-url"
                )
            return url
    raise NotImportable("the document names no server: pass --base-url")


def _description(operation: dict[str, Any], method: str, path: str, title: str) -> str:
    parts = [
        str(operation.get(key)).strip()
        for key in ("summary", "description")
        if isinstance(operation.get(key), str) and str(operation.get(key)).strip()
    ]
    text = "\n\n".join(parts) or f"{method} {path} of {title}."
    if len(text) > MAX_DESCRIPTION_CHARS:
        text = text[:MAX_DESCRIPTION_CHARS] + "..."
    return text


def import_operations(
    document: dict[str, Any],
    prefix: str,
    base_url: str | None = None,
    agents: list[str] | None = None,
    auth: dict[str, Any] | None = None,
) -> Imported:
    """One registry entry (a dict, as the YAML file holds it) per importable operation."""
    from toolgate.contracts.registry import ToolSpec

    openapi_30 = str(document.get("openapi", "")).startswith("3.0")
    title = str((document.get("info") or {}).get("title") or "the API")
    done = Imported()
    names: set[str] = set()
    for path, raw_item in document["paths"].items():
        for method in METHODS:
            if not isinstance(raw_item, dict) or method not in raw_item:
                continue
            verb = method.upper()
            operation_id = (raw_item.get(method) or {}).get("operationId")
            label = f"{verb} {path}" + (f" ({operation_id})" if operation_id else "")
            notes: list[str] = []
            try:
                resolver = Resolver(document)
                # The path's own parameters and servers, and this operation: the other
                # operations of the path are not this one's business.
                path_item = resolver.expand(
                    {k: v for k, v in raw_item.items() if k in ("parameters", "servers")}
                )
                operation = resolver.expand(raw_item[method])
                if not isinstance(operation, dict):
                    raise NotImportable("the operation is not an object")
                name = tool_name(prefix, verb, str(path), operation_id)
                if name in names:
                    raise NotImportable(f"another operation already became {name}")
                input_schema, query, body_name = _input_schema(
                    _parameters(path_item, operation),
                    operation.get("requestBody"),
                    verb,
                    openapi_30,
                    notes,
                )
                server = base_url or _server_url(document, path_item, operation)
                http: dict[str, Any] = {"method": verb, "url": server.rstrip("/") + str(path)}
                if query:
                    http["query"] = query
                if body_name:
                    http["body"] = body_name
                if auth:
                    http["auth"] = auth
                reads = verb in READ_METHODS
                entry = {
                    "name": name,
                    "description": _description(operation, verb, str(path), title),
                    "input_schema": input_schema,
                    "output_schema": _output_schema(operation.get("responses"), verb, openapi_30),
                    "http": http,
                    "read_only": reads,
                    "idempotent": reads,
                    "timeout_s": DEFAULT_TIMEOUT_S,
                    "risk": "low" if reads else "high",
                    "requires_approval": not reads,
                    "allowed_agents": agents or ["*"],
                    "audit": {"arguments": "full", "result": "full"},
                }
                try:
                    ToolSpec.model_validate(entry)
                except ValueError as exc:
                    first = str(exc).splitlines()
                    reason = "; ".join(line.strip() for line in first[1:3]) or str(exc)
                    raise NotImportable(f"not a valid registry entry: {reason}") from None
            except NotImportable as exc:
                done.skipped.append((label, str(exc)))
                continue
            names.add(name)
            done.entries.append(entry)
            if notes:
                done.notes[name] = notes
    return done


# ---------------------------------------------------------------- the command


def _fail(line: str, code: int) -> Any:
    from toolgate.cli.common import Failed

    return Failed(line, code)


def cmd_import_openapi(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from toolgate.contracts.registry import UpstreamAuth
    from toolgate.contracts.subjects import TOOL_NAME_PATTERN
    from toolgate.runtime.outside_text import visible

    command = "toolgate tools import-openapi"
    if not TOOL_NAME_PATTERN.fullmatch(args.prefix) or len(args.prefix) > 40:
        raise _fail(
            f"{command}: --prefix {args.prefix!r} must be lower-case letters, digits and '_', "
            "starting with a letter (at most 40)",
            2,
        )
    if args.base_url is not None and not re.match(r"^https?://[^\s/?#]+", args.base_url):
        raise _fail(f"{command}: --base-url {args.base_url!r} is not an http(s) URL", 2)
    auth: dict[str, Any] | None = None
    if args.auth is not None:
        try:
            auth = yaml.safe_load(Path(args.auth).read_text(encoding="utf-8"))
            UpstreamAuth.model_validate(auth)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'auth'}: {err['msg']}"
                for err in exc.errors()
            )
            raise _fail(f"{command}: --auth {args.auth}: {visible(problems)}", 2) from None
        except (OSError, yaml.YAMLError, ValueError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise _fail(f"{command}: --auth {args.auth}: {visible(first)}", 2) from None
    try:
        document = load_document(Path(args.spec))
    except NotImportable as exc:
        raise _fail(f"{command}: {visible(str(exc))}", 2) from None
    agents = [a for a in args.agents.split(",") if a] or ["*"]
    imported = import_operations(document, args.prefix, args.base_url, agents, auth)
    for label, reason in imported.skipped:
        print(f"skipped {visible(label)}: {visible(reason)}", file=sys.stderr)
    if not imported.entries:
        raise _fail(f"{command}: no operation of {args.spec} could be imported: nothing written", 1)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    today = time.strftime("%Y-%m-%d", time.gmtime())
    for entry in imported.entries:
        path = out / f"{entry['name']}.yaml"
        left_out = "".join(
            f"# Left out: {visible(note)}.\n" for note in imported.notes.get(entry["name"], [])
        )
        header = (
            f"# Imported from {Path(args.spec).name} ({entry['http']['method']} "
            f"{visible(entry['http']['url'])}) by `{command}` on {today}.\n"
            "# Review before serving: the description is the API's own text (a model reads "
            "it).\n# risk/requires_approval/read_only/idempotent/allowed_agents are safe "
            "defaults: edit them.\n" + left_out
        )
        path.write_text(header + yaml.safe_dump(entry, sort_keys=False, allow_unicode=True))
        print(path)
    print(
        f"{len(imported.entries)} operation(s) of {args.spec} written to {out}"
        + (f", {len(imported.skipped)} skipped" if imported.skipped else "")
        + f": review them, then toolgate up --registry {out}",
        file=sys.stderr,
    )
    return 0


def register(actions: Any) -> None:
    """`import-openapi` under `toolgate tools`."""
    importer = actions.add_parser(
        "import-openapi",
        help="write one registry file per operation of an OpenAPI 3.0/3.1 document (HTTP tools)",
    )
    importer.add_argument("spec", help="the OpenAPI document: a local JSON or YAML file")
    importer.add_argument(
        "--prefix", required=True, help="registry names become PREFIX_<operation> (lower case)"
    )
    importer.add_argument("--out", type=Path, required=True, help="directory to write into")
    importer.add_argument(
        "--base-url",
        default=None,
        help="the API's base URL (default: the document's first server)",
    )
    importer.add_argument(
        "--auth",
        default=None,
        help="a YAML file with one `auth` mapping (bearer_file, bearer_env, "
        "oauth_client_credentials or token_exchange) written into every entry",
    )
    importer.add_argument(
        "--agents",
        default="*",
        help="comma-separated allowed_agents of the written entries (default %(default)s)",
    )
    importer.set_defaults(func=cmd_import_openapi)
