"""The audit schema and writer against the embedded ClickHouse: dedupe, views, read-only, verify."""

from __future__ import annotations

import argparse
import asyncio
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from toolgate.cli.audit import register
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import load_registry
from toolgate.services.audit import writer as writer_module
from toolgate.services.audit.chain import ensure_seal_key, load_seal_public_key
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import RowBuilder
from toolgate.services.audit.schema import SchemaError, apply_schema, load_ddl
from toolgate.services.audit.sql_console import render, run_readonly
from toolgate.services.audit.verify import verify_store
from toolgate.services.audit.writer import AuditWriter, stored_message

P = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")


@dataclass
class StoredJsMessage:
    """A message as nats-py hands it over from a stream: data plus metadata (the stage
    runner acks it: tests/integration/test_audit_sink.py)."""

    stream: str
    seq: int
    data: bytes
    subject: str = "toolgate.calls.acme.researcher"
    stored_at: datetime = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)

    @property
    def metadata(self) -> SimpleNamespace:
        return SimpleNamespace(
            stream=self.stream, sequence=SimpleNamespace(stream=self.seq), timestamp=self.stored_at
        )


def calls(n: int, start: int = 0) -> list[StoredJsMessage]:
    return [
        StoredJsMessage(
            "TOOLGATE_CALLS",
            i + 1,
            msgspec.json.encode(
                ToolCall(
                    call_id=f"c-{i}",
                    tool="search_sources",
                    arguments={"query": f"q{i}"},
                    principal=P,
                )
            ),
        )
        for i in range(start, start + n)
    ]


def writer_for(url: str, keys: Path) -> AuditWriter:
    return AuditWriter(
        ClickHouseTarget.from_url(url),
        RowBuilder(load_registry()),
        ensure_seal_key(keys),
        "test-sink",
    )


def test_schema_applies_once_and_records_its_versions(clickhouse_url):
    target = ClickHouseTarget.from_url(clickhouse_url)
    assert apply_schema(target) == [f.version for f in load_ddl()]
    assert apply_schema(target) == []
    client = target.client()
    tables = {r[0] for r in client.query("SHOW TABLES").result_rows}
    assert {"event_log", "chain_checkpoints", "events", "calls", "schema_versions"} <= tables


def test_a_ddl_file_changed_after_it_ran_is_refused(clickhouse_url, monkeypatch):
    target = ClickHouseTarget.from_url(clickhouse_url)
    apply_schema(target)
    import toolgate.services.audit.schema as schema

    edited = [
        f if f.version != 2 else schema.DdlFile(2, f.name, f.text + "\n-- edited")
        for f in load_ddl()
    ]
    monkeypatch.setattr(schema, "load_ddl", lambda ddl_set="single": edited)
    with pytest.raises(SchemaError, match="changed after it was applied"):
        apply_schema(target)


async def test_an_existing_store_is_upgraded_to_calls_by_identity(
    clickhouse_url, tmp_path, monkeypatch
):
    """A store made before 005 (its `calls` grouped by call_id alone) gets the view replaced
    at the next start; the rows already there are then read per (tenant, agent, call_id)."""
    import toolgate.services.audit.schema as schema

    target = ClickHouseTarget.from_url(clickhouse_url)
    every = load_ddl()
    monkeypatch.setattr(schema, "load_ddl", lambda ddl_set="single": every[:4])
    assert apply_schema(target) == [1, 2, 3, 4]
    other = Principal(tenant="acme", user="u-carol", agent="writer", session="s-2")
    writer = writer_for(clickhouse_url, tmp_path)
    await writer.start()
    await writer.write(
        [
            *calls(1),
            StoredJsMessage(  # type: ignore[list-item]
                "TOOLGATE_CALLS",
                2,
                msgspec.json.encode(
                    ToolCall(
                        call_id="c-0",
                        tool="search_sources",
                        arguments={"query": "q"},
                        principal=other,
                    )
                ),
                subject="toolgate.calls.acme.writer",
            ),
        ]
    )
    await writer.close()
    client = target.client()
    assert client.query("SELECT count() FROM calls").result_rows[0][0] == 1  # merged: the bug
    monkeypatch.setattr(schema, "load_ddl", lambda ddl_set="single": every)
    assert apply_schema(target) == [f.version for f in every[4:]]
    assert client.query("SELECT tenant, agent, call_id FROM calls ORDER BY agent").result_rows == [
        ("acme", "researcher", "c-0"),
        ("acme", "writer", "c-0"),
    ]
    assert apply_schema(target) == []


def test_cluster_ddl_parses(clickhouse_server):
    client = ClickHouseTarget.from_url(clickhouse_server.url_for("admin")).client(
        with_database=False
    )
    for ddl in load_ddl("cluster"):
        for statement in ddl.statements("toolgate_cluster"):
            formatted = client.query(
                "SELECT formatQuery({q:String})", parameters={"q": statement}
            ).result_rows[0][0]
            assert (
                re.search(r"Replicated\w*MergeTree", formatted)
                or "Distributed" in formatted
                # 008's backfill: through the Distributed table, from one node
                or formatted.startswith("INSERT INTO call_stages ")
                or "VIEW" in formatted
                or "ADD INDEX" in formatted
                or ("PROJECTION" in formatted and "ON CLUSTER" in formatted)
            ), ddl.name


async def test_a_retried_block_is_stored_once(clickhouse_url, tmp_path):
    writer = writer_for(clickhouse_url, tmp_path)
    await writer.start()
    linked = writer.chain.link([writer.builder.row_for(stored_message(m)) for m in calls(50)])
    token = f"{writer.chain.chain_id}:1-50"
    writer._insert(linked, token)
    writer._insert(linked, token)  # the answer to the first was lost: the sink retries
    writer.chain.commit(linked)
    client = ClickHouseTarget.from_url(clickhouse_url).client()
    assert client.query("SELECT count() FROM event_log").result_rows[0][0] == 50


