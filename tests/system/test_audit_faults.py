"""The audit under faults: ClickHouse down mid-run, the sink SIGKILLed mid-batch.

Either way the pipeline keeps serving, the sink catches up, and the `events`
view holds every event exactly once: as many rows as distinct event ids in
the events stream plus messages in the calls stream, and the same ids.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, make_test_registry
from tests.system.test_audit_pipeline import expected_rows, stored_messages, stream_event_ids
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.services.audit.chain import load_seal_public_key
from toolgate.services.audit.verify import verify_store
from toolgate.stack.clickhouse_server import EmbeddedClickHouse

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
CALLS = 2000
# How long ClickHouse stays down, counted from the kill. The issue says "a
# minute"; 20 s is already two ack-waits of the sink's consumer (10 s), so any
# batch that was not kept alive would have been redelivered meanwhile, and the
# whole run of calls completes while ClickHouse is down.
OUTAGE_S = 20.0


@pytest.fixture
def audited(tmp_path: Path) -> Iterator[Gateway]:
    gateway = Gateway(
        data_dir=tmp_path / "data",
        registry_dir=make_test_registry(tmp_path / "registry"),
        with_audit=True,
    ).start()
    yield gateway
    gateway.stop()


def calls(prefix: str) -> list[ToolCall]:
    return [
        ToolCall(call_id=f"{prefix}-{i:05d}", tool="echo", arguments={"payload": i}, principal=BOB)
        for i in range(CALLS)
    ]


def audited_rows(gateway: Gateway) -> int:
    try:
        client = gateway.audit_client()
        return int(client.query("SELECT count() FROM events").result_rows[0][0])
    except Exception:  # ClickHouse down or the schema not there yet
        return -1


async def until(predicate, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.2)


async def assert_each_event_once(gateway: Gateway, calls: int = CALLS) -> int:
    expected = await expected_rows(gateway)
    await until(lambda: audited_rows(gateway) >= expected)
    client = gateway.audit_client()
    count, distinct = client.query("SELECT count(), uniqExact(event_id) FROM events").result_rows[0]
    assert count == distinct == expected
    stored = {
        r[0]
        for r in client.query(
            "SELECT event_id FROM events WHERE source_stream = 'TOOLGATE_EVENTS'"
        ).result_rows
    }
    assert stored == await stream_event_ids(gateway)
    requested = client.query(
        "SELECT count() FROM events WHERE event_type = 'CallRequested'"
    ).result_rows[0][0]
    assert requested == calls
    report = verify_store(client, load_seal_public_key(gateway.data_dir / "keys"))
    assert report.ok, [f.line() for f in report.tampered]
    return expected


async def test_clickhouse_down_mid_run_loses_and_doubles_nothing(audited: Gateway) -> None:
    stack = audited.stack
    assert stack.clickhouse is not None
    before, during = calls("ch")[: CALLS // 2], calls("ch")[CALLS // 2 :]
    async with await audited.client() as client:
        first = asyncio.gather(*(client.submit(c, timeout=300) for c in before))
        await until(lambda: audited_rows(audited) > 0)
        port, data_dir = stack.clickhouse.port, stack.clickhouse.data_dir
        stack.clickhouse.kill()
        down_at = time.monotonic()
        at_kill = await stored_messages(audited)
        # The second half is published only now: the pipeline can be fast enough
        # to finish a whole run before the sink's first row lands.
        second = asyncio.gather(*(client.submit(c, timeout=300) for c in during))
        results = [*await first, *await second]
        # Every call got its result while ClickHouse was down: the audit is off the path.
        assert not stack.clickhouse.running()
        assert all(r.ok for r in results)
        assert await stored_messages(audited) > at_kill
    await asyncio.sleep(max(0.0, OUTAGE_S - (time.monotonic() - down_at)))
    stack.clickhouse = EmbeddedClickHouse(data_dir, port=port).start()
    assert audited.service("audit").alive(), "the sink must wait for ClickHouse, not die"
    await assert_each_event_once(audited)


async def test_sink_killed_mid_batch_loses_and_doubles_nothing(audited: Gateway) -> None:
    sink = audited.service("audit")
    assert sink.process is not None
    # Freeze the sink while the calls run, so it wakes to a backlog of thousands
    # of rows and is in the middle of a batch when it is killed.
    os.kill(sink.process.pid, signal.SIGSTOP)
    async with await audited.client() as client:
        results = await asyncio.gather(*(client.submit(c, timeout=300) for c in calls("kill")))
    assert all(r.ok for r in results)
    os.kill(sink.process.pid, signal.SIGCONT)
    await until(lambda: audited_rows(audited) > 0)
    sink.kill()  # SIGKILL: the batch it held is neither sealed nor acked
    killed_at = audited_rows(audited)
    sink.start()
    expected = await assert_each_event_once(audited)
    assert 0 < killed_at < expected, "the kill must land mid-run"
    raw = audited.audit_client().query("SELECT count() FROM event_log").result_rows[0][0]
    print(
        f"sink SIGKILLed at {killed_at} of {expected} rows; event_log holds {raw} physical "
        "rows (copies of a batch inserted but not acked are read once)"
    )
