"""Runtime settings, read once in `main()` from flags and environment."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, Registry, load_registry

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def env_nats_url() -> str:
    return os.environ.get("TOOLGATE_NATS_URL", DEFAULT_NATS_URL)


def env_nats_url_or_none() -> str | None:
    return os.environ.get("TOOLGATE_NATS_URL") or None


def env_data_dir() -> Path:
    return Path(os.environ.get("TOOLGATE_DATA_DIR", ".toolgate"))


def env_nats_creds() -> Path | None:
    raw = os.environ.get("TOOLGATE_NATS_CREDS", "")
    return Path(raw) if raw else None


def env_registry_dirs() -> list[Path]:
    raw = os.environ.get("TOOLGATE_REGISTRY", "")
    return [Path(p) for p in raw.split(os.pathsep) if p]


class GatewaySettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    nats_url: str = DEFAULT_NATS_URL
    # This service's role on a locked bus (services/stack/nats_auth.py); None: no auth.
    nats_creds: Path | None = None
    data_dir: Path = Path(".toolgate")
    # Empty: the built-in tools. Several directories add up (a name may not repeat).
    registry_dirs: tuple[Path, ...] = ()
    # The largest call the validator accepts; larger ones get PAYLOAD_TOO_LARGE.
    max_call_bytes: int = 1024 * 1024
    # How long a signed authorization stays valid for the executor.
    authorization_ttl_s: float = 3600.0

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"

    @property
    def tools_data_dir(self) -> Path:
        return self.data_dir / "tools"

    def load_registry(self) -> Registry:
        return load_registry(*(self.registry_dirs or (BUILTIN_TOOLS_DIR,)))
