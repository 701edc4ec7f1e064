"""Bearer tokens of the MCP front door: one per agent, stored hashed beside the agent's record.

`toolgate agents token TENANT AGENT` mints one and prints it once; the data
dir keeps only its SHA-256 (a token holds 256 random bits, so a plain hash is
enough: there is nothing to brute-force), in
`<data-dir>/auth/agents/<tenant>.<agent>.mcp-token` (mode 0600), next to
the agent's record that `toolgate agents add` writes. Minting again replaces
the token (the old one stops working).

A token is bound to the agent's current NATS user key: revoking the agent
(`toolgate agents revoke`) marks its record revoked, and re-adding it mints a
new user key, so an old token never comes back to life. The front door
re-reads a file when it changes, so minting and revoking take effect at once.

Token format: `tgmcp.<tenant>.<agent>.<secret>` (RFC 6750 token characters;
the identity in clear only tells the front door which file to read).

With an OIDC issuer configured, the door also accepts that issuer's JWT access
tokens issued for its resource URL (`OAuthAgents`): tenant and agent from two
configurable claims, the user from `sub`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from toolgate.contracts import subjects
from toolgate.runtime.oidc import ProviderUnreachable, TokenRejected, TokenVerifier, claim_text

log = logging.getLogger("toolgate.mcp_front")

TOKEN_PREFIX: Final = "tgmcp"
TOKEN_SUFFIX: Final = ".mcp-token"
# Where `toolgate agents add` keeps an agent's record (toolgate.stack.nats_auth).
AGENTS_DIR: Final = Path("auth") / "agents"


class TokenError(ValueError):
    """A token cannot be minted as asked (no such agent, a revoked one, a bad name)."""


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_path(data_dir: Path, tenant: str, agent: str) -> Path:
    return Path(data_dir) / AGENTS_DIR / f"{tenant}.{agent}{TOKEN_SUFFIX}"


def agent_record_path(data_dir: Path, tenant: str, agent: str) -> Path:
    return Path(data_dir) / AGENTS_DIR / f"{tenant}.{agent}.json"


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


def _active_user(data_dir: Path, tenant: str, agent: str) -> str | None:
    """The agent's current NATS user key, or None if it has no record or is revoked."""
    record = _read_json(agent_record_path(data_dir, tenant, agent))
    if record is None or record.get("revoked_at") or not isinstance(record.get("user"), str):
        return None
    return str(record["user"])


def mint_token(data_dir: Path, tenant: str, agent: str) -> str:
    """A new bearer token for this (active) agent; the previous one stops working."""
    for kind, value in (("tenant", tenant), ("agent", agent)):
        if not subjects.is_identity_token(value):
            raise TokenError(
                f"{kind} {value!r} is not a subject-safe token "
                "(letters, digits, '-', '_'; 1 to 64 characters)"
            )
    user = _active_user(data_dir, tenant, agent)
    if user is None:
        raise TokenError(
            f"no active agent {tenant}.{agent} in {data_dir} (toolgate agents add {tenant} "
            f"{agent} first; a revoked agent gets no token)"
        )
    token = f"{TOKEN_PREFIX}.{tenant}.{agent}.{secrets.token_urlsafe(32)}"
    path = token_path(data_dir, tenant, agent)
    record = {
        "tenant": tenant,
        "agent": agent,
        "token_sha256": token_sha256(token),
        "agent_user": user,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps(record))
    tmp.replace(path)
    return token


def token_holders(data_dir: Path) -> list[tuple[str, str]]:
    """(tenant, agent) of every active agent holding a current token: the agents the
    front door may act for (its NATS account imports exactly these agents' subjects)."""
    holders = []
    for path in sorted((Path(data_dir) / AGENTS_DIR).glob(f"*{TOKEN_SUFFIX}")):
        stored = _read_json(path)
        if stored is None:
            continue
        tenant, agent = str(stored.get("tenant")), str(stored.get("agent"))
        if not (subjects.is_identity_token(tenant) and subjects.is_identity_token(agent)):
            continue
        if path != token_path(data_dir, tenant, agent):
            continue
        if _active_user(data_dir, tenant, agent) == stored.get("agent_user"):
            holders.append((tenant, agent))
    return holders


def parse_token(token: str) -> tuple[str, str] | None:
    """(tenant, agent) a token claims to be for, or None if it is not one of ours."""
    parts = token.split(".")
    if len(parts) != 4 or parts[0] != TOKEN_PREFIX or not parts[3]:
        return None
    tenant, agent = parts[1], parts[2]
    if not (subjects.is_identity_token(tenant) and subjects.is_identity_token(agent)):
        return None
    return tenant, agent


# Tokens recently found valid, remembered with the files that made them so (a bound:
# past it the memory starts afresh).
KNOWN_TOKENS_MAX: Final = 10_000

Stamp = tuple[int, int, int]  # (inode, size, mtime_ns) of a file


def _stamp(path: str) -> Stamp | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_ino, stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True)
class _Cached:
    stamp: Stamp
    content: dict[str, Any] | None


