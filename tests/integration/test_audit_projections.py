"""The auditor's queries over `calls` answer from the `per_call` projection (DDL 007), with
the very rows they answered before it; a store made by the older DDL gets it at start.

A store is filled with the known stories of test_audit_queries under the DDL as it was
before 007 (what an existing data dir holds), every QUERIES.md query is answered, then
the schema is applied as a sink's start applies it: 007 adds the projection and builds it
for the parts already there. Each query must then answer the same rows, and the queries
over `calls` must read the projection rather than the events.
"""

from __future__ import annotations

import asyncio
import re
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_audit_queries import (
    RESEARCHER,
    T0,
    WRITER,
    Story,
    documented_queries,
    messages,
    record,
    registry,
    stories,
)
from toolgate.contracts.calls import success
from toolgate.contracts.events import ApprovalRequested, ExecutionStarted
from toolgate.services.audit.chain import ensure_seal_key
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import RowBuilder
from toolgate.services.audit.schema import apply_schema, load_ddl
from toolgate.services.audit.sql_console import run_readonly
from toolgate.services.audit.writer import AuditWriter, stored_message

PER_CALL, BY_EVENT_TYPE = "per_call", "by_event_type"
# The texts of the queries 007 rewrote (QUERIES.md before it): an auditor's saved copy
# must keep answering the same rows as the new text.
ORIGINAL = {
    "High-risk calls that executed without an approval (must be zero rows)": (
        "SELECT tenant, agent, call_id, tool, risk, user, started_at, approvers, "
        "approval_decided_at FROM calls WHERE risk IN ('high', 'critical') AND executed "
        "AND (NOT approved OR approval_decided_at IS NULL OR started_at < approval_decided_at) "
        "ORDER BY started_at"
    ),
    "Calls whose result was `invalid_tool_result`": (
        "SELECT tenant, agent, call_id, tool, user, final_error_code, attached_at, "
        "round(execute_ms, 3) AS execute_ms FROM calls "
        "WHERE final_status = 'invalid_tool_result' ORDER BY attached_at DESC"
    ),
    # 008 rewrote these two to read call_stages.
    "p50 / p99 time per stage, per tool": (
        "SELECT tool, stage, count() AS calls, round(quantile(0.5)(ms), 3) AS p50_ms, "
        "round(quantile(0.99)(ms), 3) AS p99_ms FROM calls "
        "ARRAY JOIN ['check', 'policy', 'approval', 'queue', 'execute', 'attach', 'total'] "
        "AS stage, [check_ms, policy_ms, approval_ms, queue_ms, execute_ms, attach_ms, "
        "total_ms] AS ms WHERE ms IS NOT NULL GROUP BY tool, stage ORDER BY tool, "
        "indexOf(['check', 'policy', 'approval', 'queue', 'execute', 'attach', 'total'], stage)"
    ),
    "Calls still without a result": (
        "SELECT tenant, agent, call_id, tool, requested_at, last_decision, executed FROM calls "
        "WHERE results = 0 AND requested_at < now64(6) - INTERVAL 5 MINUTE ORDER BY requested_at"
    ),
}
# "p50 / p99" as 008 wrote it (every call's stages unrolled, then grouped by tool and
# stage): the text now aggregates per tool first. A saved copy must answer the same rows.
STAGES_BY_ROW = (
    "SELECT tool, stage, count() AS calls, round(quantile(0.5)(ms), 3) AS p50_ms, "
    "round(quantile(0.99)(ms), 3) AS p99_ms FROM call_stages FINAL "
    "ARRAY JOIN ['check', 'policy', 'approval', 'queue', 'execute', 'attach', 'total'] AS stage, "
    "[dateDiff('microsecond', requested_at, checked_at) / 1000.0, "
    "dateDiff('microsecond', checked_at, decided_at) / 1000.0, "
    "dateDiff('microsecond', approval_requested_at, approval_decided_at) / 1000.0, "
    "dateDiff('microsecond', authorized_at, started_at) / 1000.0, execute_ms, "
    "dateDiff('microsecond', finished_at, attached_at) / 1000.0, "
    "dateDiff('microsecond', requested_at, attached_at) / 1000.0] AS ms "
    "WHERE ms IS NOT NULL GROUP BY tool, stage ORDER BY tool, "
    "indexOf(['check', 'policy', 'approval', 'queue', 'execute', 'attach', 'total'], stage)"
)
BEFORE = 6  # the last DDL version before the projection
STAGES = "call_stages"  # DDL 008: one row per call for the queries over every call


