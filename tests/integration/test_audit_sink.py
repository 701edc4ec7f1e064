"""The audit sink on a real NATS and a real ClickHouse: every message once, from any replica."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from faststream import TestApp

from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.topology import apply_topology
from toolgate.services.audit.app import build_sink
from toolgate.services.audit.chain import load_seal_public_key
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.verify import verify_store
from toolgate.stack.nats_server import EmbeddedNats

P = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
CALLS_SUBJECT = subjects.calls_subject(P.tenant, P.agent)
CALLS = 3000


async def publish_backlog(url: str) -> int:
    """Calls, garbage on both streams; returns how many messages the streams hold."""
    nc = await nats.connect(url)
    js = nc.jetstream()
    pending = []
    for i in range(CALLS):
        call = ToolCall(
            call_id=f"c-{i}", tool="search_sources", arguments={"query": f"q{i}"}, principal=P
        )
        pending.append(js.publish(CALLS_SUBJECT, msgspec.json.encode(call)))
    await asyncio.gather(*pending)
    await js.publish(CALLS_SUBJECT, b"{not a call")
    await js.publish(f"{subjects.EVENTS_PREFIX}.Bogus.x", b"\x00 not an event")
    total = 0
    for stream in (subjects.CALLS_STREAM, subjects.EVENTS_STREAM):
        total += (await js.stream_info(stream)).state.messages
    await nc.close()
    return total


async def wait_for_rows(client, expected: int, timeout: float = 90.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while client.query("SELECT count() FROM events").result_rows[0][0] < expected:
        assert asyncio.get_running_loop().time() < deadline, "the sink did not catch up"
        await asyncio.sleep(0.2)


async def test_two_replicas_record_every_message_once(
    nats_server: EmbeddedNats, clickhouse_url: str, tmp_path: Path
):
    await apply_topology(nats_server.url)
    expected = await publish_backlog(nats_server.url)
    settings = GatewaySettings(nats_url=nats_server.url, data_dir=tmp_path)
    first, first_writer = build_sink(settings, clickhouse_url, batch_rows=500)
    second, second_writer = build_sink(settings, clickhouse_url, batch_rows=500)
    async with TestApp(first), TestApp(second):  # start-up applies the schema
        client = ClickHouseTarget.from_url(clickhouse_url).client()
        await wait_for_rows(client, expected)
    count, distinct = client.query("SELECT count(), uniqExact(event_id) FROM events").result_rows[0]
    assert count == distinct == expected
    notes = client.query(
        "SELECT event_type, note FROM events WHERE note != '' ORDER BY 1"
    ).result_rows
    assert [t for t, _ in notes] == ["CallRequested", "UndecodableEvent"]
    # Batching works (faststream #2219 reported single messages): far fewer batches than rows.
    batches = first_writer.batches_written + second_writer.batches_written
    rows = first_writer.rows_written + second_writer.rows_written
    assert rows >= expected and batches * 10 <= rows, (batches, rows)
    report = verify_store(client, load_seal_public_key(tmp_path / "keys"))
    assert report.ok and report.findings == [], report.findings
    assert report.chains == 2


async def test_a_batch_waiting_for_clickhouse_is_kept_then_acked_once_written(
    nats_server: EmbeddedNats, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """ClickHouse away for several AckWaits: the batch in hand is kept `in progress` by the
    stage runner's heartbeat (not handed out again) and acked only once it is written."""
    from toolgate.services.audit import app as audit_app
    from toolgate.services.audit import writer as writer_module
    from toolgate.stack.clickhouse_server import EmbeddedClickHouse

    # The first in_progress comes up to two heartbeats (1/3 of the AckWait) after the batch
    # is handed over, which waits up to flush_s: 3 s leaves ~1.8 s for a loaded loop.
    monkeypatch.setattr(audit_app, "ACK_WAIT_S", 3.0)
    monkeypatch.setattr(writer_module, "RETRY_MAX_S", 0.5)
    await apply_topology(nats_server.url)
    server = EmbeddedClickHouse(tmp_path / "clickhouse")
    url = server.url_for("admin", "audit")
    settings = GatewaySettings(nats_url=nats_server.url, data_dir=tmp_path)
    app, writer = build_sink(settings, url, batch_rows=500, flush_s=0.2)
    nc = await nats.connect(nats_server.url)
    jsm = nc.jsm()
    try:
        await asyncio.to_thread(server.start)
        async with TestApp(app):  # start-up applies the schema
            await asyncio.to_thread(server.stop)
            js = nc.jetstream()
            await asyncio.gather(*(js.publish(CALLS_SUBJECT, b"{not a call}") for _ in range(20)))

            async def in_hand() -> int:
                info = await jsm.consumer_info(subjects.CALLS_STREAM, "audit")
                return int(info.num_ack_pending or 0)

            deadline = asyncio.get_running_loop().time() + 60
            while not (held := await in_hand()):  # a batch in hand, its insert failing
                assert asyncio.get_running_loop().time() < deadline, "no batch in hand"
                await asyncio.sleep(0.1)
            # Another replica asks for the durable's messages for over three AckWaits: none
            # of the batch in hand is handed to it.
            other = await js.pull_subscribe_bind("audit", subjects.CALLS_STREAM)
            # Nothing handed out: nats-py 2.16 says so with its TimeoutError or, from an
            # idle fetch, a bare asyncio one (TimeoutError is the base of both).
            with pytest.raises(TimeoutError):
                await other.fetch(held, timeout=10.0)
            await other.unsubscribe()
            info = await jsm.consumer_info(subjects.CALLS_STREAM, "audit")
            assert (info.num_ack_pending, info.num_redelivered) == (held, 0)
            await asyncio.to_thread(server.start)
            client = ClickHouseTarget.from_url(url).client()
            await wait_for_rows(client, 20)
            while await in_hand():  # acked once written
                assert asyncio.get_running_loop().time() < deadline + 120, "never acked"
                await asyncio.sleep(0.1)
            info = await jsm.consumer_info(subjects.CALLS_STREAM, "audit")
            assert info.num_redelivered == 0
            assert client.query("SELECT count() FROM event_log").result_rows[0][0] == 20
            assert writer.rows_written == 20  # nothing written twice
    finally:
        await nc.close()
        await asyncio.to_thread(server.stop)
