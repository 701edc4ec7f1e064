"""`toolgate bench audit`: sustained rows/s into ClickHouse against the pipeline's peak.

The sink is measured the way it runs in production: its own process
(`toolgate serve audit`), reading a backlog of real-shaped
messages (each call: the raw call plus the five events of a successful
search_sources call) from JetStream and writing them to ClickHouse. The rate
is taken between the first rows and the last, so start-up does not count.
The pipeline's peak is measured with a burst of echo calls through a private
gateway without audit (or given with `pipeline_events_per_s`): every stored
message of both streams is one audit row.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import nats

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall, success
from toolgate.contracts.events import (
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    Event,
    ExecutionStarted,
    ExecutionSucceeded,
    ResultAttached,
    call_fields,
    encode_event,
    utc_now,
)
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.stack.processes import die_with_parent

if TYPE_CHECKING:  # clickhouse-connect: not for every command (`toolgate bench`'s flags are)
    from clickhouse_connect.driver.client import Client

GOAL_RATIO = 5.0
ROWS_PER_CALL = 6
PRINCIPAL = Principal(tenant="bench", user="u-bench", agent="researcher", session="s-bench")
OUTPUT = {
    "items": [
        {
            "title": f"Result {i}",
            "url": f"https://example.org/{i}",
            "source_type": "official",
            "snippet": "x" * 160,
        }
        for i in range(3)
    ]
}


@dataclass(frozen=True)
class AuditFigures:
    rows: int
    sink_rows_per_s: float
    pipeline_events_per_s: float

    @property
    def ratio(self) -> float:
        return self.sink_rows_per_s / self.pipeline_events_per_s


def call_story(i: int) -> tuple[ToolCall, list[Event]]:
    call = ToolCall(
        call_id=f"bench-{i:08d}",
        tool="search_sources",
        principal=PRINCIPAL,
        arguments={"query": f"agent state management {i}", "source_type": "any", "limit": 3},
        task_id="task-bench",
    )
    now = utc_now()
    common = dict(
        occurred_at=now,
        service="bench",
        **call_fields(call),
        arguments_sha256=arguments_sha256(call.arguments),
    )
    auth = Authorization(
        call_id=call.call_id,
        tool=call.tool,
        arguments_sha256="0" * 64,
        policy_version="bench",
        expires_at=now + timedelta(hours=1),
        tenant=PRINCIPAL.tenant,
        agent=PRINCIPAL.agent,
        user=PRINCIPAL.user,
        session=PRINCIPAL.session,
        task_id=call.task_id,
        key_id="k",
        signature="s" * 88,
    )
    return call, [
        ArgumentsValidated(event_id=f"{i}-v", call=call, **common),
        CallAuthorized(
            event_id=f"{i}-a", call=call, policy_version="bench", authorization=auth, **common
        ),
        ExecutionStarted(event_id=f"{i}-s", attempt=1, worker="bench", **common),
        ExecutionSucceeded(event_id=f"{i}-x", output=OUTPUT, duration_ms=1.25, **common),
        ResultAttached(event_id=f"{i}-r", result=success(call.call_id, OUTPUT), **common),
    ]


async def fill_backlog(nats_url: str, calls: int) -> int:
    """Publish `calls` stories (with publish acks); returns the rows they make."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    # Where the agent's own identity would have published them.
    calls_subject = subjects.calls_subject(PRINCIPAL.tenant, PRINCIPAL.agent)
    for start in range(0, calls, 500):
        pending = []
        for i in range(start, min(start + 500, calls)):
            call, events = call_story(i)
            pending.append(js.publish(calls_subject, msgspec.json.encode(call)))
            pending += [js.publish(subjects.subject_of(e), encode_event(e)) for e in events]
        await asyncio.gather(*pending)
    await nc.close()
    return calls * ROWS_PER_CALL


def measure_sink(
    nats_url: str, clickhouse_url: str, data_dir: Path, rows: int, timeout: float = 600.0
) -> float:
    """Start the sink on the backlog; rows/s from its genesis checkpoint (schema applied,
    about to pull) to the checkpoint that sealed its last row, both signed by the sink
    itself: start-up does not count, and a backlog written in one batch still has a
    duration (the time between first and last rows seen by polling would be zero)."""
    command = [
        sys.executable,
        "-m",
        "toolgate.cli",
        "serve",
        "audit",
        "--nats-url",
        nats_url,
        "--clickhouse-url",
        clickhouse_url,
        "--data-dir",
        str(data_dir),
    ]
    log = open(data_dir / "audit-bench.log", "ab")  # the child owns it
    sink = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
    )
    try:
        target = ClickHouseTarget.from_url(clickhouse_url)
        deadline = time.monotonic() + timeout
        client = None
        while time.monotonic() < deadline:
            if sink.poll() is not None:
                raise RuntimeError(f"the sink exited with {sink.returncode}; see {log.name}")
            client = client or _client(target)
            span = _sealed_span(client, rows)
            if span is not None:
                return rows / max(span, 1e-6)
            time.sleep(0.1)
        raise TimeoutError(f"the sink wrote fewer than {rows} rows in {timeout}s")
    finally:
        sink.terminate()
        sink.wait(30)
        log.close()