def _normal(value: Any) -> Any:
    """Arrays from groupUniqArray come in no defined order: compare them sorted."""
    if isinstance(value, list | tuple):
        return sorted((_normal(v) for v in value), key=repr)
    return value


def answers(client, original: bool = False) -> dict[str, list[tuple[Any, ...]]]:  # type: ignore[no-untyped-def]
    found = {}
    queries = documented_queries()
    assert set(ORIGINAL) <= set(queries)
    for title, sql in (queries | ORIGINAL if original else queries).items():
        _, rows = run_readonly(client, sql)
        found[title] = [tuple(_normal(v) for v in row) for row in rows]
    return found


def wait_for_mutations(client) -> None:  # type: ignore[no-untyped-def]
    """MATERIALIZE PROJECTION runs in the background: wait until it is done (or failed)."""
    for _ in range(600):
        pending = client.query(
            "SELECT count(), any(latest_fail_reason) FROM system.mutations "
            "WHERE database = currentDatabase() AND NOT is_done"
        ).result_rows[0]
        if pending[0] == 0:
            return
        assert not pending[1], pending[1]
        asyncio.run(asyncio.sleep(0.1))
    raise AssertionError("the projection was not materialized")


def parts_without_projection(client) -> int:  # type: ignore[no-untyped-def]
    return client.query(
        "SELECT count() FROM system.parts WHERE database = currentDatabase() "
        "AND table = 'event_log' AND active "
        "AND NOT (has(projections, {a:String}) AND has(projections, {b:String}))",
        parameters={"a": PER_CALL, "b": BY_EVENT_TYPE},
    ).result_rows[0][0]


def reads_projection(client, sql: str, projection: str) -> bool:  # type: ignore[no-untyped-def]
    plan = "\n".join(r[0] for r in client.query(f"EXPLAIN {sql}").result_rows)
    return f"ReadFromMergeTree ({projection})" in plan


