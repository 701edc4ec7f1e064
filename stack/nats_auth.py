"""The locked bus: NATS operator mode, one account per agent, one user per role.

NATS's own decentralized auth does the isolating (see DESIGN.md and
`../shared/notes/nats-tenant-isolation.md` for why accounts and not users):

- account `TOOLGATE` holds the streams, the buckets and the services; each
  service role is a user of it whose permissions come from
  `infra/nats/permissions.yaml` (its allow lists, as data).
- each agent of each tenant (`toolgate agents add TENANT AGENT`) is an account
  of its own with exactly four imports from TOOLGATE: the service
  `toolgate.calls.<tenant>.<agent>` (publish a call, get the publish ack), the
  stream `toolgate.results.<tenant>.<agent>.>` (its live results) and the
  service `$JS.API.DIRECT.GET.TOOLGATE_RESULTS.toolgate.results.<tenant>.<agent>.>`
  (re-read a stored result of its own) and the service
  `toolgate.tools.<tenant>.<agent>` (ask for its own tool listing). Its single user may publish and
  subscribe to nothing else. Replies cannot cross accounts, so nothing an
  agent publishes can land in another's subjects or in toolgate's streams.
- account `APPROVERS` imports only the approvals service's request subjects
  (with `share`: the server tells the service which user asks, in the header
  `Nats-Request-Info`); approvers never touch the streams or buckets. Each
  approver is a user of its own (`toolgate approvals add-approver`) whose
  replies come to a prefix only it may subscribe to, so no approver reads
  another's answers; the web inbox is one more user, `inbox`, likewise.
- account `SYS` is the server's system account; its user pushes account JWTs
  to the running server (`$SYS.REQ.CLAIMS.UPDATE`) so agents are added and
  revoked without a restart.

Every key is an nkey made here (DATA_DIR/auth, mode 0700); credentials are
standard NATS creds files (user JWT + seed, as `nsc` writes them) under
DATA_DIR/creds, usable by any NATS client (`nats --creds FILE`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import string
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path
from typing import Any

import nkeys

from toolgate.contracts import subjects
from toolgate.contracts.events import TERMINAL_EVENTS
from toolgate.contracts.registry import read_yaml
from toolgate.runtime.creds import CredentialsError, connect_options, nats_servers
from toolgate.runtime.topology import MAX_MESSAGE_BYTES
from toolgate.stack import nats_jwt

# Package data (read where the package is installed, never from a source tree).
PERMISSIONS_FILE = Path(str(files("toolgate.infra.nats").joinpath("permissions.yaml")))
CREDS_DIR = "creds"
AGENT_CREDS_DIR = "agents"
AUTH_DIR = "auth"
AUTH_CONFIG = "nats-auth.conf"
RESOLVER_DIR = "resolver"
# The names of tools ever pushed (`toolgate tools push`): the executor's creds grant them.
PUSHED_TOOLS_FILE = "pushed-tools.json"
TOOLGATE_ACCOUNT = "TOOLGATE"
APPROVERS_ACCOUNT = "APPROVERS"
# The MCP front door (services/mcp_front): its own account, importing only agents' subjects.
MCP_FRONT_ACCOUNT = "MCP_FRONT"
SYSTEM_ACCOUNT = "SYS"
# Roles that are not TOOLGATE users: the system user and the web inbox's user.
SYSTEM_ROLE = "sys"
INBOX_ROLE = "inbox"
# Each approver is a user of APPROVERS of its own (`toolgate approvals add-approver`),
# whose replies come only to <this>.<its user key>.>, which only it may subscribe to.
APPROVER_CREDS_DIR = "approvers"
APPROVER_INBOX_PREFIX = "_INBOX_approver"
MCP_FRONT_ROLE = "mcp_front"
DEFAULT_INBOX = "_INBOX"
JS_API = "$JS.API"

_ROLE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


@dataclass(frozen=True)
class Credentials:
    """Where the credentials of one data directory are, and who they are."""

    directory: Path
    auth_config: Path
    public_keys: Mapping[str, str]  # role -> nkey user public key

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(self.public_keys)

    def path(self, role: str) -> Path:
        if role not in self.public_keys:
            raise CredentialsError(f"no such role: {role!r} (have: {', '.join(self.roles)})")
        return creds_path(self.directory, role)


def creds_path(creds_dir: Path, role: str) -> Path:
    return Path(creds_dir) / f"{role}.creds"


# ---------------------------------------------------------------- permissions


@dataclass(frozen=True)
class RolePermissions:
    role: str
    inbox: str
    unrestricted: bool
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False


def load_permissions(path: Path = PERMISSIONS_FILE) -> dict[str, Any]:
    document = read_yaml(Path(path).read_text())
    if not isinstance(document, dict) or not isinstance(document.get("roles"), dict):
        raise CredentialsError(f"{path}: expected a mapping with `roles`")
    for role in document["roles"]:
        if not _ROLE_NAME.fullmatch(str(role)):
            raise CredentialsError(f"{path}: bad role name {role!r}")
    return document


def subject_vars(document: Mapping[str, Any]) -> dict[str, str]:
    """Scalar placeholders: the yaml's `vars`, overridden by subjects.py constants."""
    found = {str(k): str(v) for k, v in (document.get("vars") or {}).items()}
    for name in dir(subjects):
        value = getattr(subjects, name)
        if name.isupper() and isinstance(value, str):
            found[name.lower()] = value
    return found


