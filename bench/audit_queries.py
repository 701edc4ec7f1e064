"""`toolgate bench audit-queries --events N`: the audit at the size a deployment reaches.

Loads N synthetic events through the sink's own insert path (RowBuilder,
the hash chain, the JSON insert with its dedupe token, a signed checkpoint
per batch: AuditWriter.write, as `toolgate serve audit` runs it), with
several writer processes side by side as sink replicas would run, then
times what an auditor runs: `audit trace` of calls, every query of
QUERIES.md, and `audit verify` (in ClickHouse). Figures are printed, never
asserted; the targets at 10 million events are in GOALS.

The events are shaped like real ones (a call and its five events for a
successful search, four for a denial, three for bad arguments), spread over
30 days, over 20 tenants x 5 agents x 2,000 users; each story is the
encoding of one real story with its ids and times substituted, so the
generator costs little next to the sink.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec

from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall, ToolError, failure, success
from toolgate.contracts.events import (
    ArgumentsRejected,
    ArgumentsValidated,
    CallDenied,
    Event,
    ExecutionStarted,
    ExecutionSucceeded,
    ResultAttached,
    call_fields,
    encode_event,
)

GOALS = {"trace_ms": 200.0, "query_s": 2.0, "verify_s": 60.0, "ingest_per_s": 50_000.0}
BATCH_ROWS = 10_000
CALL_MARK = "CALLIDXXXXXXXXXXXXXX"  # 20 characters, replaced by each story's call_id
TIME_MARK = "2026-01-01T00:00:00.123456"  # a fraction, so that every encoded time carries it
SPREAD = timedelta(days=30)
START = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass(frozen=True)
class Template:
    """One story's encoded messages: (stream, subject, bytes) with the marks inside."""

    messages: tuple[tuple[str, str, bytes], ...]


def _story(kind: str, tenant: str, agent: str, user: str) -> Template:
    principal = Principal(tenant=tenant, user=user, agent=agent, session="s-bench")
    call = ToolCall(
        call_id=CALL_MARK,
        tool="search_sources",
        principal=principal,
        arguments={"query": "agent state management", "source_type": "any", "limit": 3},
        task_id="task-bench",
    )
    at = datetime.fromisoformat(TIME_MARK).replace(tzinfo=UTC)
    common: dict[str, Any] = dict(
        occurred_at=at, service="bench", **call_fields(call), arguments_sha256="a" * 64
    )
    output = {"items": [{"title": "Result", "url": "https://example.org/1", "snippet": "x" * 80}]}
    events: list[Event] = []
    if kind == "invalid":
        error = ToolError(code="SCHEMA_VALIDATION_FAILED", message="50 > 10", retryable=False)
        events = [
            ArgumentsRejected(
                event_id=f"{CALL_MARK}-r", status="invalid_arguments", error=error, **common
            ),
            ResultAttached(
                event_id=f"{CALL_MARK}-a",
                result=failure(CALL_MARK, "invalid_arguments", error),
                **common,
            ),
        ]
    else:
        events = [ArgumentsValidated(event_id=f"{CALL_MARK}-v", call=call, **common)]
        if kind == "denied":
            error = ToolError(code="POLICY_DENIED", message="forbidden", retryable=False)
            events += [
                CallDenied(
                    event_id=f"{CALL_MARK}-d",
                    status="denied",
                    error=error,
                    policy_version="bench",
                    **common,
                ),
                ResultAttached(
                    event_id=f"{CALL_MARK}-a", result=failure(CALL_MARK, "denied", error), **common
                ),
            ]
        else:
            events += [
                ExecutionStarted(event_id=f"{CALL_MARK}-s", attempt=1, worker="bench", **common),
                ExecutionSucceeded(
                    event_id=f"{CALL_MARK}-x", output=output, duration_ms=1.25, **common
                ),
                ResultAttached(
                    event_id=f"{CALL_MARK}-a", result=success(CALL_MARK, output), **common
                ),
            ]
    messages = [
        (
            subjects.CALLS_STREAM,
            subjects.calls_subject(tenant, agent),
            msgspec.json.encode(call),
        )
    ]
    messages += [(subjects.EVENTS_STREAM, subjects.subject_of(e), encode_event(e)) for e in events]
    return Template(tuple(messages))


