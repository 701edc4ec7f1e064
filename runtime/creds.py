"""Reading NATS credentials: what every service and client needs to log in.

A creds file is the standard NATS one (user JWT + nkey seed, as `nsc` and
`toolgate agents add` write them); nats-py reads it itself. Minting them is
the dev stack's job (toolgate.stack.nats_auth), not this module's.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from toolgate.contracts import subjects

ENV_CREDS = "TOOLGATE_NATS_CREDS"


class CredentialsError(ValueError):
    """A creds file is missing or unreadable, or an identity cannot be made as asked."""


def nats_servers(nats_url: str) -> list[str]:
    """The server URLs in a NATS URL: several, comma-separated, name a cluster's nodes
    (nats-py wants them as a list; it tries them in turn and fails over between them)."""
    return [part.strip() for part in nats_url.split(",") if part.strip()]


DEFAULT_INBOX_PREFIX = "_INBOX"


def connect_options(creds_path: Path | str | None) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` that log in with this creds file ({} for None),
    with the reply-inbox prefix the creds' user may subscribe to when it has its own."""
    if creds_path is None:
        return {}
    path = Path(creds_path)
    if not path.is_file():
        raise CredentialsError(f"no credentials file at {path}")
    options: dict[str, Any] = {"user_credentials": str(path)}
    prefix = inbox_prefix_of(path)
    if prefix is not None:
        options["inbox_prefix"] = prefix
    return options


def inbox_prefix_of(creds: Path | str) -> str | None:
    """The creds' own reply-inbox prefix: the `_INBOX...` subject its user may subscribe
    to (`<prefix>.>`) when that is not the shared `_INBOX`; else None (the default).

    Approvers and the web inbox have one each (stack/nats_auth.py): the server lets
    only them read the replies sent there.
    """
    try:
        token, _ = read_creds(Path(creds).read_text())
        allowed = jwt_claims(token).get("nats", {}).get("sub", {}).get("allow") or []
    except (OSError, ValueError, AttributeError):
        return None
    for subject in allowed:
        text = str(subject)
        if text.startswith(DEFAULT_INBOX_PREFIX) and text.endswith(".>"):
            prefix = text[: -len(".>")]
            if prefix != DEFAULT_INBOX_PREFIX and not any(c in prefix for c in "*> "):
                return prefix
    return None


def broker_options(creds_path: Path | str | None) -> dict[str, Any]:
    """The same for FastStream's `NatsBroker` (its `security`, not the deprecated
    `user_credentials`)."""
    from faststream.nats import NatsCredentials

    options = connect_options(creds_path)
    if not options:
        return {}
    return {"security": NatsCredentials(options["user_credentials"])}


def env_creds() -> Path | None:
    """The default `--creds`: $TOOLGATE_NATS_CREDS, or none (an unlocked bus)."""
    value = os.environ.get(ENV_CREDS, "")
    return Path(value) if value else None


def read_creds(text: str) -> tuple[str, str]:
    """(user JWT, user seed) of a decorated creds file."""
    lines = [line.strip() for line in text.splitlines()]

    def after(marker: str) -> str:
        for index, line in enumerate(lines):
            if line.startswith("-----BEGIN") and marker in line and index + 1 < len(lines):
                return lines[index + 1]
        return ""

    token, seed = after("USER JWT"), after("NKEY SEED")
    if not token or not seed.startswith("SU"):
        raise ValueError("not a NATS creds file (user JWT and seed)")
    return token, seed


def jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT, unverified (the server verifies; we only read our own name)."""
    parts = token.strip().split(".")
    if len(parts) != 3:
        raise ValueError("not a JWT")
    claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    if not isinstance(claims, dict):
        raise ValueError("JWT claims are not an object")
    return claims


def identity_of_creds(creds: Path | str) -> tuple[str, str] | None:
    """(tenant, agent) an agent creds file speaks for, from its user JWT tags; else None."""
    try:
        token, _ = read_creds(Path(creds).read_text())
        tags = jwt_claims(token).get("nats", {}).get("tags") or []
    except (OSError, ValueError):
        return None
    found = dict(str(t).split(":", 1) for t in tags if ":" in str(t))
    tenant, agent = found.get("tenant"), found.get("agent")
    if subjects.is_identity_token(tenant) and subjects.is_identity_token(agent):
        return str(tenant), str(agent)
    return None