def list_vars(tools: Iterable[str]) -> dict[str, list[str]]:
    """Placeholders that expand one entry into one entry per value."""
    tool_names = sorted(set(tools))
    for tool in tool_names:
        if not subjects.TOOL_NAME_PATTERN.fullmatch(tool):
            raise CredentialsError(f"tool name {tool!r} cannot be part of a subject")
    return {"tool": tool_names, "terminal_event": [t.__name__ for t in TERMINAL_EVENTS]}


def _fields(text: str) -> set[str]:
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


def expand(entry: Any, scalars: Mapping[str, str], lists: Mapping[str, list[str]]) -> list[Any]:
    """`entry` (a string or a flat mapping of strings) once per binding of its list vars."""
    texts = list(entry.values()) if isinstance(entry, dict) else [entry]
    names = set().union(*(_fields(str(t)) for t in texts))
    unknown = names - set(scalars) - set(lists)
    if unknown:
        raise CredentialsError(f"unknown placeholder(s) {sorted(unknown)} in {entry!r}")
    looped = sorted(names & set(lists))
    expanded: list[Any] = []
    for values in itertools.product(*(lists[n] for n in looped)):
        binding = {**scalars, **dict(zip(looped, values, strict=True))}
        if isinstance(entry, dict):
            expanded.append({k: str(v).format_map(binding) for k, v in entry.items()})
        else:
            expanded.append(str(entry).format_map(binding))
    return expanded