class _Message:
    """What AuditWriter.write needs of a JetStream message; acks go nowhere."""

    __slots__ = ("subject", "data", "reply")

    def __init__(self, subject: str, data: bytes, reply: str) -> None:
        self.subject, self.data, self.reply = subject, data, reply

    @property
    def metadata(self) -> Any:  # never used: the reply subject carries it all
        raise AttributeError("metadata")

    async def ack(self) -> None:
        return None

    async def in_progress(self) -> None:
        return None


def _templates() -> list[Template]:
    rng = random.Random(7)
    kinds = ["ok"] * 18 + ["denied", "invalid"]
    return [
        _story(
            rng.choice(kinds),
            f"tenant-{rng.randrange(20):02d}",
            f"agent-{rng.randrange(5)}",
            f"u-{rng.randrange(2000):04d}",
        )
        for _ in range(400)
    ]


def story_messages(templates: list[Template], i: int, seq: list[int], total: int) -> list[_Message]:
    """Story `i` with its own call_id and time; `seq` counts stream positions per stream."""
    template = templates[i % len(templates)]
    call_id = f"b{i:019d}".encode()
    at = START + SPREAD * (i / max(total, 1))
    stamp = at.strftime("%Y-%m-%dT%H:%M:%S.%f").encode()
    ns = int(at.timestamp() * 1e9)
    out = []
    for stream, subject, data in template.messages:
        seq[0] += 1
        body = data.replace(CALL_MARK.encode(), call_id).replace(TIME_MARK.encode(), stamp)
        reply = f"$JS.ACK.{stream}.audit.1.{seq[0]}.{seq[0]}.{ns}.0"
        out.append(_Message(subject, body, reply))
    return out


def _load_worker(
    url: str, keys: str, worker: int, stories: range, total: int
) -> tuple[int, float, float]:
    """One writer process (a sink replica): its stories, batch by batch. (rows, seconds,
    the CPU seconds of its writing: the process's, less what making the stories took)."""
    from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry
    from toolgate.services.audit.chain import ensure_seal_key
    from toolgate.services.audit.connection import ClickHouseTarget
    from toolgate.services.audit.rows import RowBuilder
    from toolgate.services.audit.writer import AuditWriter

    async def run() -> tuple[int, float, float]:
        writer = AuditWriter(
            ClickHouseTarget.from_url(url),
            RowBuilder(load_registry(BUILTIN_TOOLS_DIR)),
            ensure_seal_key(Path(keys)),
            f"bench-{worker}",
        )
        await writer.start()
        templates = _templates()
        seq = [worker * 10 * (stories.stop + 1)]
        batch: list[_Message] = []
        started, cpu_started, making = time.perf_counter(), time.process_time(), 0.0
        for i in stories:
            made = time.process_time()
            batch += story_messages(templates, i, seq, total)
            making += time.process_time() - made
            if len(batch) >= BATCH_ROWS:
                await writer.write(batch)
                batch = []
        if batch:
            await writer.write(batch)
        elapsed = time.perf_counter() - started
        cpu = time.process_time() - cpu_started - making
        await writer.close()
        return writer.rows_written, elapsed, cpu

    return asyncio.run(run())


ROWS_PER_STORY = 4.85  # 18/20 stories of 5 rows, 1/20 of 4, 1/20 of 3


