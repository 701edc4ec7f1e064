"""Approvers and their tokens, in `<data-dir>/approvers.yaml`.

Only the SHA-256 of each token is stored (tokens are 256-bit random strings,
so a plain hash is enough: there is nothing to brute-force). The file is
re-read when it changes, so `toolgate approvals add-approver` takes effect
in a running service. Several replicas must see the same file (a shared
data directory, or the same file deployed to each).

    approvers:
      alice:
        token_sha256: 9f86d0...
        tenants: [acme]          # sees and votes on these tenants' calls only
        nats_user: UCX3...       # her NATS user (creds/approvers/alice.creds)
        created_at: '2026-01-01T00:00:00+00:00'
      sec-desk:
        token_sha256: 2c26b4...
        tenants: []
        all_tenants: true        # operator-wide, only when given explicitly
        created_at: '2026-01-01T00:00:00+00:00'

An approver's requests come from her own NATS user (`nats_user`, minted with
the token by `toolgate approvals add-approver`): the service takes who asks
from the server's word for that user, and her token must be hers as well. The
web inbox is the one client that speaks for any approver, by token (its own
NATS user, `inbox`, never handed to approvers).

An approver belongs to tenants: `add_approver` refuses an approver with no
tenant unless `all_tenants` is asked for. An entry with neither (a file of
an older toolgate, where empty meant every tenant) sees nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import yaml

from toolgate.contracts import subjects
from toolgate.contracts.events import utc_now
from toolgate.services.approvals.logic import SYSTEM_APPROVER, Approver, same_person

APPROVERS_FILE: Final = "approvers.yaml"
TOKEN_PREFIX: Final = "tgap_"
NAME_PATTERN: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$")


class ApproverError(Exception):
    """The approvers file is unreadable, or a name is not acceptable."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def approvers_path(data_dir: Path) -> Path:
    return data_dir / APPROVERS_FILE


def _read(path: Path) -> dict[str, dict[str, Any]]:
    if not path.exists():
        return {}
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ApproverError(f"{path}: cannot read: {exc}") from exc
    approvers = raw.get("approvers") if isinstance(raw, dict) else None
    if not isinstance(approvers, dict):
        raise ApproverError(f"{path}: expected a mapping 'approvers'")
    return approvers


def add_approver(
    data_dir: Path,
    name: str,
    tenants: list[str] | None = None,
    *,
    all_tenants: bool = False,
    rotate: bool = False,
    mint_nats_user: Callable[[str], str] | None = None,
) -> str:
    """Create (or with `rotate`, re-key) an approver of `tenants` (or, explicitly, of
    every tenant); return the new token, shown once.

    `mint_nats_user(name)`: makes the approver's NATS user (its creds) once the name
    is accepted, and returns the user's public key, recorded as `nats_user`. Without
    it the approver acts only through the web inbox."""
    if not NAME_PATTERN.fullmatch(name) or same_person(name, SYSTEM_APPROVER):
        raise ApproverError(
            f"not an acceptable approver name: {name!r} (letters, digits, . _ @ -; at most 64)"
        )
    tenants = sorted(set(tenants or []))
    bad = [t for t in tenants if not subjects.is_identity_token(t)]
    if bad:
        raise ApproverError(f"not a tenant name: {bad[0]!r} (letters, digits, _ -; at most 64)")
    if all_tenants and tenants:
        raise ApproverError("give --tenant or --all-tenants, not both")
    if not tenants and not all_tenants:
        raise ApproverError(
            "an approver belongs to tenants: give --tenant TENANT "
            "(repeatable), or --all-tenants for an operator-wide approver"
        )
    path = approvers_path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    approvers = _read(path)
    existing = [n for n in approvers if same_person(n, name)]
    if existing and not rotate:
        raise ApproverError(f"approver {existing[0]!r} exists; use --rotate for a new token")
    for old in existing:
        del approvers[old]
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    entry: dict[str, Any] = {
        "token_sha256": token_hash(token),
        "tenants": tenants,
        "created_at": utc_now().isoformat(),
    }
    if all_tenants:
        entry["all_tenants"] = True
    if mint_nats_user is not None:
        entry["nats_user"] = mint_nats_user(name)
    approvers[name] = entry
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        yaml.safe_dump({"approvers": approvers}, handle, sort_keys=True)
    tmp.replace(path)
    return token


class ApproverBook:
    """Authenticates tokens against the approvers file, re-reading it when it changes."""

    def __init__(self, data_dir: Path) -> None:
        self.path = approvers_path(data_dir)
        self._lock = threading.Lock()
        self._stamp: tuple[int, int, int] | None = None
        self._by_hash: dict[str, Approver] = {}
        self._nats_users: dict[str, str] = {}  # NATS user public key -> approver name

    def _refresh(self) -> None:
        try:
            stat = self.path.stat()
            stamp: tuple[int, int, int] | None = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except FileNotFoundError:
            stamp = None
        with self._lock:
            if stamp == self._stamp and (stamp is not None or not self._by_hash):
                return
            by_hash: dict[str, Approver] = {}
            nats_users: dict[str, str] = {}
            for name, entry in _read(self.path).items():
                if not isinstance(entry, dict) or not isinstance(entry.get("token_sha256"), str):
                    continue
                tenants = entry.get("tenants") or ()
                if not isinstance(tenants, list | tuple):
                    tenants = ()
                by_hash[entry["token_sha256"]] = Approver(
                    name=str(name),
                    tenants=tuple(sorted({str(t) for t in tenants})),
                    all_tenants=entry.get("all_tenants") is True,
                )
                if isinstance(entry.get("nats_user"), str):
                    nats_users[entry["nats_user"]] = str(name)
            self._by_hash = by_hash
            self._nats_users = nats_users
            self._stamp = stamp

    def authenticate(self, token: str | None) -> Approver | None:
        if not token or not token.startswith(TOKEN_PREFIX) or len(token) > 256:
            return None
        self._refresh()
        digest = token_hash(token)
        found = None
        for stored, approver in self._by_hash.items():
            if hmac.compare_digest(stored, digest):
                found = approver
        return found

    def approver_of_user(self, nats_user: str) -> str | None:
        """The name of the approver whose NATS user this is (its current one), else None."""
        self._refresh()
        return self._nats_users.get(nats_user)

    def names(self) -> list[str]:
        self._refresh()
        return sorted(a.name for a in self._by_hash.values())
