"""The example's two tools over its orders database (SQLite, made from seed.sql).

The policy has decided before either runs (the order belongs to the user the
agent acts for; a refund above 500, or from an automated session outside
working hours, had two approvers). The tools still scope every query by the
caller's tenant and refuse what the data does not allow (an unknown order, a
refund beyond what is left), so a mistake in a policy cannot reach another
tenant's rows.
"""

from __future__ import annotations

import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

BUSY_TIMEOUT_S = 4.0
COLUMNS = ("id", "owner", "status", "amount", "refunded", "currency", "placed_at")


def database_of(ctx: ToolContext) -> Path:
    """settings.database, relative to the gateway's data dir (ctx.data_dir is
    <data-dir>/tools/<tool>)."""
    database = Path(str(ctx.settings.get("database", "examples/orders/orders.sqlite3")))
    return database if database.is_absolute() else ctx.data_dir.parents[1] / database


def _connect(ctx: ToolContext, read_only: bool) -> sqlite3.Connection:
    path = database_of(ctx)
    if not path.exists():
        raise ToolUnavailable(
            f"the orders database {path} does not exist (toolgate up --example orders creates it)"
        )
    uri = f"{path.resolve().as_uri()}?mode={'ro' if read_only else 'rw'}"
    try:
        return sqlite3.connect(uri, uri=True, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    except sqlite3.Error as exc:
        raise ToolUnavailable(f"cannot open the orders database: {exc}") from exc


def _order(connection: sqlite3.Connection, order_id: str, tenant: str) -> dict[str, Any]:
    row = connection.execute(
        f"SELECT {', '.join(COLUMNS)} FROM orders WHERE id = ? AND tenant = ?", (order_id, tenant)
    ).fetchone()
    if row is None:
        raise ToolRefused(f"no order {order_id!r}")
    order = dict(zip(COLUMNS, row, strict=True))
    order["order_id"] = order.pop("id")
    return order


def query_order(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    with closing(_connect(ctx, read_only=True)) as connection:
        try:
            return _order(connection, arguments["order_id"], ctx.principal.tenant)
        except sqlite3.Error as exc:
            raise ToolUnavailable(f"the orders database failed: {exc}") from exc


def refund_order(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """Refund part of an order, once per call: the refund is keyed by the call's identity."""
    order_id, amount = arguments["order_id"], int(arguments["amount"])
    tenant = ctx.principal.tenant
    with closing(_connect(ctx, read_only=False)) as connection:
        try:
            connection.execute("BEGIN IMMEDIATE")
            try:
                done = connection.execute(
                    "SELECT order_id, amount FROM refunds WHERE refund_key = ?",
                    (ctx.idempotency_key,),
                ).fetchone()
                duplicate = done is not None
                if not duplicate:
                    order = _order(connection, order_id, tenant)
                    left = order["amount"] - order["refunded"]
                    if order["status"] == "cancelled":
                        raise ToolRefused(f"order {order_id!r} is cancelled")
                    if amount > left:
                        raise ToolRefused(
                            f"order {order_id!r} has {left} {order['currency']} "
                            f"left to refund, not {amount}"
                        )
                    connection.execute(
                        "INSERT INTO refunds (refund_key, order_id, tenant, amount, reason, "
                        "refunded_by, refunded_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (
                            ctx.idempotency_key,
                            order_id,
                            tenant,
                            amount,
                            str(arguments.get("reason", "")),
                            ctx.principal.user,
                            datetime.now(UTC).isoformat(),
                        ),
                    )
                    connection.execute(
                        "UPDATE orders SET refunded = refunded + ? WHERE id = ? AND tenant = ?",
                        (amount, order_id, tenant),
                    )
                order = _order(connection, order_id, tenant)
                connection.execute("COMMIT")
            except BaseException:
                connection.execute("ROLLBACK")
                raise
        except sqlite3.Error as exc:
            raise ToolUnavailable(f"the orders database failed: {exc}") from exc
    return {
        "refund_id": ctx.idempotency_key,
        "order_id": order_id,
        "amount": amount,
        "refunded_total": order["refunded"],
        "currency": order["currency"],
        "duplicate": duplicate,
    }
