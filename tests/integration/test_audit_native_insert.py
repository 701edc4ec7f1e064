"""The sink inserts its rows column by column in ClickHouse's Native format (issue #26): what
ClickHouse stores is byte for byte what the JSON-lines insert stored before, and what the
chain hashed, for every kind of value a row can hold."""

from __future__ import annotations

import operator
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from tests.integration.test_audit_store import calls, writer_for
from toolgate.services.audit.chain import (
    content_bytes,
    content_sql,
    load_seal_public_key,
    time_text,
)
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import CONTENT_COLUMNS, INSERT_COLUMNS
from toolgate.services.audit.schema import apply_schema
from toolgate.services.audit.verify import verify_store
from toolgate.services.audit.writer import AuditWriter, stored_message

STORED = ", ".join(f"`{c}`" for c in INSERT_COLUMNS)
_values = operator.itemgetter(*CONTENT_COLUMNS)
_AT = CONTENT_COLUMNS.index("occurred_at")


def json_line(row: dict[str, Any]) -> bytes:
    """A linked row as the sink sent it before the Native insert (JSONCompactEachRow, the
    time as its text): the encoding every chain stored so far was written with."""
    values = list(_values(row))
    values[_AT] = time_text(values[_AT])
    values += (row["chain_id"], row["chain_seq"], row["chain_hash"])
    return msgspec.json.encode(values)


def odd_rows(writer: AuditWriter) -> list[dict[str, Any]]:
    """Rows as the builder makes them, then every kind of value a column may hold."""
    built = [writer.builder.row_for(stored_message(m)) for m in calls(4)]  # type: ignore[arg-type]
    at = datetime(2026, 3, 1, 9, 0, 0, 5, tzinfo=UTC)
    edges: list[dict[str, Any]] = [
        {"duration_ms": 0.1, "user": "Ünïcode ☃ \U0001f600", "note": "a\tb\nc\\d\"e'"},
        {"duration_ms": -0.0, "payload": '{"q":"\\u0000\\ud83d\\ude00"}', "session": "\x00\x01"},
        {"duration_ms": 1e-310, "occurred_at": datetime(1900, 1, 2, tzinfo=UTC)},
        {"duration_ms": 1.7976931348623157e308, "occurred_at": datetime(2299, 12, 30, tzinfo=UTC)},
        {"duration_ms": None, "source_seq": 2**64 - 1, "event_type": "x" * 300},
        {"occurred_at": at.astimezone(UTC).replace(tzinfo=None), "duration_ms": 123456.789},
    ]
    for i, fields in enumerate(edges):
        built.append(built[0] | {"event_id": f"edge-{i}", "occurred_at": at} | fields)
    # And a batch of several MB, which clickhouse-connect would cut into ~2 MB blocks.
    many = [writer.builder.row_for(stored_message(m)) for m in calls(3000, start=10)]  # type: ignore[arg-type]
    return built + [row | {"note": "n" * 1000} for row in many]


def stored_bytes(client, table: str = "event_log") -> bytes:  # type: ignore[no-untyped-def]
    """Every inserted column of every row, as ClickHouse holds it (RowBinary: exact)."""
    return bytes(
        client.raw_query(f"SELECT {STORED} FROM {table} ORDER BY chain_seq FORMAT RowBinary")
    )


async def test_the_native_insert_stores_the_bytes_the_json_insert_stored(
    clickhouse_server, tmp_path: Path
):
    database = f"n_{uuid.uuid4().hex[:12]}"
    url = clickhouse_server.url_for("admin", database)
    writer = writer_for(url, tmp_path)
    await writer.start()
    # What the sink's client is asked to send (it is sent, to the real server, unchanged).
    sent: list[str] = []
    db = writer._db()
    data_insert, raw_insert = db.data_insert, db.raw_insert

    def native(context: Any) -> Any:
        sent.append(f"Native {context.table.strip('`')}")
        return data_insert(context)

    def text(table: str, *args: Any, fmt: str = "", **kwargs: Any) -> Any:
        sent.append(f"{fmt} {table}")
        return raw_insert(table, *args, fmt=fmt, **kwargs)

    db.data_insert, db.raw_insert = native, text  # type: ignore[method-assign]
    linked = writer.chain.link(odd_rows(writer))
    token = f"{writer.chain.chain_id}:1-{len(linked)}"
    writer._insert(linked, token)
    writer._insert(linked, token)  # the answer to the first was lost: the sink retries
    assert sent == ["Native event_log", "Native event_log"]  # a binary column block, not text
    writer.chain.commit(linked)
    writer._seal(final=False)
    client = ClickHouseTarget.from_url(url).client()
    # One block under the token: stored once, one part per month it holds (1900, 2026, 2299).
    parts = client.query(
        "SELECT count(), uniqExact(partition), sum(rows) FROM system.parts "
        "WHERE database = currentDatabase() AND table = 'event_log' AND active"
    ).result_rows[0]
    assert parts == (3, 3, len(linked))

    # The same linked rows through the JSON insert, into a store of their own.
    before = ClickHouseTarget.from_url(clickhouse_server.url_for("admin", f"{database}_json"))
    apply_schema(before)
    before.client().raw_insert(
        "event_log",
        list(INSERT_COLUMNS),
        insert_block=b"\n".join(json_line(row) for row in linked),
        fmt="JSONCompactEachRow",
        settings={"precise_float_parsing": 1},
    )
    native = stored_bytes(client)
    assert native == stored_bytes(before.client())
    assert len(native) > 1000

    # ClickHouse computes from the stored columns the very bytes each link hashed.
    hashed = client.query(
        f"SELECT {content_sql()} FROM event_log ORDER BY chain_seq"
    ).result_columns[0]
    assert [h if isinstance(h, bytes) else h.encode() for h in hashed] == [
        content_bytes(row) for row in linked
    ]
    report = verify_store(client, load_seal_public_key(tmp_path))
    assert report.ok and report.findings == [] and report.rows == len(linked)
