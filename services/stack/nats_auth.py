"""The locked bus: one NATS nkey user per role, allowed only its own subjects.

`infra/nats/permissions.yaml` declares each role's allow lists as data.
`create_credentials(data_dir)` turns it into:

- `creds/<role>.creds`: the role's nkey seed (mode 0600), in the decorated
  form NATS tools read, with a comment header naming the role and its inbox
  prefix. Created once; re-running keeps every existing key.
- `creds/nats-auth.conf`: the server's `accounts` block (public keys and
  permissions only, no secrets), rendered afresh each time and included by
  the nats-server config.

A client turns a creds file into connection arguments with
`connect_options(path)` (nats.connect) or `broker_options(path)` (NatsBroker).
Nkeys rather than passwords: the server config holds public keys only, and
the secret never crosses the wire (the client signs the server's nonce).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
import yaml

from toolgate.contracts import subjects
from toolgate.contracts.events import TERMINAL_EVENTS

PERMISSIONS_FILE = Path(__file__).resolve().parents[2] / "infra" / "nats" / "permissions.yaml"
CREDS_DIR = "creds"
AUTH_CONFIG = "nats-auth.conf"
ENV_CREDS = "TOOLGATE_NATS_CREDS"
DEFAULT_INBOX = "_INBOX"
JS_API = "$JS.API"

_SEED_BEGIN = "-----BEGIN USER NKEY SEED-----"
_SEED_END = "------END USER NKEY SEED------"
_INBOX_LINE = re.compile(r"^#\s*inbox_prefix:\s*(\S+)\s*$", re.MULTILINE)
_ROLE_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,63}$")


class CredentialsError(ValueError):
    pass


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
    document = yaml.safe_load(Path(path).read_text())
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


def expand(entry: Any, scalars: Mapping[str, str],
           lists: Mapping[str, list[str]]) -> list[Any]:
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
    return [f"{JS_API}.STREAM.MSG.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}",
            f"{JS_API}.DIRECT.GET.{stream}.>"]


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
            for kv in expand({k: v for k, v in entry.items() if k not in flags},
                             scalars, lists):
                publish += _kv_subjects(kv["bucket"], kv.get("access", "read"), **flags)
        for entry in spec.get("get_messages") or []:
            for stream in expand(entry, scalars, lists):
                publish += _get_subjects(stream)
        roles.append(RolePermissions(
            role=str(role), inbox=inbox, unrestricted=bool(spec.get("unrestricted", False)),
            publish=_unique(publish), subscribe=_unique(subscribe),
            allow_responses=bool(spec.get("allow_responses", False))))
    return roles


def render_auth_config(account: str, roles: list[RolePermissions],
                       public_keys: Mapping[str, str]) -> str:
    """nats-server config syntax: one account, one nkey user per role."""

    def quoted(items: Iterable[str]) -> str:
        # Double-quoted, so `$JS...` is a string, not a config variable.
        return "[" + ", ".join(json.dumps(s) for s in items) + "]"

    lines = [
        "# Generated by toolgate.services.stack.nats_auth from infra/nats/permissions.yaml.",
        "# Do not edit: re-run `toolgate up` (or create_credentials) instead.",
        "accounts {",
        f"  {json.dumps(account)} {{",
        "    jetstream: enabled",
        "    users: [",
    ]
    for role in roles:
        lines.append(f"      # {role.role}")
        user = f"nkey: {json.dumps(public_keys[role.role])}"
        if role.unrestricted:
            lines.append(f"      {{{user}}}")
            continue
        lines += [
            f"      {{{user}, permissions: {{",
            f"        publish: {{allow: {quoted(role.publish)}}}",
            f"        subscribe: {{allow: {quoted(role.subscribe)}}}",
            *(["        allow_responses: true"] if role.allow_responses else []),
            "      }}",
        ]
    lines += ["    ]", "  }", "}", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- creds files


def _new_seed() -> str:
    return nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode()


def public_key_of(seed: str) -> str:
    key_pair = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return str(key_pair.public_key.decode())
    finally:
        key_pair.wipe()


def read_seed(text: str) -> str:
    """The user seed of a creds file: decorated (ours, nsc's) or a bare seed file."""
    lines = [line.strip() for line in text.splitlines()]
    if _SEED_BEGIN in lines:
        index = lines.index(_SEED_BEGIN) + 1
        seed = lines[index] if index < len(lines) else ""
    else:
        seed = next((line for line in lines if line.startswith("SU")), "")
    if not seed.startswith("SU"):
        raise CredentialsError("no user nkey seed found")
    return seed


def _creds_text(role: str, seed: str, inbox: str) -> str:
    return (
        f"# toolgate NATS credentials: role {role}, nkey user {public_key_of(seed)}\n"
        "# Secret: anyone with this file connects as this role. Keep it mode 0600.\n"
        f"# inbox_prefix: {inbox}\n"
        f"{_SEED_BEGIN}\n{seed}\n{_SEED_END}\n"
    )


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, atomically (never a readable half-file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def create_credentials(data_dir: Path, tools: Iterable[str] | None = None,
                       permissions_file: Path = PERMISSIONS_FILE) -> Credentials:
    """Create missing role keys under data_dir/creds/ and render the server's auth config.

    `tools`: the registry's tool names (the executor gets one durable per tool);
    default the built-in tools. Existing keys are kept, so running services and
    agents holding a creds file stay valid; the auth config is rewritten, so a
    changed permissions.yaml or tool list takes effect on the next server start
    (or `nats-server --signal reload`).
    """
    if tools is None:
        from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry

        tools = load_registry(BUILTIN_TOOLS_DIR).names()
    document = load_permissions(permissions_file)
    roles = role_permissions(document, tools)
    directory = Path(data_dir) / CREDS_DIR
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    public_keys: dict[str, str] = {}
    for role in roles:
        path = creds_path(directory, role.role)
        seed = read_seed(path.read_text()) if path.exists() else _new_seed()
        text = _creds_text(role.role, seed, role.inbox)
        if not path.exists() or path.read_text() != text or (path.stat().st_mode & 0o077):
            _write_private(path, text)
        public_keys[role.role] = public_key_of(seed)
    auth_config = directory / AUTH_CONFIG
    rendered = render_auth_config(str(document.get("account", "TOOLGATE")), roles, public_keys)
    if not auth_config.exists() or auth_config.read_text() != rendered:
        tmp = auth_config.with_name(f".{AUTH_CONFIG}.tmp")
        tmp.write_text(rendered)
        os.replace(tmp, auth_config)
    return Credentials(directory=directory, auth_config=auth_config, public_keys=public_keys)


# ---------------------------------------------------------------- clients


def _read_creds(creds_path: Path | str) -> tuple[str, str]:
    text = Path(creds_path).read_text()
    found = _INBOX_LINE.search(text)
    return read_seed(text), (found.group(1) if found else DEFAULT_INBOX)


def connect_options(creds_path: Path | str | None) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` that log in with this creds file ({} for None)."""
    if creds_path is None:
        return {}
    seed, inbox = _read_creds(creds_path)
    return {"nkeys_seed_str": seed, "inbox_prefix": inbox}


def broker_options(creds_path: Path | str | None) -> dict[str, Any]:
    """The same for FastStream's `NatsBroker` (which takes the seed as `security`)."""
    if creds_path is None:
        return {}
    from faststream.nats import NatsNKey

    seed, inbox = _read_creds(creds_path)
    return {"security": NatsNKey.from_seed(seed), "inbox_prefix": inbox}


def env_creds() -> Path | None:
    """The default `--creds`: $TOOLGATE_NATS_CREDS, or none (an unlocked bus)."""
    value = os.environ.get(ENV_CREDS, "")
    return Path(value) if value else None
