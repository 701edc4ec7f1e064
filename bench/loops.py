"""The two ways the bench drives calls, with CPU accounted per process.

Closed loop: one call at a time (latency), then a burst published at once
(throughput). Open loop: calls published on a fixed schedule whatever
happens to earlier ones; a call's latency counts from the moment it was due,
so a client or gateway that falls behind shows it (no coordinated omission).

A measured window ends when the gateway has drained every consumer (the
audit's included: it acks after its rows are in ClickHouse); only then is
the window's CPU read, so a call's CPU is all of its cost. The next window
starts once the gateway is quiet again.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Protocol

from toolgate.bench.drivers import Driver
from toolgate.bench.procs import Processes, delta

WARM_UP_CALLS = 20
PROGRESS_EVERY_S = 2.0


class Gate(Protocol):
    async def drain(self) -> None:
        """Return when every consumer of the system measured has caught up."""

    async def quiet(self) -> None:
        """Return when the system measured is idle (or has been given its time)."""


def say(text: str) -> None:
    """A progress line: stderr, so stdout holds only the figures."""
    print(f"  .. {text}", file=sys.stderr, flush=True)


class Progress:
    """Prints `phase: done/total` every couple of seconds while a phase runs."""

    def __init__(self, every_s: float = PROGRESS_EVERY_S) -> None:
        self.every_s = every_s
        self.phase, self.total, self.done = "", 0, 0
        self._task: asyncio.Task[None] | None = None
        self._started = 0.0

    def start(self, phase: str, total: int) -> None:
        self.phase, self.total, self.done = phase, total, 0
        self._started = time.perf_counter()
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            if self.phase:
                elapsed = time.perf_counter() - self._started
                say(f"{self.phase}: {self.done}/{self.total} calls done, {elapsed:.0f} s")

    def stop(self) -> None:
        self.phase = ""

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(len(sorted_values) * fraction))]


@dataclass
class Window:
    """One measured window: calls done, wall time, CPU seconds per process."""

    calls: int
    seconds: float
    cpu_s: dict[str, float]

    def cpu_ms_per_call(self, name: str) -> float | None:
        if name not in self.cpu_s or not self.calls:
            return None
        return self.cpu_s[name] * 1000 / self.calls

    @property
    def total_cpu_ms_per_call(self) -> float:
        return sum(self.cpu_s.values()) * 1000 / max(1, self.calls)

    @property
    def cores(self) -> float:
        return sum(self.cpu_s.values()) / self.seconds if self.seconds else 0.0


@dataclass
class Closed:
    """Closed-loop figures of one client: latency one call at a time, a burst's throughput."""

    name: str
    p50_ms: float
    p99_ms: float
    burst_calls_per_s: float
    sequential: Window
    burst: Window
    failures: int = 0
    # (p50, p99, burst) of each round, when this is the median of several.
    rounds: list[tuple[float, float, float]] = field(default_factory=list)


def _sum_windows(windows: list[Window]) -> Window:
    names = {name for window in windows for name in window.cpu_s}
    return Window(
        sum(w.calls for w in windows),
        sum(w.seconds for w in windows),
        {name: sum(w.cpu_s.get(name, 0.0) for w in windows) for name in names},
    )


def combine(rounds: list[Closed]) -> Closed:
    """Several rounds of one client: median figures; CPU per call over all rounds."""
    if len(rounds) == 1:
        return rounds[0]
    return Closed(
        rounds[0].name,
        statistics.median(r.p50_ms for r in rounds),
        statistics.median(r.p99_ms for r in rounds),
        statistics.median(r.burst_calls_per_s for r in rounds),
        _sum_windows([r.sequential for r in rounds]),
        _sum_windows([r.burst for r in rounds]),
        failures=sum(r.failures for r in rounds),
        rounds=[(r.p50_ms, r.p99_ms, r.burst_calls_per_s) for r in rounds],
    )