@dataclass(frozen=True)
class _Known:
    """A token found valid, and the stamps of the two files that said so."""

    identity: tuple[str, str]
    paths: tuple[str, str]
    stamps: tuple[Stamp, Stamp]


class TokenStore:
    """Who a token is, read from the data dir (files re-read only when they change).

    Every request costs two stats: a token found valid is remembered with the
    stamps of its token file and its agent's record, and trusted again only while
    neither file has changed (minting, revoking and re-adding all rewrite one).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self._files: dict[Path, _Cached] = {}
        self._known: dict[str, _Known] = {}

    def _read(self, path: Path) -> dict[str, Any] | None:
        stamp = _stamp(str(path))
        if stamp is None:
            self._files.pop(path, None)
            return None
        cached = self._files.get(path)
        if cached is None or cached.stamp != stamp:
            cached = _Cached(stamp, _read_json(path))
            self._files[path] = cached
        return cached.content

    def identify(self, token: str) -> tuple[str, str] | None:
        """(tenant, agent) of a valid token of an active agent, else None."""
        known = self._known.get(token)
        if known is not None:
            if (_stamp(known.paths[0]), _stamp(known.paths[1])) == known.stamps:
                return known.identity
            del self._known[token]
        identity = self._identify(token)
        if identity is not None:
            paths = (
                token_path(self.data_dir, *identity),
                agent_record_path(self.data_dir, *identity),
            )
            stamps = (self._files[paths[0]].stamp, self._files[paths[1]].stamp)
            if len(self._known) >= KNOWN_TOKENS_MAX:
                self._known.clear()
            self._known[token] = _Known(identity, (str(paths[0]), str(paths[1])), stamps)
        return identity

    def _identify(self, token: str) -> tuple[str, str] | None:
        claimed = parse_token(token)
        if claimed is None:
            return None
        tenant, agent = claimed
        stored = self._read(token_path(self.data_dir, tenant, agent))
        if stored is None or not isinstance(stored.get("token_sha256"), str):
            return None
        if not hmac.compare_digest(stored["token_sha256"], token_sha256(token)):
            return None
        record = self._read(agent_record_path(self.data_dir, tenant, agent))
        if (
            record is None
            or record.get("revoked_at")
            or record.get("user") != stored.get("agent_user")
        ):
            return None
        return tenant, agent

    def may_act_for(self, tenant: str, agent: str) -> bool:
        """Is (tenant, agent) an active agent the front door acts for (one holding a
        current front-door token: the door's NATS account imports exactly those)?"""
        if not (subjects.is_identity_token(tenant) and subjects.is_identity_token(agent)):
            return False
        stored = self._read(token_path(self.data_dir, tenant, agent))
        record = self._read(agent_record_path(self.data_dir, tenant, agent))
        return (
            stored is not None
            and record is not None
            and not record.get("revoked_at")
            and record.get("user") == stored.get("agent_user")
        )


@dataclass(frozen=True)
class OAuthIdentity:
    """Who an OAuth access token of the configured authorization server speaks for."""

    tenant: str
    agent: str
    user: str  # the token's `sub`
    expires_at: int | None
    issuer: str


class OAuthAgents:
    """The front door as an OAuth resource server (MCP authorization, RFC 9728).

    A JWT access token of the configured issuer (runtime/oidc.py checks signature,
    issuer, expiry, and that its audience is this door's resource URL) names a tenant
    and an agent by two configurable claims, and the user by `sub`. The agent must be
    one the door acts for (`toolgate agents token TENANT AGENT` enabled it: the door's
    NATS account imports only those agents' subjects); the operator's static tokens
    keep working beside OAuth.
    """

    def __init__(
        self,
        verifier: TokenVerifier,
        store: TokenStore,
        tenant_claim: str,
        agent_claim: str,
    ) -> None:
        self.verifier = verifier
        self.store = store
        self.tenant_claim = tenant_claim
        self.agent_claim = agent_claim

    async def identify(self, token: str) -> OAuthIdentity | None:
        try:
            verified = await self.verifier.verify(token)
        except TokenRejected as exc:
            log.info("OAuth access token refused: %s (%s)", exc.message, exc.code)
            return None
        except ProviderUnreachable as exc:
            log.warning("OAuth access token not checked, the issuer is unreachable: %s", exc)
            return None
        tenant = claim_text(verified.claims, self.tenant_claim)
        agent = claim_text(verified.claims, self.agent_claim)
        if tenant is None or agent is None or not self.store.may_act_for(tenant, agent):
            log.info(
                "OAuth access token of %r names no agent the front door acts for (claims %r, %r)",
                verified.subject[:128],
                self.tenant_claim,
                self.agent_claim,
            )
            return None
        exp = verified.claims.get("exp")
        return OAuthIdentity(
            tenant,
            agent,
            verified.subject,
            int(exp) if isinstance(exp, int | float) else None,
            self.verifier.config.issuer,
        )
