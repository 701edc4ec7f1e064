"""refund_payment: the refund walkthrough's tool, small and real.

There is no payment provider here: the effect is a row in the tool's own
ledger, `<ctx.data_dir>/<tenant>/refunds.sqlite3`, where `ctx.data_dir` is
chosen by the runtime (`<data-dir>/tools/refund_payment`), never by the model.

The call's identity (tenant, agent, call_id) is the idempotency key: the
executor may run a call again after a crash (the tool is declared
idempotent), and the second run records nothing and reports the first
refund with `duplicate: true`. A payment is refunded at most once: another
call refunding the same payment is refused (not retryable).
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
BUSY_TIMEOUT_MS = 4000  # below the tool's 5 s timeout: a stuck lock is a retryable error

SCHEMA = """
CREATE TABLE IF NOT EXISTS refunds (
    call_key    TEXT PRIMARY KEY,       -- tenant.agent.call_id
    payment_id  TEXT NOT NULL UNIQUE,   -- refunded at most once
    amount      INTEGER NOT NULL,       -- cents
    reason      TEXT NOT NULL DEFAULT '',
    refunded_at TEXT NOT NULL
)
"""


def refund_payment(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    tenant = ctx.principal.tenant
    if not TOKEN_PATTERN.fullmatch(tenant):  # it names a directory
        raise ToolRefused("tenant must match ^[A-Za-z0-9_-]{1,128}$")
    path = ledger_path(ctx.data_dir, tenant)
    path.parent.mkdir(parents=True, exist_ok=True)
    key = ctx.idempotency_key
    try:
        with closing(_connect(path)) as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                row = _refund(conn, key, arguments)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
    except sqlite3.OperationalError as exc:  # "database is locked", disk I/O, ...
        raise ToolUnavailable(f"refund ledger unavailable: {exc}") from exc
    return row


def _refund(conn: sqlite3.Connection, key: str, arguments: dict[str, Any]) -> dict[str, Any]:
    done = conn.execute(
        "SELECT payment_id, amount, refunded_at FROM refunds WHERE call_key = ?", (key,)
    ).fetchone()
    if done is not None:  # this very call ran before: report it, record nothing
        return _view(key, *done, duplicate=True)
    payment_id, amount = arguments["payment_id"], int(arguments["amount"])
    other = conn.execute(
        "SELECT call_key FROM refunds WHERE payment_id = ?", (payment_id,)
    ).fetchone()
    if other is not None:
        raise ToolRefused(f"payment {payment_id} was already refunded (call {other[0]})")
    refunded_at = datetime.now(UTC).isoformat(timespec="milliseconds")
    conn.execute(
        "INSERT INTO refunds (call_key, payment_id, amount, reason, refunded_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (key, payment_id, amount, arguments.get("reason", ""), refunded_at),
    )
    return _view(key, payment_id, amount, refunded_at, duplicate=False)


def _view(
    key: str, payment_id: str, amount: int, refunded_at: str, *, duplicate: bool
) -> dict[str, Any]:
    return {
        "refund_id": refund_id(key),
        "payment_id": payment_id,
        "amount": amount,
        "refunded_at": refunded_at,
        "duplicate": duplicate,
    }


def refund_id(call_key: str) -> str:
    """Derived from the call's identity, so a re-run reports the same id."""
    return "rf_" + hashlib.sha256(call_key.encode()).hexdigest()[:16]


def ledger_path(data_dir: Path, tenant: str) -> Path:
    return Path(data_dir) / tenant / "refunds.sqlite3"


def read_refunds(data_dir: Path, tenant: str) -> list[dict[str, Any]]:
    """Every refund of one tenant, oldest first ([] when there is none)."""
    path = ledger_path(data_dir, tenant)
    if not path.exists():
        return []
    with closing(_connect(path)) as conn:
        rows = conn.execute(
            "SELECT call_key, payment_id, amount, reason, refunded_at"
            " FROM refunds ORDER BY refunded_at, call_key"
        ).fetchall()
    return [
        {
            "refund_id": refund_id(row[0]),
            "call_key": row[0],
            "payment_id": row[1],
            "amount": row[2],
            "reason": row[3],
            "refunded_at": row[4],
        }
        for row in rows
    ]


def _connect(path: Path) -> sqlite3.Connection:
    # Autocommit; each refund is one explicit IMMEDIATE transaction (several
    # executors may write at once: the second waits for the first's lock).
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        conn.execute(SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn
