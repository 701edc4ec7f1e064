"""`toolgate bench soak`: many calls at a steady rate; does anything grow or fall behind?

Against a private gateway started as `toolgate up` starts it (locked bus,
audit on; or a running one with `--nats-url`), a plain nats-py agent (as in
`toolgate bench`) sends N calls (`-n`, default 100,000) open loop at a fixed
rate: `--rate`, else 60 % of the calls/s a short burst reached first. A
call's latency counts from when it was due (no coordinated omission).

While it runs, every few seconds: the resident memory (VmRSS, from /proc)
of every process of the gateway (each service, nats-server, ClickHouse) and
of this bench, the messages not yet acked by the consumers, and the
messages the streams hold. Reported, as markdown tables:

- every call answered? (ok, not ok, lost: no result within 60 s, errors);
- p50/p99 of the first and the last 10,000 calls (a tenth of N if fewer)
  and their ratio;
- each process's RSS when the first slice is done (warm-up end) and at the
  end, and its slope over the second half of the run, fitted by least
  squares: flat when the growth it gives over that half is at most
  max(FLAT_MIB, FLAT_FRACTION of the RSS at warm-up end);
- nats-server's RSS over time beside the messages stored, and where it
  levels off (the first sample after which it grows by no more than that
  tolerance), if it does;
- every consumer's pending and ack-pending when the calls have ended
  (each answered, or given up after 60 s), and how long after that the
  consumers had caught up.

The load average is read before the run; above LOAD_WARN the figures are
of a busy machine, which the report (and a warning) say. `--save` writes
the report to a dated file (toolgate.bench.results).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import math
import sys
import tempfile
import time
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from nats.js import JetStreamContext

from toolgate.bench import procs
from toolgate.bench.drivers import RESULT_TIMEOUT_S, PlainClient
from toolgate.bench.loops import Progress, closed_loop, percentile, say, warm_up

# The pipeline bench's gateway, gate and helpers: a soak drives the same gateway the same way.
from toolgate.bench.pipeline import (
    DRAIN_TIMEOUT_S,
    PROCESS_ORDER,
    STARTUP_QUIET_TIMEOUT_S,
    Gate,
    _admin,
    _wait_for_pipeline,
)
from toolgate.bench.results import LoadAverage, load_average
from toolgate.bench.targets import Target, gateway_target
from toolgate.contracts import subjects

DEFAULT_CALLS = 100_000
RATE_FRACTION = 0.60
SLICE = 10_000  # calls in the first and the last slice compared
SAMPLE_EVERY_S = 5.0  # at most; a short soak samples more often (SAMPLES_AT_LEAST)
SAMPLES_AT_LEAST = 20
MIN_SAMPLE_EVERY_S = 0.5
LOAD_WARN = 1.5  # load average at the start above which the machine is not quiet
FLAT_MIB = 2.0
FLAT_FRACTION = 0.02
SLICES_WITHIN = 0.20  # first and last slices' p50 and p99 within this of each other
LEVELLED_BY = 0.75  # nats-server levelled off if it did so before this share of the run
OVER_TIME_ROWS = 12
CLIENT = "client"


# ---------------------------------------------------------------- figures (pure)


@dataclass
class Sample:
    """What the sampler read at `t` seconds after the first call was due."""

    t: float
    answered: int
    rss_mb: dict[str, float]
    pending: int | None = None  # messages not yet acked, all consumers
    stored: int | None = None  # messages held by all streams


@dataclass(frozen=True)
class ConsumerLag:
    stream: str
    consumer: str
    pending: int
    ack_pending: int


@dataclass(frozen=True)
class StreamHeld:
    stream: str
    messages: int
    bytes: int


@dataclass
class Driven:
    """The calls: latency by call order (nan: no result), and what went wrong."""

    in_order_ms: Sequence[float]
    seconds: float  # from the first call's due time to the last result
    ok: int = 0
    not_ok: int = 0
    lost: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    max_lag_ms: float = 0.0  # how late a publish left against its schedule, at worst

    @property
    def answered(self) -> int:
        return self.ok + self.not_ok


@dataclass
class SoakReport:
    calls: int
    rate: float
    rate_how: str
    target: str
    load_at_start: LoadAverage | None
    driven: Driven
    samples: list[Sample]
    sample_every_s: float
    consumers_at_end: list[ConsumerLag]
    caught_up_after_s: float | None  # None: still behind after DRAIN_TIMEOUT_S
    consumers_after: list[ConsumerLag]
    streams_at_end: list[StreamHeld]
    cpu_s: dict[str, float]
    sampler_errors: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class SliceFigures:
    label: str
    calls: int
    answered: int
    p50_ms: float
    p99_ms: float
    max_ms: float


@dataclass(frozen=True)
class MemoryRow:
    name: str
    warm_mb: float
    end_mb: float
    slope_mb_per_min: float
    half_growth_mb: float
    tolerance_mb: float

    @property
    def flat(self) -> bool:
        return self.half_growth_mb <= self.tolerance_mb


def slice_size(calls: int) -> int:
    return min(SLICE, max(1, calls // 10))


def slice_figures(label: str, latencies: Sequence[float]) -> SliceFigures:
    done = sorted(v for v in latencies if not math.isnan(v))
    return SliceFigures(
        label,
        len(latencies),
        len(done),
        percentile(done, 0.50),
        percentile(done, 0.99),
        done[-1] if done else math.nan,
    )


def slope_per_s(points: Sequence[tuple[float, float]]) -> float:
    """The least-squares slope of (t, value) points; 0 with fewer than two times."""
    if len(points) < 2:
        return 0.0
    mean_t = sum(t for t, _ in points) / len(points)
    mean_v = sum(v for _, v in points) / len(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return 0.0
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread


def tolerance_mb(rss_mb: float) -> float:
    return max(FLAT_MIB, FLAT_FRACTION * rss_mb)


def warm_up_end_s(calls: int, rate: float) -> float:
    """When the first slice's calls were all due: the end of the warm-up."""
    return slice_size(calls) / rate


def _at_or_after(samples: Sequence[Sample], t: float) -> Sample:
    return next((s for s in samples if s.t >= t), samples[-1])


def memory_rows(samples: Sequence[Sample], warm_end_s: float) -> list[MemoryRow]:
    """Each process: RSS at warm-up end and at the end, slope over the second half."""
    if not samples:
        return []
    warm, end = _at_or_after(samples, warm_end_s), samples[-1]
    half = end.t / 2
    second = [s for s in samples if s.t >= half]
    rows = []
    for name in process_names(end.rss_mb):
        points = [(s.t, s.rss_mb[name]) for s in second if name in s.rss_mb]
        slope = slope_per_s(points)
        span = points[-1][0] - points[0][0] if points else 0.0
        warm_mb = warm.rss_mb.get(name, 0.0)
        rows.append(
            MemoryRow(
                name,
                warm_mb,
                end.rss_mb[name],
                slope * 60,
                slope * span,
                tolerance_mb(warm_mb),
            )
        )
    return rows


def process_names(present: Sequence[str] | dict[str, float]) -> list[str]:
    names = set(present)
    return [n for n in PROCESS_ORDER if n in names] + sorted(names - set(PROCESS_ORDER))


def levels_off(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """(t, value) from which the series grows by at most its tolerance, if before the end.

    None when it is still rising: the first such point comes after LEVELLED_BY of the run.
    """
    if not points:
        return None
    end = points[-1][0]
    highest_after = -math.inf
    found = None
    for t, value in reversed(points):  # the earliest point that nothing after outgrows
        highest_after = max(highest_after, value)
        if highest_after - value <= tolerance_mb(value):
            found = (t, value)
    if found is None or (end > 0 and found[0] > LEVELLED_BY * end):
        return None
    return found


def over_time(samples: Sequence[Sample], rows: int = OVER_TIME_ROWS) -> list[Sample]:
    """At most `rows` samples, evenly spread, the first and the last included."""
    if len(samples) <= rows:
        return list(samples)
    step = (len(samples) - 1) / (rows - 1)
    return [samples[round(i * step)] for i in range(rows)]


# ---------------------------------------------------------------- the report (pure)


def _f(value: float | None, digits: int = 2) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}"


def _ratio(a: float, b: float) -> str:
    if math.isnan(a) or math.isnan(b) or not b:
        return "-"
    return f"{a / b:.2f}x"


def _within(a: float, b: float, share: float) -> bool:
    return not (math.isnan(a) or math.isnan(b)) and b > 0 and abs(a / b - 1) <= share


def render(report: SoakReport) -> str:
    """The soak's figures as markdown: verdicts first, then the tables they come from."""
    d = report.driven
    size = slice_size(report.calls)
    first = slice_figures(f"first {size}", d.in_order_ms[:size])
    last = slice_figures(f"last {size}", d.in_order_ms[-size:])
    every = slice_figures("all", d.in_order_ms)
    memory = memory_rows(report.samples, warm_up_end_s(report.calls, report.rate))
    gateway_rows = [row for row in memory if row.name != CLIENT]
    growing = [row for row in gateway_rows if not row.flat]
    nats_points = [
        (s.t, s.rss_mb["nats-server"]) for s in report.samples if "nats-server" in s.rss_mb
    ]
    levelled = levels_off(nats_points)
    behind = [c for c in report.consumers_after if c.pending or c.ack_pending]
    errors = sum(d.errors.values())
    load = report.load_at_start
    out = [
        f"## Soak: {report.calls} calls at {report.rate:.0f} calls/s",
        "",
        f"Tool `echo`, one plain nats-py agent, open loop ({report.rate_how}); "
        f"{report.target}; {d.seconds:.0f} s.",
        "",
    ]
    if load is not None and load[0] > LOAD_WARN:
        out += [
            f"**Warning:** the load average was {load[0]:.2f} at the start (above "
            f"{LOAD_WARN}): a busy machine; these are not a quiet machine's figures.",
            "",
        ]
    out += [
        "| check | result |",
        "| --- | --- |",
        f"| every call answered | {'yes' if d.answered == report.calls else 'no'}: "
        f"{d.answered} of {report.calls} ({d.ok} ok, {d.not_ok} not ok, {d.lost} lost, "
        f"{errors} errors) |",
        "| memory flat after warm-up (each gateway process) | "
        + (
            "yes"
            if not growing
            else "no: "
            + ", ".join(f"{r.name} {r.half_growth_mb:+.1f} MiB" for r in growing)
            + " over the second half"
        )
        + " |",
        f"| first and last {size} calls within {SLICES_WITHIN:.0%} | "
        + (
            "yes"
            if _within(last.p50_ms, first.p50_ms, SLICES_WITHIN)
            and _within(last.p99_ms, first.p99_ms, SLICES_WITHIN)
            else "no"
        )
        + f": p50 {_ratio(last.p50_ms, first.p50_ms)}, p99 {_ratio(last.p99_ms, first.p99_ms)}"
        " (last / first) |",
        "| no consumer behind at the end | "
        + (
            f"yes: all caught up {report.caught_up_after_s:.1f} s after the calls ended"
            if report.caught_up_after_s is not None and not behind
            else f"no: {len(behind)} consumers still behind {DRAIN_TIMEOUT_S:.0f} s "
            "after the calls ended"
            if report.consumers_after
            else "not measured (no operator connection: --creds)"
        )
        + " |",
        "| nats-server's memory levels off | "
        + (
            f"yes: at {levelled[1]:.1f} MiB from {levelled[0]:.0f} s"
            if levelled is not None
            else "no: still rising at the end"
            if nats_points
            else "not measured"
        )
        + " |",
        "",
        "### Latency (ms, from when each call was due)",
        "",
        "| calls | count | answered | p50 | p99 | max |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in (first, last, every):
        out.append(
            f"| {s.label} | {s.calls} | {s.answered} | {_f(s.p50_ms)} | {_f(s.p99_ms)} "
            f"| {_f(s.max_ms)} |"
        )
    out.append(
        f"| last / first | | | {_ratio(last.p50_ms, first.p50_ms)} "
        f"| {_ratio(last.p99_ms, first.p99_ms)} | |"
    )
    out += [
        "",
        f"Publishes left at worst {d.max_lag_ms:.1f} ms behind their schedule.",
        "",
        "### Memory of every process (RSS, MiB)",
        "",
        f"Sampled every {report.sample_every_s:g} s ({len(report.samples)} samples). "
        f"Warm-up end: when the first {size} calls were due "
        f"({warm_up_end_s(report.calls, report.rate):.0f} s). Slope: least squares over "
        f"the second half of the run; flat when the growth it gives over that half is at "
        f"most max({FLAT_MIB:g} MiB, {FLAT_FRACTION:.0%} of the RSS at warm-up end). "
        "CPU: from the first call to the consumers caught up.",
        "",
        "| process | warm-up end | end | slope MiB/min | second-half growth | flat | cpu ms/call |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for row in memory:
        cpu = report.cpu_s.get(row.name)
        label = f"{row.name} (this bench)" if row.name == CLIENT else row.name
        out.append(
            f"| {label} | {row.warm_mb:.1f} | {row.end_mb:.1f} | {row.slope_mb_per_min:+.2f} "
            f"| {row.half_growth_mb:+.1f} | {'yes' if row.flat else 'no'} "
            f"| {_f(None if cpu is None else cpu * 1000 / report.calls)} |"
        )
    out += [
        "",
        "### nats-server's memory over time",
        "",
        "| s | calls answered | nats-server MiB | messages stored | not yet acked |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for taken in over_time(report.samples):
        out.append(
            f"| {taken.t:.1f} | {taken.answered} | {_f(taken.rss_mb.get('nats-server'), 1)} "
            f"| {'-' if taken.stored is None else taken.stored} "
            f"| {'-' if taken.pending is None else taken.pending} |"
        )
    if nats_points:
        second = [(t, v) for t, v in nats_points if t >= nats_points[-1][0] / 2]
        per_call = _per_calls(report.samples, "nats-server")
        out += [
            "",
            (
                f"Levels off at {levelled[1]:.1f} MiB from {levelled[0]:.0f} s."
                if levelled is not None
                else "Still rising at the end."
            )
            + f" Over the second half: {slope_per_s(second) * 60:+.2f} MiB/min"
            + (f", {per_call:+.2f} MiB per 10,000 calls" if per_call is not None else "")
            + "."
            + (
                f" The streams stored {stored:.1f} more messages per call answered "
                "(kept for their retention)."
                if (stored := stored_per_call(report.samples)) is not None
                else ""
            ),
        ]
    out += [
        "",
        "### Streams at the end",
        "",
        "| stream | messages | MiB |",
        "| --- | ---: | ---: |",
    ]
    for st in report.streams_at_end:
        out.append(f"| {st.stream} | {st.messages} | {st.bytes / 1024 / 1024:.1f} |")
    caught = (
        f"after {report.caught_up_after_s:.1f} s"
        if report.caught_up_after_s is not None
        else f"not within {DRAIN_TIMEOUT_S:.0f} s"
    )
    out += [
        "",
        "### Consumers",
        "",
        "When the calls had ended (each answered, or given up after "
        f"{RESULT_TIMEOUT_S:.0f} s), and after the gateway's consumers had caught up ({caught}).",
        "",
        "| stream | consumer | pending | ack pending | pending after | ack pending after |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    after = {(c.stream, c.consumer): c for c in report.consumers_after}
    for c in report.consumers_at_end:
        a = after.get((c.stream, c.consumer))
        out.append(
            f"| {c.stream} | {c.consumer} | {c.pending} | {c.ack_pending} "
            f"| {'-' if a is None else a.pending} | {'-' if a is None else a.ack_pending} |"
        )
    out += ["", "### Errors", ""]
    problems = [
        ("not ok (the result said so)", d.not_ok),
        (f"lost (no result within {RESULT_TIMEOUT_S:.0f} s)", d.lost),
        *((f"raised {name}", count) for name, count in sorted(d.errors.items())),
        *((f"sampler: {name}", count) for name, count in sorted(report.sampler_errors.items())),
    ]
    problems = [(what, count) for what, count in problems if count]
    if problems:
        out += ["| what | calls |", "| --- | ---: |"]
        out += [f"| {what} | {count} |" for what, count in problems]
    else:
        out.append("None.")
    return "\n".join(out) + "\n"


def _per_calls(samples: Sequence[Sample], name: str) -> float | None:
    """MiB per 10,000 calls answered over the second half (None: no calls in it)."""
    if not samples:
        return None
    second = [s for s in samples if s.t >= samples[-1].t / 2 and name in s.rss_mb]
    if len(second) < 2 or second[-1].answered == second[0].answered:
        return None
    slope = slope_per_s([(float(s.answered), s.rss_mb[name]) for s in second])
    return slope * 10_000


def stored_per_call(samples: Sequence[Sample]) -> float | None:
    """Messages the streams gained per call answered, from the first sample to the last."""
    known = [s for s in samples if s.stored is not None]
    if len(known) < 2 or known[-1].answered == known[0].answered:
        return None
    assert known[-1].stored is not None and known[0].stored is not None
    return (known[-1].stored - known[0].stored) / (known[-1].answered - known[0].answered)


# ---------------------------------------------------------------- the run (I/O)


@dataclass
class _Answered:
    count: int = 0


async def drive(
    driver: PlainClient,
    prefix: str,
    calls: int,
    rate: float,
    progress: Progress,
    answered: _Answered,
) -> Driven:
    """`calls` calls on a fixed schedule at `rate`; each latency from its due time.

    Done calls are dropped as they end (a long soak keeps no task per call).
    """
    in_order = array("d", [math.nan]) * calls
    driven = Driven(in_order, 0.0)
    running: set[asyncio.Task[None]] = set()
    interval = 1.0 / rate
    start = time.perf_counter() + 0.01
    last_result = start

    async def one(i: int, due: float) -> None:
        nonlocal last_result
        try:
            await driver.call(f"{prefix}-{i}")
        except TimeoutError:
            driven.lost += 1
            return
        except Exception as exc:  # counted and reported: a soak goes on
            driven.errors[type(exc).__name__] += 1
            return
        now = time.perf_counter()
        in_order[i] = (now - due) * 1000
        last_result = max(last_result, now)
        answered.count += 1
        progress.done += 1

    failures_before = driver.failures
    progress.start(f"soak: {calls} calls at {rate:.0f} calls/s", calls)
    for i in range(calls):
        due = start + i * interval
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        driven.max_lag_ms = max(driven.max_lag_ms, (time.perf_counter() - due) * 1000)
        task = asyncio.create_task(one(i, due))
        running.add(task)
        task.add_done_callback(running.discard)
    if running:
        await asyncio.gather(*running)
    progress.stop()
    driven.seconds = last_result - start
    driven.not_ok = driver.failures - failures_before
    driven.ok = answered.count - driven.not_ok
    return driven


async def consumers(js: JetStreamContext) -> list[ConsumerLag]:
    found = []
    for stream in sorted(info.config.name or "" for info in await js.streams_info()):
        for c in await js.consumers_info(stream):
            found.append(ConsumerLag(stream, c.name, c.num_pending or 0, c.num_ack_pending or 0))
    return sorted(found, key=lambda c: (c.stream, c.consumer))


async def streams(js: JetStreamContext) -> list[StreamHeld]:
    return sorted(
        (
            StreamHeld(info.config.name or "", info.state.messages, info.state.bytes)
            for info in await js.streams_info()
        ),
        key=lambda s: s.stream,
    )


async def measure(
    target: Target,
    calls: int,
    rate: float | None,
    burst: int,
    run: str,
    load: LoadAverage | None,
) -> SoakReport:
    progress = Progress()
    admin = await _admin(target)
    js = admin.jetstream() if admin is not None else None
    gate = Gate(js, [subjects.CALLS_STREAM, subjects.EVENTS_STREAM], target.processes)
    try:
        say("waiting for one call to go through")
        await _wait_for_pipeline(target.nats_url, target.agent_creds)
        await gate.drain()
        await gate.quiet(STARTUP_QUIET_TIMEOUT_S)
        gc.collect()
        gc.freeze()  # as the pipeline bench: a collection over the stack's imports is not a call's
        driver = await PlainClient.connect(target.nats_url, target.agent_creds, target.principal)
        try:
            if rate is None:
                closed = await closed_loop(
                    driver, target.processes, gate, f"s{run}-max", 0, burst, progress
                )
                rate = closed.burst_calls_per_s * RATE_FRACTION
                how = (
                    f"{RATE_FRACTION:.0%} of {closed.burst_calls_per_s:.0f} calls/s, "
                    f"a burst of {burst} calls measured first"
                )
                say(f"max burst {closed.burst_calls_per_s:.0f} calls/s; soak at {rate:.0f} calls/s")
            else:
                how = "the rate given"
                await warm_up(driver, f"s{run}", progress)
                await gate.drain()
                await gate.quiet()
            return await _soak(target, driver, js, gate, calls, rate, how, run, load, progress)
        finally:
            await driver.close()
    finally:
        await progress.close()
        if admin is not None:
            await admin.close()


async def _soak(
    target: Target,
    driver: PlainClient,
    js: JetStreamContext | None,
    gate: Gate,
    calls: int,
    rate: float,
    how: str,
    run: str,
    load: LoadAverage | None,
    progress: Progress,
) -> SoakReport:
    every = max(MIN_SAMPLE_EVERY_S, min(SAMPLE_EVERY_S, calls / rate / SAMPLES_AT_LEAST))
    samples: list[Sample] = []
    sampler_errors: Counter[str] = Counter()
    answered = _Answered()
    started = time.perf_counter()

    async def sample() -> Sample:
        taken = Sample(time.perf_counter() - started, answered.count, target.processes.rss_mb())
        if js is not None:
            try:
                taken.pending = sum(c.pending + c.ack_pending for c in await consumers(js))
                taken.stored = sum(s.messages for s in await streams(js))
            except Exception as exc:  # one missed reading is not a failed soak
                sampler_errors[type(exc).__name__] += 1
        samples.append(taken)
        return taken

    calls_ended = asyncio.Event()

    async def sampling() -> None:
        # Ends between two samples, never inside one: a reading cancelled half-way
        # would count as a sampler error of a soak that had none.
        while not calls_ended.is_set():
            await sample()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(calls_ended.wait(), every)

    before = target.processes.snapshot()
    sampler = asyncio.create_task(sampling())
    try:
        driven = await drive(driver, f"s{run}-soak", calls, rate, progress, answered)
    finally:
        calls_ended.set()
        await sampler
    await sample()  # the calls have ended: each answered or given up
    at_end = await consumers(js) if js is not None else []
    caught_up_at = time.perf_counter()
    await gate.drain()
    caught_up: float | None = time.perf_counter() - caught_up_at
    after = await consumers(js) if js is not None else []
    if js is None or await gate.pending() > 0:
        caught_up = None
    cpu = procs.delta(before, target.processes.snapshot())
    return SoakReport(
        calls=calls,
        rate=rate,
        rate_how=how,
        target=target.description,
        load_at_start=load,
        driven=driven,
        samples=samples,
        sample_every_s=every,
        consumers_at_end=at_end,
        caught_up_after_s=caught_up,
        consumers_after=after,
        streams_at_end=await streams(js) if js is not None else [],
        cpu_s=cpu,
        sampler_errors=sampler_errors,
    )


# ---------------------------------------------------------------- the command


def _calls_of(args: argparse.Namespace) -> int:
    if getattr(args, "soak", None) is not None:
        return int(args.soak)
    return DEFAULT_CALLS if args.calls is None else int(args.calls)


def cmd_bench_soak(args: argparse.Namespace, reachable: Callable[[], None] = lambda: None) -> int:
    """The command; `reachable()` checks a running gateway (--nats-url) after the input."""
    calls = _calls_of(args)
    if calls < 1 or (args.rate is not None and args.rate <= 0) or args.burst < 1:
        print(
            "toolgate bench soak: -n (--soak), --rate and --burst must be positive",
            file=sys.stderr,
        )
        return 2
    if args.curve:
        print("toolgate bench soak: a soak holds one rate, not --curve", file=sys.stderr)
        return 2
    if args.nats_url is not None:
        reachable()
    load = load_average()
    if load is not None and load[0] > LOAD_WARN:
        print(
            f"toolgate bench soak: warning: load average {load[0]:.2f} at the start "
            f"(above {LOAD_WARN}): the figures will be of a busy machine",
            file=sys.stderr,
        )
    run = str(int(time.time()))
    with (
        tempfile.TemporaryDirectory(prefix="toolgate-soak-") as tmp,
        gateway_target(args, Path(tmp), running=f"a running gateway at {args.nats_url}") as target,
    ):
        report = asyncio.run(measure(target, calls, args.rate, args.burst, run, load))
    markdown = render(report)
    print(markdown, end="", flush=True)
    args.results_markdown = markdown  # what --save writes (toolgate.bench.results.saving)
    return 0