def _consumer_subjects(stream: str, durable: str, filter_subject: str) -> list[str]:
    """What a pull consumer of this durable publishes (its deliveries come to its inbox)."""
    return [
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.CONSUMER.INFO.{stream}.{durable}",
        # nats-py (server >= 2.9) creates a named consumer with its filter in the
        # subject, so the server itself pins this durable to this filter.
        f"{JS_API}.CONSUMER.CREATE.{stream}.{durable}.{filter_subject}",
        f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
        # ack, nak, in-progress and term all go to the delivered message's reply subject.
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _kv_subjects(bucket: str, access: str, watch: bool, create: bool) -> list[str]:
    if access not in ("read", "write"):
        raise CredentialsError(f"kv access must be read or write, not {access!r}")
    stream = f"KV_{bucket}"
    publish = [
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
    ]
    if access == "write":
        publish.append(f"$KV.{bucket}.>")
    if create:
        # Services open their bucket "created if missing"; this lets them create
        # exactly that one (STREAM.UPDATE stays the operator's).
        publish.append(f"{JS_API}.STREAM.CREATE.{stream}")
    if watch:
        # Watchers (and keys()) are unnamed ordered push consumers: nats-py creates
        # them on CONSUMER.CREATE.<stream> with no name, so no filter is pinned in
        # the subject; they can only read this bucket's stream all the same.
        publish += [
            f"{JS_API}.CONSUMER.CREATE.{stream}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.>",
            f"{JS_API}.CONSUMER.INFO.{stream}.*",
            f"{JS_API}.CONSUMER.DELETE.{stream}.*",
            f"$JS.FC.{stream}.>",
        ]
    return publish


def _get_subjects(stream: str) -> list[str]:
    return [
        f"{JS_API}.STREAM.MSG.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
    ]


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def role_permissions(document: Mapping[str, Any], tools: Iterable[str]) -> list[RolePermissions]:
    """Each role's allow lists, with every placeholder and helper expanded."""
    scalars = subject_vars(document)
    lists = list_vars(tools)
    roles = []
    for role, spec in document["roles"].items():
        spec = spec or {}
        inbox = str(spec.get("inbox", DEFAULT_INBOX))
        publish: list[str] = []
        subscribe: list[str] = [f"{inbox}.>"]
        for entry in spec.get("publish") or []:
            publish += expand(entry, scalars, lists)
        for entry in spec.get("subscribe") or []:
            subscribe += expand(entry, scalars, lists)
        for entry in spec.get("consume") or []:
            for c in expand(entry, scalars, lists):
                publish += _consumer_subjects(c["stream"], c["durable"], c["filter"])
        for entry in spec.get("kv") or []:
            flags = {k: bool(entry.get(k, False)) for k in ("watch", "create")}
            for kv in expand({k: v for k, v in entry.items() if k not in flags}, scalars, lists):
                publish += _kv_subjects(kv["bucket"], kv.get("access", "read"), **flags)
        for entry in spec.get("get_messages") or []:
            for stream in expand(entry, scalars, lists):
                publish += _get_subjects(stream)
        roles.append(
            RolePermissions(
                role=str(role),
                inbox=inbox,
                unrestricted=bool(spec.get("unrestricted", False)),
                publish=_unique(publish),
                subscribe=_unique(subscribe),
                allow_responses=bool(spec.get("allow_responses", False)),
            )
        )
    return roles


# ---------------------------------------------------------------- keys and files


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, atomically (never a readable half-file)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _private_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def _seed(path: Path, prefix: int) -> str:
    """The nkey seed kept in `path`, created once (later runs keep every key)."""
    if path.exists():
        return path.read_text().strip()
    seed = nats_jwt.new_seed(prefix)
    _write_private(path, seed + "\n")
    return seed


def _write_if_changed(path: Path, text: str) -> None:
    if not path.exists() or path.read_text() != text or (path.stat().st_mode & 0o077):
        _write_private(path, text)


@dataclass(frozen=True)
class AuthKeys:
    """The operator's and the fixed accounts' seeds of one data directory."""

    operator: str
    system: str
    toolgate: str
    approvers: str
    mcp_front: str

    @classmethod
    def load(cls, data_dir: Path) -> AuthKeys:
        auth = _private_dir(Path(data_dir) / AUTH_DIR)
        return cls(
            operator=_seed(auth / "operator.nk", nkeys.PREFIX_BYTE_OPERATOR),
            system=_seed(auth / f"{SYSTEM_ACCOUNT}.nk", nkeys.PREFIX_BYTE_ACCOUNT),
            toolgate=_seed(auth / f"{TOOLGATE_ACCOUNT}.nk", nkeys.PREFIX_BYTE_ACCOUNT),
            approvers=_seed(auth / f"{APPROVERS_ACCOUNT}.nk", nkeys.PREFIX_BYTE_ACCOUNT),
            mcp_front=_seed(auth / f"{MCP_FRONT_ACCOUNT}.nk", nkeys.PREFIX_BYTE_ACCOUNT),
        )

    @property
    def toolgate_account(self) -> str:
        return nats_jwt.public_key(self.toolgate)


# ---------------------------------------------------------------- accounts


def _agent_imports(toolgate_account: str, tenant: str, agent: str) -> list[dict[str, Any]]:
    results = subjects.agent_results_prefix(tenant, agent)
    direct_get = subjects.direct_get_prefix(subjects.RESULTS_STREAM)
    return [
        {
            "name": "calls",
            "type": "service",
            "account": toolgate_account,
            "subject": subjects.calls_subject(tenant, agent),
        },
        {
            "name": "results",
            "type": "stream",
            "account": toolgate_account,
            "subject": f"{results}.>",
        },
        {
            "name": "stored-results",
            "type": "service",
            "account": toolgate_account,
            "subject": f"{direct_get}.{results}.>",
        },
        {
            "name": "tools",
            "type": "service",
            "account": toolgate_account,
            "subject": subjects.tools_listing_subject(tenant, agent),
        },
    ]


def agent_permissions(tenant: str, agent: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) allow lists of an agent's user: its own subjects, nothing else."""
    results = subjects.agent_results_prefix(tenant, agent)
    direct_get = subjects.direct_get_prefix(subjects.RESULTS_STREAM)
    publish = [
        subjects.calls_subject(tenant, agent),
        f"{direct_get}.{results}.>",
        subjects.tools_listing_subject(tenant, agent),
    ]
    subscribe = [f"{DEFAULT_INBOX}.>", f"{results}.>"]
    return publish, subscribe


def _toolgate_exports() -> list[dict[str, Any]]:
    # Public exports, safe because only this operator writes account JWTs: an
    # account imports exactly the subjects toolgate wrote into its JWT.
    direct_get = subjects.direct_get_prefix(subjects.RESULTS_STREAM)
    return [
        {"name": "calls", "type": "service", "subject": f"{subjects.CALLS_PREFIX}.>"},
        {"name": "results", "type": "stream", "subject": f"{subjects.RESULTS_PREFIX}.>"},
        {
            "name": "stored-results",
            "type": "service",
            "subject": f"{direct_get}.{subjects.RESULTS_PREFIX}.>",
        },
        {"name": "approvals", "type": "service", "subject": f"{subjects.APPROVALS_PREFIX}.>"},
        {"name": "tools", "type": "service", "subject": f"{subjects.TOOLS_PREFIX}.>"},
    ]


def _fixed_account_jwts(keys: AuthKeys) -> dict[str, str]:
    """account public key -> JWT, for SYS, TOOLGATE and APPROVERS."""
    toolgate = keys.toolgate_account
    return {
        nats_jwt.public_key(keys.system): nats_jwt.account_jwt(
            keys.operator, keys.system, SYSTEM_ACCOUNT
        ),
        toolgate: nats_jwt.account_jwt(
            keys.operator,
            keys.toolgate,
            TOOLGATE_ACCOUNT,
            jetstream=True,
            exports=_toolgate_exports(),
        ),
        nats_jwt.public_key(keys.approvers): nats_jwt.account_jwt(
            keys.operator,
            keys.approvers,
            APPROVERS_ACCOUNT,
            imports=[
                {
                    "name": "approvals",
                    "type": "service",
                    "account": toolgate,
                    "subject": f"{subjects.APPROVALS_PREFIX}.>",
                    "share": True,
                }
            ],
        ),
    }


def mcp_front_account_jwt(keys: AuthKeys, data_dir: Path) -> tuple[str, str]:
    """(account public key, JWT) of MCP_FRONT, the MCP front door's account.

    It imports, from TOOLGATE, the public subjects of exactly the active agents that
    hold a front-door token (`toolgate agents token`), nothing of toolgate's own: a
    compromised front door can act only as those agents, publishes no event, and,
    replies never crossing accounts, writes into none of toolgate's streams. Re-pushed
    when a token is minted or an agent revoked.
    """
    from toolgate.services.mcp_front.tokens import token_holders

    imports = [
        dict(entry, name=f"{entry['name']}-{tenant}.{agent}")
        for tenant, agent in token_holders(data_dir)
        for entry in _agent_imports(keys.toolgate_account, tenant, agent)
    ]
    token = nats_jwt.account_jwt(
        keys.operator,
        keys.mcp_front,
        MCP_FRONT_ACCOUNT,
        imports=imports,
        limits={"conn": 16, "leaf": 0, "exports": 0},
    )
    return nats_jwt.public_key(keys.mcp_front), token


# ---------------------------------------------------------------- agents


class AgentError(ValueError):
    """An agent cannot be added, found or revoked as asked."""


# What one agent's account may hold on the server (NATS's own account limits,
# enforced by nats-server: an agent past one gets the server's error, not ours).
# Each variable overrides its default when `toolgate up` or `toolgate agents add`
# issues the account's JWT.
AGENT_LIMIT_ENV = {
    # Subscriptions of one connection (nats-server applies an account's limit to each
    # of its connections): 512 x 16 connections = 8,192 at most. A GatewayClient
    # holds 3 or 4.
    "subs": ("TOOLGATE_AGENT_MAX_SUBSCRIPTIONS", 512),
    # Connections at once.
    "conn": ("TOOLGATE_AGENT_MAX_CONNECTIONS", 16),
    # Bytes in one message: the server's own max_payload, which the calls stream
    # stores, so every call the server takes gets its precise PAYLOAD_TOO_LARGE result
    # (README "Quotas"). An operator may set it lower; past it the server closes the
    # connection instead of answering.
    "payload": ("TOOLGATE_AGENT_MAX_PAYLOAD", MAX_MESSAGE_BYTES),
}


def agent_limits(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """An agent account's limits: the defaults above, or their variables (a positive
    integer each; -1 for no limit). No JetStream (agents own no stream: their calls
    are stored in TOOLGATE's, within its limits), no leaf nodes, no exports."""
    environ = os.environ if environ is None else environ
    limits: dict[str, Any] = {"leaf": 0, "exports": 0}
    for key, (variable, default) in AGENT_LIMIT_ENV.items():
        raw = environ.get(variable, "").strip()
        if not raw:
            limits[key] = default
            continue
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value < 1 and value != -1:
            raise AgentError(f"${variable}={raw!r}: give a positive integer (or -1: no limit)")
        limits[key] = value
    return limits


@dataclass(frozen=True)
class AgentRecord:
    tenant: str
    agent: str
    account: str  # the agent's account public key
    user: str  # its user's public key
    created_at: str
    revoked_at: str | None = None
    # Every user key this agent ever had that was revoked -> when (unix seconds).
    # Kept for good: re-adding an agent mints a new user key and leaves these refused.
    revocations: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.tenant}.{self.agent}"


def _agents_dir(data_dir: Path) -> Path:
    return _private_dir(Path(data_dir) / AUTH_DIR / "agents")


def agent_creds_path(data_dir: Path, tenant: str, agent: str) -> Path:
    return Path(data_dir) / CREDS_DIR / AGENT_CREDS_DIR / f"{tenant}.{agent}.creds"


def _check_identity(tenant: str, agent: str) -> None:
    for kind, value in (("tenant", tenant), ("agent", agent)):
        if not subjects.is_identity_token(value):
            raise AgentError(
                f"{kind} {value!r} is not a subject-safe token "
                "(letters, digits, '-', '_'; 1 to 64 characters)"
            )


def _read_record(path: Path) -> AgentRecord:
    return AgentRecord(**json.loads(path.read_text()))


def list_agents(data_dir: Path) -> list[AgentRecord]:
    directory = Path(data_dir) / AUTH_DIR / "agents"
    if not directory.exists():
        return []
    return [_read_record(p) for p in sorted(directory.glob("*.json"))]


def _agent_account_jwt(keys: AuthKeys, data_dir: Path, record: AgentRecord) -> str:
    seed = (_agents_dir(data_dir) / f"{record.name}.nk").read_text().strip()
    claims_imports = _agent_imports(keys.toolgate_account, record.tenant, record.agent)
    # A revocation refuses every JWT of that user key issued up to its time.
    return nats_jwt.account_jwt(
        keys.operator,
        seed,
        record.name,
        imports=claims_imports,
        revocations=dict(record.revocations) or None,
        limits=agent_limits(),
    )


def add_agent(data_dir: Path, tenant: str, agent: str) -> tuple[Path, str]:
    """Mint the account and creds of one agent; (creds path, account JWT to push).

    Adding an agent that exists (and is not revoked) returns its creds again.
    """
    _check_identity(tenant, agent)
    keys = AuthKeys.load(data_dir)
    name = f"{tenant}.{agent}"
    meta = _agents_dir(data_dir) / f"{name}.json"
    creds = agent_creds_path(data_dir, tenant, agent)
    record = _read_record(meta) if meta.exists() else None
    if record is not None and record.revoked_at is None and creds.exists():
        return creds, _agent_account_jwt(keys, data_dir, record)
    # New, or revoked: a new user key; the revoked ones stay in `revocations`.
    account_seed = _seed(_agents_dir(data_dir) / f"{name}.nk", nkeys.PREFIX_BYTE_ACCOUNT)
    user_seed = nats_jwt.new_seed(nkeys.PREFIX_BYTE_USER)
    publish, subscribe = agent_permissions(tenant, agent)
    user_token = nats_jwt.user_jwt(
        account_seed,
        user_seed,
        name,
        publish=publish,
        subscribe=subscribe,
        tags=[f"tenant:{tenant}", f"agent:{agent}"],
    )
    _private_dir(creds.parent.parent)
    _private_dir(creds.parent)
    _write_private(
        creds,
        nats_jwt.creds_text(
            user_token,
            user_seed,
            f"toolgate agent {name}: publishes only {subscribe_hint(tenant, agent)}\n"
            "Secret: anyone with this file acts as this agent. Keep it mode 0600.",
        ),
    )
    record = AgentRecord(
        tenant=tenant,
        agent=agent,
        account=nats_jwt.public_key(account_seed),
        user=nats_jwt.public_key(user_seed),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        revocations=dict(record.revocations) if record else {},
    )
    _write_private(meta, json.dumps(record.__dict__))
    return creds, _agent_account_jwt(keys, data_dir, record)


def subscribe_hint(tenant: str, agent: str) -> str:
    return (
        f"{subjects.calls_subject(tenant, agent)}; reads only "
        f"{subjects.agent_results_prefix(tenant, agent)}.>"
    )


def revoke_agent(data_dir: Path, tenant: str, agent: str) -> str:
    """Mark the agent revoked and delete its creds; return the account JWT to push."""
    _check_identity(tenant, agent)
    name = f"{tenant}.{agent}"
    meta = Path(data_dir) / AUTH_DIR / "agents" / f"{name}.json"
    if not meta.exists():
        raise AgentError(f"no agent {name} (see `toolgate agents list`)")
    record = _read_record(meta)
    if record.revoked_at is None:
        now = time.time()
        record = AgentRecord(
            **{
                **record.__dict__,
                "revoked_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
                # +1: JWT times are whole seconds; a creds file minted this very second
                # must be refused too.
                "revocations": {**record.revocations, record.user: int(now) + 1},
            }
        )
        _write_private(meta, json.dumps(record.__dict__))
    agent_creds_path(data_dir, tenant, agent).unlink(missing_ok=True)
    return _agent_account_jwt(AuthKeys.load(data_dir), data_dir, record)


async def push_account_jwts(
    nats_url: str, data_dir: Path, tokens: Iterable[str], timeout: float = 5.0
) -> None:
    """Hand account JWTs to a running server (its resolver stores them and applies them now)."""
    import nats

    nc = await nats.connect(
        nats_servers(nats_url),
        connect_timeout=timeout,
        max_reconnect_attempts=0,
        allow_reconnect=False,
        **connect_options(creds_path(Path(data_dir) / CREDS_DIR, SYSTEM_ROLE)),
    )
    try:
        for token in tokens:
            reply = await nc.request("$SYS.REQ.CLAIMS.UPDATE", token.encode(), timeout=timeout)
            answer = json.loads(reply.data or b"{}")
            error = answer.get("error")
            if error:
                raise AgentError(f"the server refused the account JWT: {error}")
    finally:
        await nc.close()


def push_account_jwts_sync(nats_url: str, data_dir: Path, tokens: Iterable[str]) -> None:
    asyncio.run(push_account_jwts(nats_url, data_dir, list(tokens)))


# ---------------------------------------------------------------- approvers


def approver_creds_path(data_dir: Path, name: str) -> Path:
    return Path(data_dir) / CREDS_DIR / APPROVER_CREDS_DIR / f"{name}.creds"


def approver_permissions(user_key: str) -> tuple[list[str], list[str]]:
    """(publish, subscribe) of an approver's user: requests to the approvals service,
    and replies on an inbox prefix of its own (its user key), nothing else."""
    return [f"{subjects.APPROVALS_PREFIX}.>"], [f"{APPROVER_INBOX_PREFIX}.{user_key}.>"]


def mint_approver(data_dir: Path, name: str) -> tuple[Path, str]:
    """A new NATS user of APPROVERS for approver `name`: (creds path, user public key).

    Each call makes a new key (a rotation): the approvals service accepts only the
    key recorded with the approver (approvers.yaml), so older creds are refused.
    Users of APPROVERS are signed by its account key: nothing to push to the server.
    """
    keys = AuthKeys.load(data_dir)
    user_seed = nats_jwt.new_seed(nkeys.PREFIX_BYTE_USER)
    user_key = nats_jwt.public_key(user_seed)
    publish, subscribe = approver_permissions(user_key)
    token = nats_jwt.user_jwt(
        keys.approvers,
        user_seed,
        f"approver {name}",
        publish=publish,
        subscribe=subscribe,
        tags=["role:approver"],
    )
    creds = approver_creds_path(data_dir, name)
    _private_dir(creds.parent.parent)
    _private_dir(creds.parent)
    _write_private(
        creds,
        nats_jwt.creds_text(
            token,
            user_seed,
            f"toolgate approver {name}: requests to the approvals service only; its replies\n"
            f"come to {APPROVER_INBOX_PREFIX}.{user_key}.> (a NATS client's inbox prefix)\n"
            "Secret: with the approver's token, anyone with this file acts as this approver.",
        ),
    )
    return creds, user_key


# ---------------------------------------------------------------- the server config


def render_auth_config(keys: AuthKeys, data_dir: Path) -> str:
    """nats-server config: operator mode, a full resolver, every known account preloaded."""
    operator = nats_jwt.operator_jwt(keys.operator, "toolgate", nats_jwt.public_key(keys.system))
    accounts = _fixed_account_jwts(keys)
    front_door, front_door_jwt = mcp_front_account_jwt(keys, data_dir)
    accounts[front_door] = front_door_jwt
    for record in list_agents(data_dir):
        accounts[record.account] = _agent_account_jwt(keys, data_dir, record)
    resolver = (Path(data_dir) / "nats" / RESOLVER_DIR).resolve()
    lines = [
        "# Generated by toolgate.stack.nats_auth: re-run `toolgate up` instead.",
        "# A client sends its user JWT in its CONNECT line; a service's permissions",
        "# (one durable per tool) make it longer than the default 4 KB allows.",
        "max_control_line: 65536",
        f"operator: {json.dumps(operator)}",
        f"system_account: {json.dumps(nats_jwt.public_key(keys.system))}",
        "resolver: {",
        "  type: full",
        f"  dir: {json.dumps(str(resolver))}",
        "  allow_delete: false",
        '  interval: "2m"',
        "}",
        "resolver_preload: {",
        *(f"  {account}: {json.dumps(token)}" for account, token in accounts.items()),
        "}",
        "",
    ]
    return "\n".join(lines)


def _user_creds(
    path: Path, account_seed: str, role: str, user_seed: str, permissions: RolePermissions | None
) -> None:
    if permissions is None or permissions.unrestricted:
        token = nats_jwt.user_jwt(account_seed, user_seed, role)
    else:
        token = nats_jwt.user_jwt(
            account_seed,
            user_seed,
            role,
            publish=list(permissions.publish),
            subscribe=list(permissions.subscribe),
            allow_responses=permissions.allow_responses,
            tags=[f"role:{role}"],
        )
    text = nats_jwt.creds_text(
        token,
        user_seed,
        f"toolgate NATS credentials: role {role}\n"
        "Secret: anyone with this file connects as this role.",
    )
    # The JWT's iat changes on each render: keep the file if only that would change.
    if path.exists():
        try:
            old_token, old_seed = nats_jwt.read_creds(path.read_text())
            old, new = nats_jwt.decode_claims(old_token), nats_jwt.decode_claims(token)
            if (
                old_seed == user_seed
                and old.get("nats") == new.get("nats")
                and old.get("iss") == new.get("iss")
                and not path.stat().st_mode & 0o077
            ):
                return
        except ValueError:
            pass
    _write_private(path, text)


def pushed_tools(data_dir: Path) -> list[str]:
    """The tool names `toolgate tools push` recorded for this data dir (none: [])."""
    try:
        found = json.loads((Path(data_dir) / AUTH_DIR / PUSHED_TOOLS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [name for name in found if isinstance(name, str)] if isinstance(found, list) else []


def record_pushed_tools(data_dir: Path, names: Iterable[str]) -> None:
    """Remember pushed tool names, so every later rendering of the executor's creds (this
    push's, `toolgate up`'s) grants their durables."""
    known = sorted({*pushed_tools(data_dir), *names})
    _private_dir(Path(data_dir) / AUTH_DIR)
    _write_private(Path(data_dir) / AUTH_DIR / PUSHED_TOOLS_FILE, json.dumps(known))


def create_credentials(
    data_dir: Path, tools: Iterable[str] | None = None, permissions_file: Path = PERMISSIONS_FILE
) -> Credentials:
    """Create missing keys, (re)issue every role's creds and render the server's config.

    `tools`: the registry's tool names (the executor gets one durable per tool);
    default the built-in tools. Seeds are kept across runs, so agents and
    running services stay valid; user JWTs are re-issued when permissions
    change (a changed permissions.yaml or tool list takes effect for a
    service at its next start).
    """
    if tools is None:
        from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry

        tools = load_registry(BUILTIN_TOOLS_DIR).names()
    # And the tools pushed since (`toolgate tools push`): the executor consumes them too.
    tools = sorted({*tools, *pushed_tools(data_dir)})
    document = load_permissions(permissions_file)
    roles = role_permissions(document, tools)
    keys = AuthKeys.load(data_dir)
    directory = _private_dir(Path(data_dir) / CREDS_DIR)
    users = _private_dir(Path(data_dir) / AUTH_DIR / "users")
    public_keys: dict[str, str] = {}
    for role in roles:
        account_seed = {INBOX_ROLE: keys.approvers, MCP_FRONT_ROLE: keys.mcp_front}.get(
            role.role, keys.toolgate
        )
        user_seed = _seed(users / f"{role.role}.nk", nkeys.PREFIX_BYTE_USER)
        _user_creds(creds_path(directory, role.role), account_seed, role.role, user_seed, role)
        public_keys[role.role] = nats_jwt.public_key(user_seed)
    system_seed = _seed(users / f"{SYSTEM_ROLE}.nk", nkeys.PREFIX_BYTE_USER)
    _user_creds(creds_path(directory, SYSTEM_ROLE), keys.system, SYSTEM_ROLE, system_seed, None)
    public_keys[SYSTEM_ROLE] = nats_jwt.public_key(system_seed)
    auth_config = directory / AUTH_CONFIG
    _write_if_changed(auth_config, render_auth_config(keys, data_dir))
    (Path(data_dir) / "nats" / RESOLVER_DIR).mkdir(parents=True, exist_ok=True)
    return Credentials(directory=directory, auth_config=auth_config, public_keys=public_keys)