@dataclass
class Open:
    name: str
    rate: float
    duration_s: float
    sent: int
    latencies_ms: list[float]
    window: Window
    lost: int = 0
    failures: int = 0
    # How late the last publish left against its schedule: the client keeping up?
    send_lag_ms: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)
    # Each call's latency in the order the calls were due (nan: lost), for a soak's slices.
    in_order_ms: list[float] = field(default_factory=list)

    @property
    def done_per_s(self) -> float:
        return len(self.latencies_ms) / self.window.seconds if self.window.seconds else 0.0

    def p(self, fraction: float) -> float:
        return percentile(self.latencies_ms, fraction)


async def warm_up(
    driver: Driver, prefix: str, progress: Progress, calls: int = WARM_UP_CALLS
) -> None:
    """Connections, consumers and caches warm: a few calls one by one."""
    progress.start(f"{driver.name}: warm-up", calls)
    for i in range(calls):
        await driver.call(f"{prefix}-warm-{i}")
        progress.done += 1
    progress.stop()


async def closed_loop(
    driver: Driver,
    processes: Processes,
    gate: Gate,
    prefix: str,
    calls: int,
    burst: int,
    progress: Progress,
) -> Closed:
    await warm_up(driver, prefix, progress)
    await gate.drain()
    await gate.quiet()
    failures_before = driver.failures

    progress.start(f"{driver.name}: {calls} sequential calls", calls)
    before, started = processes.snapshot(), time.perf_counter()
    latencies = []
    for i in range(calls):
        t0 = time.perf_counter()
        await driver.call(f"{prefix}-seq-{i}")
        latencies.append((time.perf_counter() - t0) * 1000)
        progress.done += 1
    progress.stop()
    await gate.drain()
    sequential = Window(calls, time.perf_counter() - started, delta(before, processes.snapshot()))
    await gate.quiet()

    progress.start(f"{driver.name}: burst of {burst} calls", burst)
    before, started = processes.snapshot(), time.perf_counter()

    async def one(i: int) -> None:
        await driver.call(f"{prefix}-burst-{i}")
        progress.done += 1

    await asyncio.gather(*(one(i) for i in range(burst)))
    elapsed = time.perf_counter() - started
    progress.stop()
    await gate.drain()  # the audit catches up: its CPU for this burst is in the window
    window = Window(burst, time.perf_counter() - started, delta(before, processes.snapshot()))
    await gate.quiet()
    latencies.sort()
    return Closed(
        driver.name,
        percentile(latencies, 0.50),
        percentile(latencies, 0.99),
        burst / elapsed,
        sequential,
        window,
        failures=driver.failures - failures_before,
    )


async def open_loop(
    driver: Driver,
    processes: Processes,
    gate: Gate,
    prefix: str,
    rate: float,
    duration_s: float,
    progress: Progress,
    warm: bool = True,
) -> Open:
    """Publish `rate` calls/s for `duration_s` on a fixed schedule; latency from the due time."""
    if warm:
        await warm_up(driver, prefix, progress)
    await gate.drain()
    await gate.quiet()
    failures_before = driver.failures
    total = max(1, round(rate * duration_s))
    interval = 1.0 / rate
    latencies: list[float] = []
    in_order = [math.nan] * total
    lost = 0

    async def one(i: int, due: float) -> None:
        nonlocal lost
        try:
            await driver.call(f"{prefix}-open-{i}")
        except TimeoutError:
            lost += 1
            return
        in_order[i] = (time.perf_counter() - due) * 1000
        latencies.append(in_order[i])
        progress.done += 1

    progress.start(f"{driver.name}: open loop at {rate:.0f} calls/s for {duration_s:g} s", total)
    before = processes.snapshot()
    start = time.perf_counter() + 0.01
    tasks = []
    lag = 0.0
    for i in range(total):
        due = start + i * interval
        wait = due - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        lag = max(0.0, time.perf_counter() - due)
        tasks.append(asyncio.create_task(one(i, due)))
    await asyncio.gather(*tasks)
    last_result = time.perf_counter()
    progress.stop()
    await gate.drain()
    window = Window(total, last_result - start, delta(before, processes.snapshot()))
    await gate.quiet()
    latencies.sort()
    return Open(
        driver.name,
        rate,
        duration_s,
        total,
        latencies,
        window,
        lost=lost,
        failures=driver.failures - failures_before,
        send_lag_ms=lag * 1000,
        in_order_ms=in_order,
    )