def load(url: str, keys: Path, events: int, processes: int) -> tuple[int, float, float]:
    """Write about `events` rows with `processes` writers; (rows, wall seconds, the
    writers' CPU seconds)."""
    stories = max(1, int(events / ROWS_PER_STORY))
    per = -(-stories // processes)
    ranges = [range(p * per, min(stories, (p + 1) * per)) for p in range(processes)]
    started = time.perf_counter()
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        results = pool.starmap(
            _load_worker, [(url, str(keys), p, r, stories) for p, r in enumerate(ranges)]
        )
    rows = sum(r for r, _, _ in results)
    return rows, time.perf_counter() - started, sum(cpu for _, _, cpu in results)


def queries_of(path: Path) -> list[tuple[str, str]]:
    """(title, sql) of every ```sql block of QUERIES.md."""
    text = path.read_text()
    found = []
    for match in re.finditer(r"^## (.+?)$(.*?)```sql\n(.*?)```", text, re.S | re.M):
        found.append((match[1].strip(), match[3].strip()))
    return found


def timed(fn: Any, repeat: int = 3) -> tuple[float, Any]:
    """Best of `repeat` (seconds) and the last answer: the first run also warms caches."""
    best, answer = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        answer = fn()
        best = min(best, time.perf_counter() - t0)
    return best, answer


def measure(url: str, keys: Path, rows: int) -> dict[str, float]:
    from toolgate.services.audit.chain import load_seal_public_key
    from toolgate.services.audit.connection import ClickHouseTarget
    from toolgate.services.audit.schema import ddl_root
    from toolgate.services.audit.trace import read_call_events, story
    from toolgate.services.audit.verify import verify_store

    client = ClickHouseTarget.from_url(url).client()
    figures: dict[str, float] = {}
    templates = _templates()
    stories = max(1, int(rows / ROWS_PER_STORY))
    rng = random.Random(11)
    traces = []
    for _ in range(5):
        i = rng.randrange(stories)
        messages = story_messages(templates, i, [0], stories)
        tenant, agent = messages[0].subject.split(".")[-2:]
        call_id = f"b{i:019d}"
        seconds, found = timed(
            lambda c=call_id, t=tenant, a=agent: story(read_call_events(client, c, t, a))
        )
        assert found, f"trace of {call_id} found nothing"
        traces.append(seconds)
    figures["trace_ms"] = 1000 * statistics.median(traces)
    print(f"  audit trace        {figures['trace_ms']:9.1f} ms  (median of 5 calls)", flush=True)
    sql = Path(str(ddl_root())) / "QUERIES.md"
    for title, query in queries_of(sql):
        seconds, _ = timed(lambda q=query: client.query(q).result_rows, repeat=2)
        figures[f"query: {title}"] = seconds
        print(f"  {seconds:8.2f} s  {title}", flush=True)
    key = load_seal_public_key(keys)
    seconds, report = timed(lambda: verify_store(client, key), repeat=1)
    figures["verify_s"] = seconds
    verdict = "OK" if report.ok else f"TAMPERED {[f.line() for f in report.tampered][:3]}"
    print(f"  audit verify       {seconds:9.2f} s   {verdict}, {report.rows} rows", flush=True)
    return figures


def run_audit_queries_bench(
    events: int, processes: int = 2, clickhouse_url: str | None = None
) -> dict[str, float]:
    from toolgate.stack.clickhouse_server import EmbeddedClickHouse

    with tempfile.TemporaryDirectory(prefix="toolgate-audit-queries-") as name:
        tmp = Path(name)
        clickhouse = None if clickhouse_url else EmbeddedClickHouse(tmp / "clickhouse").start()
        url = clickhouse_url or clickhouse.url_for("admin")  # type: ignore[union-attr]
        try:
            print(f"loading ~{events} events with {processes} writer process(es) ...", flush=True)
            load_started = os.getloadavg()[0]
            rows, seconds, cpu = load(url, tmp / "keys", events, processes)
            rate = rows / seconds
            print(
                f"  ingest   {rate:10.0f} events/s through the sink's insert path "
                f"({rows} rows in {seconds:.1f} s; load average {load_started:.1f} at start)",
                flush=True,
            )
            # What a shared machine does not blur: the writers' own CPU per event.
            print(
                f"  writers' CPU {1e6 * cpu / rows:6.1f} us/event (the writer processes, "
                "the making of the synthetic messages left out)",
                flush=True,
            )
            figures = measure(url, tmp / "keys", rows)
            figures["ingest_per_s"] = rate
            figures["writer_cpu_us_per_event"] = 1e6 * cpu / rows
            figures["rows"] = rows
        finally:
            if clickhouse is not None:
                clickhouse.stop()
    worst = max(v for k, v in figures.items() if k.startswith("query: "))
    print(
        f"goals at 10M: trace < {GOALS['trace_ms']:.0f} ms ({figures['trace_ms']:.1f}), "
        f"each query < {GOALS['query_s']:.0f} s (worst {worst:.2f}), verify < "
        f"{GOALS['verify_s']:.0f} s ({figures['verify_s']:.1f}), ingest >= "
        f"{GOALS['ingest_per_s']:.0f}/s ({figures['ingest_per_s']:.0f})",
        flush=True,
    )
    return figures


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--events",
        type=int,
        default=100_000,
        help="audit-queries: synthetic events to load (default %(default)s)",
    )
    parser.add_argument(
        "--writers",
        type=int,
        default=2,
        help="audit-queries: writer processes loading them (default %(default)s)",
    )


def cmd_bench_audit_queries(args: argparse.Namespace) -> int:
    if args.events < 1 or args.writers < 1:
        print("toolgate bench audit-queries: --events and --writers must be >= 1")
        return 2
    run_audit_queries_bench(args.events, args.writers)
    return 0
