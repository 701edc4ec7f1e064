"""Runtime settings, read once in `main()` from flags, environment and the context.

The context is what `toolgate up` started, recorded in DATA_DIR/context.json
(NATS URL, ClickHouse URL, which creds are whose). Every command falls back to
it when no flag and no TOOLGATE_* variable says otherwise, so after
`toolgate up` in a folder the other commands need no connection flags there.

DATA_DIR is `--data-dir` when the command line gives one (`use_data_dir`, called
once by `toolgate`'s `main()` before any default is read), else
$TOOLGATE_DATA_DIR, else `.toolgate` in the current folder: every default below
reads the context of that one folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from toolgate.contracts.calls import MAX_CALL_BYTES
from toolgate.contracts.registry import Registry, load_registry, tool_dirs

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
CONTEXT_FILE = "context.json"


DEFAULT_DATA_DIR = Path(".toolgate")
# `--data-dir` of this command line (main() sets it before building the parser).
_given_data_dir: Path | None = None


def use_data_dir(data_dir: Path | None) -> None:
    """The data dir a command line named (`--data-dir`), or None: every context default
    (NATS URL, creds, ClickHouse URL, registry, logins) is read from it from now on."""
    global _given_data_dir
    _given_data_dir = data_dir


def env_data_dir() -> Path:
    """`--data-dir` of this command line, else $TOOLGATE_DATA_DIR, else `.toolgate`."""
    if _given_data_dir is not None:
        return _given_data_dir
    return Path(os.environ.get("TOOLGATE_DATA_DIR") or DEFAULT_DATA_DIR)


def data_dir_source() -> str:
    """Where env_data_dir() came from, for a message that says what was tried."""
    if _given_data_dir is not None:
        return "--data-dir"
    if os.environ.get("TOOLGATE_DATA_DIR"):
        return "$TOOLGATE_DATA_DIR"
    return "the default: no --data-dir, no $TOOLGATE_DATA_DIR"


def read_context(data_dir: Path | None = None) -> dict[str, Any]:
    """What `toolgate up` recorded in the data dir ({} if nothing, or unreadable)."""
    path = (data_dir or env_data_dir()) / CONTEXT_FILE
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def write_context(data_dir: Path, context: dict[str, Any]) -> None:
    path = data_dir / CONTEXT_FILE
    tmp = path.with_name(f".{CONTEXT_FILE}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(context, indent=2))
    tmp.replace(path)


def env_nats_url() -> str:
    return env_nats_url_or_none() or DEFAULT_NATS_URL


def env_nats_url_or_none() -> str | None:
    """$TOOLGATE_NATS_URL, else the URL `toolgate up` recorded, else None."""
    return os.environ.get("TOOLGATE_NATS_URL") or read_context().get("nats_url") or None


def env_nats_creds(role: str = "agent") -> Path | None:
    """$TOOLGATE_NATS_CREDS, else the creds `toolgate up` recorded for `role`, else None.

    Roles: `agent` (the default agent identity), `admin`, `approver`, a service name.
    """
    raw = os.environ.get("TOOLGATE_NATS_CREDS", "")
    if raw:
        return Path(raw)
    recorded = (read_context().get("creds") or {}).get(role)
    return Path(recorded) if recorded and Path(recorded).exists() else None


def env_clickhouse_url_or_none() -> str | None:
    return os.environ.get("TOOLGATE_CLICKHOUSE_URL") or read_context().get("clickhouse_url") or None


def clickhouse_login(role: str, data_dir: Path | None = None) -> tuple[str, str] | None:
    """(user, password) of a ClickHouse role (`writer`, `auditor`, `admin`) from the
    logins file `toolgate up` generated for its embedded server (DATA_DIR/clickhouse/
    logins.json, mode 0600, named in the context), else None."""
    recorded = read_context(data_dir).get("clickhouse_logins")
    if not isinstance(recorded, str) or not recorded:
        return None
    try:
        entry = json.loads(Path(recorded).read_text()).get(role)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict):
        return None
    user, password = entry.get("user"), entry.get("password")
    return (user, password) if isinstance(user, str) and isinstance(password, str) else None


def env_registry_dirs() -> list[Path]:
    """$TOOLGATE_REGISTRY: tool directories beside the built-in tools."""
    raw = os.environ.get("TOOLGATE_REGISTRY", "")
    return [Path(p) for p in raw.split(os.pathsep) if p]


def recorded_registry(data_dir: Path | None = None) -> tuple[list[Path], bool]:
    """The tool directories a command uses when given none, and whether the built-in
    tools come first: $TOOLGATE_REGISTRY (beside the built-in tools), else what
    `toolgate up` recorded in DATA_DIR/context.json (its --registry directories, an
    example's, and whether it ran with --no-builtin-tools), else none (the built-ins).
    """
    given = env_registry_dirs()
    if given:
        return given, True
    context = read_context(data_dir)
    dirs = [Path(p) for p in context.get("registry_dirs") or [] if isinstance(p, str) and p]
    return dirs, context.get("builtin_tools") is not False


class GatewaySettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    nats_url: str = DEFAULT_NATS_URL
    # This service's role on a locked bus (services/stack/nats_auth.py); None: no auth.
    nats_creds: Path | None = None
    data_dir: Path = Path(".toolgate")
    # Tool directories beside the built-in tools (contracts/tools/); they add up, and a
    # name may not repeat (a directory may not redefine a built-in tool).
    registry_dirs: tuple[Path, ...] = ()
    # False (`--no-builtin-tools`): only the tools of registry_dirs.
    builtin_tools: bool = True
    # The largest call the validator accepts; larger ones get PAYLOAD_TOO_LARGE.
    max_call_bytes: int = MAX_CALL_BYTES
    # How long a signed authorization stays valid for the executor.
    authorization_ttl_s: float = 3600.0
    # End users verified by OIDC (`--oidc-issuer`): a call to a tool that acts for a user
    # must carry the user's access token (runtime/oidc.py). None: `user` is the platform's
    # word, as before.
    oidc_issuer: str | None = None
    # The `aud` the user's token must name (None: not checked; a warning at start).
    oidc_audience: str | None = None
    # The claim that names the user's tenant; it must be the calling agent's tenant.
    oidc_tenant_claim: str = "tenant"
    # The MCP front door as an OAuth resource server: the claim of an access token from
    # the issuer that names the agent (the tenant: oidc_tenant_claim).
    oidc_agent_claim: str = "agent"
    # The clock skew allowed on a token's exp / nbf / iat (bounded: runtime/oidc.py).
    oidc_clock_skew_s: float = 60.0

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"

    @property
    def tools_data_dir(self) -> Path:
        return self.data_dir / "tools"

    def load_registry(self) -> Registry:
        return load_registry(*tool_dirs(self.registry_dirs, self.builtin_tools))