def _sealed_span(client: Client | None, rows: int) -> float | None:
    """Seconds from the genesis checkpoint to the one covering `rows` rows (None: not yet)."""
    if client is None or _count(client) < rows:
        return None
    try:
        genesis, last = client.query(
            "SELECT minIf(signed_at, chain_seq = 0), minIf(signed_at, chain_seq >= {rows:UInt64})"
            " FROM chain_checkpoints HAVING countIf(chain_seq >= {rows:UInt64}) > 0",
            parameters={"rows": rows},
        ).result_rows[0]
    except Exception:  # no checkpoint table or no row yet: not sealed yet
        return None
    return float((last - genesis).total_seconds())


def _client(target: ClickHouseTarget) -> Client | None:
    try:
        return target.client()
    except Exception:  # the sink has not created the database yet
        return None


def _count(client: Client | None) -> int:
    if client is None:
        return 0
    try:
        return int(client.query("SELECT count() FROM event_log").result_rows[0][0])
    except Exception:  # the schema is not applied yet
        return 0


async def _burst(
    nats_url: str, calls: int, agent_creds: Path | None, admin_creds: Path | None
) -> float:
    """Rows the pipeline produces per second under a burst of echo calls."""
    from toolgate.client.gateway_client import GatewayClient
    from toolgate.runtime.creds import connect_options

    # The calls come from an agent's own identity, as on a real gateway; the
    # operator's credentials read the streams' counters.
    identity = (PRINCIPAL.tenant, PRINCIPAL.agent) if agent_creds is None else None
    async with await GatewayClient.connect(nats_url, agent_creds, identity=identity) as client:
        principal = client.principal(PRINCIPAL.user, PRINCIPAL.session)
        await client.call("echo", {}, principal=principal, timeout=60)  # warm-up
        nc = await nats.connect(nats_url, **connect_options(admin_creds))
        js = nc.jetstream()

        async def stored() -> int:
            return sum(
                [
                    (await js.stream_info(s)).state.messages
                    for s in (subjects.CALLS_STREAM, subjects.EVENTS_STREAM)
                ]
            )

        before = await stored()
        started = time.perf_counter()
        await asyncio.gather(
            *(
                client.submit(
                    ToolCall(
                        call_id=f"burst-{i}",
                        tool="echo",
                        arguments={"payload": i},
                        principal=principal,
                    ),
                    timeout=300,
                )
                for i in range(calls)
            )
        )
        elapsed = time.perf_counter() - started
        rows = await stored() - before
        await nc.close()
    return rows / elapsed


def measure_pipeline_peak(tmp: Path, calls: int) -> float:
    from toolgate.stack.supervisor import Stack

    stack = Stack(data_dir=tmp / "pipeline", with_audit=False)
    stack.start()
    try:
        return asyncio.run(
            _burst(stack.url, calls, stack.creds_of("agent"), stack.creds_of("admin"))
        )
    finally:
        stack.stop()


def run_audit_bench(
    calls: int = 10_000,
    pipeline_events_per_s: float | None = None,
    burst: int = 1000,
    clickhouse_url: str | None = None,
) -> AuditFigures:
    """Measure and print; `calls` stories of six rows make the sink's backlog."""
    from toolgate.runtime.topology import apply_topology
    from toolgate.stack.clickhouse_server import EmbeddedClickHouse
    from toolgate.stack.nats_server import EmbeddedNats

    with tempfile.TemporaryDirectory(prefix="toolgate-audit-bench-") as name:
        tmp = Path(name)
        if pipeline_events_per_s is None:
            print(
                f"pipeline: burst of {burst} echo calls through a private gateway ...", flush=True
            )
            pipeline_events_per_s = measure_pipeline_peak(tmp, burst)
        nats_server = EmbeddedNats(tmp / "nats").start()
        clickhouse = None if clickhouse_url else EmbeddedClickHouse(tmp / "clickhouse").start()
        # The embedded server's admin: the sink applies the schema of this private database.
        url = clickhouse_url or clickhouse.url_for("admin", "audit_bench")  # type: ignore[union-attr]
        try:
            asyncio.run(apply_topology(nats_server.url))
            print(f"sink: backlog of {calls} calls ({calls * ROWS_PER_CALL} rows) ...", flush=True)
            rows = asyncio.run(fill_backlog(nats_server.url, calls))
            sink_rate = measure_sink(nats_server.url, url, tmp, rows)
        finally:
            if clickhouse is not None:
                clickhouse.stop()
            nats_server.stop()
    figures = AuditFigures(rows, sink_rate, pipeline_events_per_s)
    verdict = "meets" if figures.ratio >= GOAL_RATIO else "MISSES"
    print(
        f"audit sink   {figures.sink_rows_per_s:10.0f} rows/s sustained into ClickHouse "
        f"({rows} rows, one sink process)\n"
        f"pipeline     {figures.pipeline_events_per_s:10.0f} events/s at peak "
        f"(calls + events stored per second)\n"
        f"ratio        {figures.ratio:10.1f}x  ({verdict} the goal of {GOAL_RATIO:.0f}x)",
        flush=True,
    )
    return figures


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--audit-calls",
        type=int,
        default=10_000,
        help="audit: calls in the sink's backlog (six rows each)",
    )
    parser.add_argument(
        "--events-per-s",
        type=float,
        default=None,
        help="audit: the pipeline's peak events/s (default: measure a burst)",
    )

    from toolgate.bench.audit_queries import add_arguments

    add_arguments(parser)  # `toolgate bench audit-queries --events N`


def cmd_bench_audit(args: argparse.Namespace) -> int:
    run_audit_bench(
        calls=args.audit_calls, pipeline_events_per_s=args.events_per_s, burst=args.burst
    )
    return 0
