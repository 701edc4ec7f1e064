"""save_evidence: store one checked claim in the current task's evidence store.

Where it writes is the runtime's choice, never the model's:
`<ctx.data_dir>/<tenant>/<task_id>.sqlite3`, one SQLite file per task.

The call's identity (agent, call_id; the tenant is the file) is the
idempotency key. The executor may run a call again after a crash (the tool is
declared idempotent); INSERT OR IGNORE on that primary key makes the second
run store nothing and report a duplicate, with the same evidence_id as the
first. The same call_id from another agent is another call and another row.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
import time
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

TOKEN_PATTERN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# Several executor processes may write to one task's file at once. WAL lets
# readers and one writer proceed together; a writer waits up to this long for
# another writer's lock. It is below the tool's 5 s timeout so a stuck lock
# becomes a retryable ToolUnavailable rather than an executor timeout.
BUSY_TIMEOUT_MS = 4000

SCHEMA = """
CREATE TABLE IF NOT EXISTS evidence (
    agent      TEXT NOT NULL,
    call_id    TEXT NOT NULL,
    claim      TEXT NOT NULL,
    source_url TEXT NOT NULL,
    quote      TEXT NOT NULL DEFAULT '',
    confidence TEXT,
    saved_at   TEXT NOT NULL,
    PRIMARY KEY (agent, call_id)
)
"""


def save_evidence(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    tenant = _token(ctx.principal.tenant, "tenant")
    if ctx.task_id is None:
        raise ToolRefused("save_evidence needs a current task; this call has no task_id")
    task_id = _token(ctx.task_id, "task_id")
    # Defense in depth: the policy stage checks this too. A model must not
    # write into another task's evidence by naming it.
    if arguments.get("task_id") != task_id:
        raise ToolRefused("task_id does not match the current task")

    path = evidence_path(ctx.data_dir, tenant, task_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    row = (
        ctx.principal.agent,
        ctx.call_id,
        arguments["claim"],
        arguments["source_url"],
        arguments.get("quote", ""),
        arguments.get("confidence"),
        datetime.now(UTC).isoformat(timespec="milliseconds"),
    )
    try:
        with closing(_connect(path)) as conn:
            cursor = conn.execute(
                "INSERT OR IGNORE INTO evidence"
                " (agent, call_id, claim, source_url, quote, confidence, saved_at)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                row,
            )
            duplicate = cursor.rowcount == 0
    except sqlite3.OperationalError as exc:  # "database is locked", disk I/O, ...
        raise ToolUnavailable(f"evidence store unavailable: {exc}") from exc

    return {
        "evidence_id": evidence_id(ctx.idempotency_key),
        "task_id": task_id,
        "stored": True,
        "duplicate": duplicate,
    }


def evidence_id(idempotency_key: str) -> str:
    """Derived from (tenant, agent, call_id), so a re-run reports the same id without a
    lookup."""
    return "ev_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]


def evidence_path(data_dir: Path, tenant: str, task_id: str) -> Path:
    return Path(data_dir) / _token(tenant, "tenant") / f"{_token(task_id, 'task_id')}.sqlite3"


def read_evidence(data_dir: Path, tenant: str, task_id: str) -> list[dict[str, Any]]:
    """Every evidence row of one task, oldest first ([] when nothing was saved)."""
    tenant = _token(tenant, "tenant")
    path = evidence_path(data_dir, tenant, task_id)
    if not path.exists():
        return []
    with closing(_connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        rows = conn.execute(
            "SELECT agent, call_id, claim, source_url, quote, confidence, saved_at"
            " FROM evidence ORDER BY saved_at, agent, call_id"
        ).fetchall()
    return [
        {"evidence_id": evidence_id(f"{tenant}.{row['agent']}.{row['call_id']}"), **dict(row)}
        for row in rows
    ]


def _token(value: object, name: str) -> str:
    # Both name a path component: anything but a plain token could walk out
    # of data_dir ("../x") or collide with another tenant's files.
    if not isinstance(value, str) or not TOKEN_PATTERN.fullmatch(value):
        raise ToolRefused(f"{name} must match ^[A-Za-z0-9_-]{{1,128}}$")
    return value


def _connect(path: Path) -> sqlite3.Connection:
    # isolation_level=None: autocommit. Each write is one statement, which
    # SQLite makes atomic on its own; no transaction is left open.
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _enable_wal(conn)
        conn.execute(SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


def _enable_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL (a property of the file: once set, it stays).

    Switching needs an exclusive lock, and SQLite answers "database is
    locked" at once instead of waiting through the busy timeout. That
    happens only while several writers race to create a task's file, so a
    short retry loop, bounded by the same budget, is enough.
    """
    deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)