@pytest.fixture
def old_store(clickhouse_server, tmp_path, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    """The URL of a store made and filled by the DDL before 007 (an existing data dir)."""
    import toolgate.services.audit.schema as schema

    url = clickhouse_server.url_for("admin", f"p_{uuid.uuid4().hex[:12]}")
    every = load_ddl()
    assert [f.version for f in every][:BEFORE] == list(range(1, BEFORE + 1))
    monkeypatch.setattr(schema, "load_ddl", lambda ddl_set="single": every[:BEFORE])
    ok = {"payload": "fine"}
    s = Story("wire-unapproved", "wire_money", WRITER, T0)
    planted = s.validated().authorized().executed(ok).attached(success(s.call.call_id, ok))
    # Two calls still without a result (one executed, one waiting for an approval).
    s = Story("wire-running", "wire_money", WRITER, T0 + timedelta(minutes=3))
    running = s.validated().approval("u-boss", True).authorized()
    running.add(ExecutionStarted, attempt=1, worker="w")
    s = Story("wire-waiting", "wire_money", RESEARCHER, T0 + timedelta(minutes=4))
    waiting = s.add(
        ApprovalRequested,
        call=s.call,
        policy_version="pv-1",
        risk="critical",
        expires_at=T0 + timedelta(hours=1),
    )
    asyncio.run(
        record(url, tmp_path / "keys", [*stories(), planted, running, waiting])
    )  # the sink applies 1-6
    monkeypatch.setattr(schema, "load_ddl", lambda ddl_set="single": every)
    return url


def test_an_old_store_gets_the_projection_and_every_query_answers_the_same(old_store):
    target = ClickHouseTarget.from_url(old_store)
    client = target.client()
    assert parts_without_projection(client) > 0
    before = answers(client, original=True)  # the texts as they were, on the old DDL
    assert all(before[title] for title in ORIGINAL)  # rows to compare, not two empty lists

    assert apply_schema(target) == [f.version for f in load_ddl() if f.version > BEFORE]
    wait_for_mutations(client)
    assert parts_without_projection(client) == 0  # built for the parts already there
    assert answers(client) == before
    assert answers(client, original=True) == before


def test_queries_read_the_projection_their_where_reaches(old_store):
    target = ClickHouseTarget.from_url(old_store)
    apply_schema(target)
    client = target.client()
    wait_for_mutations(client)
    over_calls = {t: q for t, q in documented_queries().items() if "FROM calls" in q}
    assert len(over_calls) >= 2
    for title, sql in over_calls.items():
        assert reads_projection(client, sql, PER_CALL), title
    # by_event_type is not asserted here: on these few rows it ties with the table in
    # granules and the table wins; at scale it reads a few percent (bench audit-queries).
    sorting = client.query(
        "SELECT sorting_key FROM system.projections WHERE database = currentDatabase() "
        "AND table = 'event_log' AND name = {p:String}",
        parameters={"p": BY_EVENT_TYPE},
    ).result_rows
    assert sorting == [(["event_type", "occurred_at"],)]


def test_new_rows_get_the_projection_as_they_are_written(old_store, tmp_path):
    target = ClickHouseTarget.from_url(old_store)
    apply_schema(target)
    client = target.client()
    wait_for_mutations(client)
    before = answers(client)
    # The same stories again, by another sink: every event twice, in parts written after
    # the projection existed. The views dedupe them; the projection must agree.
    asyncio.run(record(old_store, tmp_path / "keys2", stories()))
    assert parts_without_projection(client) == 0
    assert answers(client) == before


async def record_events(url: str, keys: Path, events_of: Story) -> None:
    """Only the story's events (its call was stored before), by a sink of their own."""
    writer = AuditWriter(
        ClickHouseTarget.from_url(url), RowBuilder(registry()), ensure_seal_key(keys), "late-sink"
    )
    await writer.start()
    await writer.write([m for m in messages([events_of]) if m.stream == "TOOLGATE_EVENTS"])  # type: ignore[misc]
    await writer.close()


def reads_tables(client, sql: str) -> set[str]:  # type: ignore[no-untyped-def]
    plan = "\n".join(r[0] for r in client.query(f"EXPLAIN {sql}").result_rows)
    return {name.split(".")[-1] for name in re.findall(r"ReadFromMergeTree \(([^)]*)\)", plan)}


def test_queries_over_every_call_read_call_stages_not_the_events(old_store):
    """The two queries that need every call read one short row per call (008), kept as the
    events are inserted: neither the events nor 007's per-call aggregates."""
    target = ClickHouseTarget.from_url(old_store)
    apply_schema(target)
    client = target.client()
    wait_for_mutations(client)
    queries = documented_queries()
    for title in ("p50 / p99 time per stage, per tool", "Calls still without a result"):
        assert reads_tables(client, queries[title]) == {STAGES}, title
    # A store made before 008 got the calls it already held (the backfill), each once
    # merged: one row per call of `calls`.
    client.command(f"OPTIMIZE TABLE {STAGES} FINAL")
    stored = client.query(f"SELECT count() FROM {STAGES}").result_rows[0][0]
    assert stored == client.query("SELECT count() FROM calls").result_rows[0][0] > 0


def test_a_call_closed_in_a_later_block_leaves_the_calls_without_a_result(old_store, tmp_path):
    """call_stages is kept from each inserted block: a call opened in one insert and given
    its result in a later one (by another sink) is a row without, then with, attached_at;
    the queries answer what `calls` answers after each block."""
    target = ClickHouseTarget.from_url(old_store)
    apply_schema(target)
    client = target.client()
    wait_for_mutations(client)
    title = "Calls still without a result"
    s = Story("late", "echo", WRITER, T0 + timedelta(minutes=9))
    ok = {"payload": "fine"}
    opened = s.validated().authorized()
    asyncio.run(record(old_store, tmp_path / "k1", [opened]))
    now = answers(client)
    assert ("acme", "writer", "late") in {row[:3] for row in now[title]}
    assert now == answers(client, original=True)
    closed = Story("late", "echo", WRITER, opened.at)
    closed.executed(ok).attached(success(s.call.call_id, ok))
    asyncio.run(record_events(old_store, tmp_path / "k2", closed))
    now = answers(client)
    assert ("acme", "writer", "late") not in {row[:3] for row in now[title]}
    assert now == answers(client, original=True)


def test_the_insert_only_writer_fills_call_stages(tmp_path):
    """The sink logs in as toolgate_writer, which may only INSERT into event_log: the view
    reads the block and writes call_stages as the admin that created it (SQL SECURITY
    DEFINER), or every insert of the real sink would be refused."""
    from toolgate.stack.clickhouse_server import EmbeddedClickHouse

    server = EmbeddedClickHouse(tmp_path / "clickhouse").start()
    try:
        apply_schema(ClickHouseTarget.from_url(server.url_for("admin")))
        writer = AuditWriter(
            ClickHouseTarget.from_url(server.url_for("writer")),
            RowBuilder(registry()),
            ensure_seal_key(tmp_path / "keys"),
            "writer-sink",
        )
        # One insert as the sink makes it, once (the sink itself would retry a refusal).
        stored_rows = [writer.builder.row_for(stored_message(m)) for m in messages(stories()[:3])]  # type: ignore[arg-type]
        writer._insert(writer.chain.link(stored_rows), "writer-sink:1")
        admin = ClickHouseTarget.from_url(server.url_for("admin")).client()
        stored = admin.query(f"SELECT count() FROM {STAGES} FINAL").result_rows[0][0]
        assert stored == 3
    finally:
        server.stop()


def test_stage_percentiles_aggregate_per_tool_and_answer_as_before(old_store, tmp_path):
    """ "p50 / p99 per stage" aggregates one array of stage times per call, keyed by tool
    alone (not a (tool, stage) row per call and stage: 7x the rows, and a string key), and
    answers what 008's text and the text over `calls` answered: on the old store, and with
    a call open in one block and closed in a later one."""
    target = ClickHouseTarget.from_url(old_store)
    apply_schema(target)
    client = target.client()
    wait_for_mutations(client)
    title = "p50 / p99 time per stage, per tool"
    sql = documented_queries()[title]
    plan = [r[0].strip(" │└─") for r in client.query(f"EXPLAIN {sql}").result_rows]
    keys = [line for line in plan if line.startswith("Keys:")]
    assert keys == ["Keys: tool"], plan

    def same() -> list[tuple[Any, ...]]:
        now = run_readonly(client, sql)[1]
        assert now == run_readonly(client, STAGES_BY_ROW)[1]
        assert now == run_readonly(client, ORIGINAL[title])[1]
        return now

    assert same()
    s = Story("split", "echo", WRITER, T0 + timedelta(minutes=11))
    opened = s.validated().authorized()
    asyncio.run(record(old_store, tmp_path / "k1", [opened]))
    same()
    closed = Story("split", "echo", WRITER, opened.at)
    closed.executed({"payload": "ok"}).attached(success(s.call.call_id, {"payload": "ok"}))
    asyncio.run(record_events(old_store, tmp_path / "k2", closed))
    assert same()