async def test_a_batch_written_by_two_sinks_is_read_once(clickhouse_url, tmp_path):
    writer = writer_for(clickhouse_url, tmp_path)
    await writer.start()
    await writer.write(calls(50))  # type: ignore[arg-type]
    # Redelivered to another sink (its own chain): a second physical copy of each event.
    other = writer_for(clickhouse_url, tmp_path)
    await other.start()
    await other.write(calls(50))  # type: ignore[arg-type]
    await writer.close()
    await other.close()
    client = ClickHouseTarget.from_url(clickhouse_url).client()
    assert client.query("SELECT count() FROM event_log").result_rows[0][0] == 100
    assert client.query("SELECT count(), uniqExact(event_id) FROM events").result_rows[0] == (
        50,
        50,
    )
    assert verify_store(client, load_seal_public_key(tmp_path)).findings == []


async def test_the_writer_waits_for_clickhouse(tmp_path, monkeypatch):
    from toolgate.stack.clickhouse_server import EmbeddedClickHouse, free_port

    monkeypatch.setattr(writer_module, "RETRY_MAX_S", 0.5)
    port = free_port()
    # Its logins exist before the server does (generated into its data dir).
    url = EmbeddedClickHouse(tmp_path / "late", port=port).url_for("admin", "audit")
    writer = writer_for(url, tmp_path)
    starting = asyncio.create_task(writer.start())
    await asyncio.sleep(1.0)
    assert not starting.done()  # no server yet: start-up waits
    with EmbeddedClickHouse(tmp_path / "late", port=port):
        await asyncio.wait_for(starting, 60)
    writing = asyncio.create_task(writer.write(calls(10)))  # type: ignore[arg-type]
    await asyncio.sleep(1.5)
    assert not writing.done()  # kept in progress meanwhile by the stage runner (test_audit_sink)
    with EmbeddedClickHouse(tmp_path / "late", port=port):
        await asyncio.wait_for(writing, 60)
        client = ClickHouseTarget.from_url(url).client()
        assert client.query("SELECT count() FROM events").result_rows[0][0] == 10
        client.close()
        await writer.close()


def test_sql_is_read_only(clickhouse_url):
    target = ClickHouseTarget.from_url(clickhouse_url)
    apply_schema(target)
    client = target.client()
    columns, rows = run_readonly(client, "SELECT 1 AS one, 'a' AS letter")
    assert render(columns, rows, "csv") == "one,letter\n1,a"
    assert render(columns, rows, "json") == '{"one": 1, "letter": "a"}'
    assert "(1 row)" in render(columns, rows)
    for sql in (
        "INSERT INTO schema_versions (version) VALUES (99)",
        "DROP TABLE event_log",
        "ALTER TABLE event_log DELETE WHERE 1",
    ):
        with pytest.raises(DatabaseError, match="readonly|READONLY"):
            run_readonly(client, sql)
    assert (
        client.query("SELECT count() FROM schema_versions WHERE version = 99").result_rows[0][0]
        == 0
    )


async def test_verify_names_altered_deleted_and_inserted_rows(clickhouse_url, tmp_path, capsys):
    writer = writer_for(clickhouse_url, tmp_path)
    await writer.start()
    for start in (0, 10, 20):
        await writer.write(calls(10, start))  # type: ignore[arg-type]
    await writer.close()
    client = ClickHouseTarget.from_url(clickhouse_url).client()
    key = load_seal_public_key(tmp_path)
    assert verify_store(client, key).ok

    def event_at(seq: int) -> str:
        return client.query(f"SELECT event_id FROM event_log WHERE chain_seq = {seq}").result_rows[
            0
        ][0]

    altered, deleted = event_at(5), event_at(17)
    settings = {"mutations_sync": 2}
    client.command(
        "ALTER TABLE event_log UPDATE user = 'u-mallory' WHERE chain_seq = 5", settings=settings
    )
    client.command("ALTER TABLE event_log DELETE WHERE chain_seq = 17", settings=settings)
    client.command(
        "INSERT INTO event_log SELECT * REPLACE ('forged-1' AS event_id, 'u-mallory' AS user) "
        "FROM event_log WHERE chain_seq = 25"
    )
    report = verify_store(client, key)
    found = {(f.kind, f.chain_seq, f.event_id) for f in report.findings}
    assert ("altered", "5", altered) in found
    assert ("deleted", "17", "") in found
    assert ("inserted", "25", "forged-1") in found
    assert len(found) == 3 and not report.ok
    assert deleted not in {f.event_id for f in report.findings}
    # The same, as an auditor runs it.
    assert (
        audit_cli(
            "verify",
            "--public-key",
            str(tmp_path / "audit-seal.pub"),
            "--clickhouse-url",
            clickhouse_url,
            "--without-seals",  # no NATS here: ClickHouse alone
        )
        == 1
    )
    out = capsys.readouterr().out
    assert f"ALTERED   chain {writer.chain.chain_id} seq 5 event {altered}" in out
    assert "INSERTED  chain" in out and "forged-1" in out and "TAMPERED (3 finding(s))" in out


def audit_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="toolgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", *argv])
    return int(args.func(args))


def test_schema_command_applies_the_ddl(clickhouse_url, capsys):
    assert audit_cli("schema", "--clickhouse-url", clickhouse_url) == 0
    assert f"applied {[f.version for f in load_ddl()]}" in capsys.readouterr().out
    assert audit_cli("schema", "--clickhouse-url", clickhouse_url) == 0
    assert "applied nothing new" in capsys.readouterr().out
