"""`toolgate bench`: what an agent platform sees, next to what the bus itself gives.

In one run, against one gateway (a private one started as `toolgate up`
starts it: locked bus, audit on; or a running one with `--nats-url`):

- `client (nats-py)`: a plain nats-py agent outside the gateway's processes,
  with its own agent creds, on the v2 wire contract (toolgate.bench.drivers);
- `GatewayClient`: the same calls through toolgate's Python client;
- `floor (raw, 4 hops)`: four pass-through JetStream hops in one process,
  plain nats-py (toolgate.bench.floor), driven by the same client loop.

Each is measured one call at a time (p50, p99) and with a burst published at
once (calls/s); with each window the CPU milliseconds per call of every
process (each service, nats-server, ClickHouse, the floor's hops, this
client) are read from /proc. `--rate R --duration S` holds a fixed arrival
rate instead (open loop); `--curve` measures the burst throughput and then
holds 25, 50, 75 and 90 % of it. A soak (many calls at one rate, memory
and backlog over time) is `toolgate bench soak` (toolgate.bench.soak).

Progress goes to stderr; the figures to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from toolgate.bench import floor, procs
from toolgate.bench.drivers import (
    RESULT_TIMEOUT_S,
    Driver,
    FloorClient,
    GatewayDriver,
    PlainClient,
)
from toolgate.bench.loops import (
    Closed,
    Open,
    Progress,
    Window,
    closed_loop,
    combine,
    open_loop,
    say,
)
from toolgate.bench.targets import Target, gateway_target, principal_for
from toolgate.contracts import subjects
from toolgate.runtime.creds import connect_options, identity_of_creds
from toolgate.stack.processes import die_with_parent
from toolgate.stack.services import AUDIT, PIPELINE

# The services one call passes through: validator, policy, executor, attacher.
HOPS = floor.HOPS
CURVE_FRACTIONS = (0.25, 0.50, 0.75, 0.90)
KIND_NAMES = {"plain": PlainClient.name, "gateway": GatewayDriver.name, "floor": FloorClient.name}
# The gateway is quiet when its processes use less than this many cores together.
QUIET_CORES = 0.15
QUIET_SAMPLE_S = 0.3
DRAIN_TIMEOUT_S = 120.0
QUIET_TIMEOUT_S = 30.0
STARTUP_QUIET_TIMEOUT_S = 60.0
# Rows of the CPU table, in this order; others (if any) follow.
PROCESS_ORDER = (*PIPELINE, AUDIT, "nats-server", "clickhouse", "floor hops", "client")


# ---------------------------------------------------------------- waiting for quiet


class Gate:
    """Drained: every consumer of `streams` caught up. Quiet: the watched processes idle."""

    def __init__(
        self,
        js: JetStreamContext | None,
        streams: Sequence[str],
        processes: procs.Processes,
        quiet_timeout_s: float = QUIET_TIMEOUT_S,
    ) -> None:
        self.js, self.streams, self.processes = js, list(streams), processes
        self.quiet_timeout_s = quiet_timeout_s

    async def pending(self) -> int:
        assert self.js is not None
        total = 0
        for stream in self.streams:
            for info in await self.js.consumers_info(stream):
                total += (info.num_pending or 0) + (info.num_ack_pending or 0)
        return total

    async def drain(self) -> None:
        if self.js is None:  # no operator creds: nothing to ask; quiet() has to do
            return
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while (left := await self.pending()) > 0:
            if time.monotonic() > deadline:
                say(f"{left} messages still pending after {DRAIN_TIMEOUT_S:.0f} s; going on")
                return
            await asyncio.sleep(0.05)

    async def quiet(self, timeout_s: float | None = None) -> None:
        watched = procs.Processes(
            {name: pid for name, pid in self.processes.pids.items() if name != "client"},
            set(self.processes.alone),
        )
        if not watched.pids or not procs.available():
            await asyncio.sleep(1.0)
            return
        deadline = time.monotonic() + (timeout_s or self.quiet_timeout_s)
        while True:
            before, started = watched.snapshot(), time.perf_counter()
            await asyncio.sleep(QUIET_SAMPLE_S)
            used = procs.delta(before, watched.snapshot())
            cores = sum(used.values()) / (time.perf_counter() - started)
            if cores < QUIET_CORES:
                return
            if time.monotonic() > deadline:
                busiest = max(used, key=lambda name: used[name])
                say(
                    f"not quiet after {timeout_s or self.quiet_timeout_s:.0f} s "
                    f"({cores:.2f} cores busy, most in {busiest}); going on"
                )
                return


# ---------------------------------------------------------------- the runs


async def _admin(target: Target) -> Client | None:
    """A connection as the operator, for consumer info and the floor; None if refused."""
    if target.admin_creds is not None and identity_of_creds(target.admin_creds) is not None:
        return None  # an agent's creds: they may not
    try:
        return await nats.connect(
            target.nats_url,
            connect_timeout=5,
            max_reconnect_attempts=0,
            **connect_options(target.admin_creds),
        )
    except Exception as exc:
        say(f"no operator connection ({exc!r}): no drain checks, no floor")
        return None


def _start_hops(target: Target, log: Path) -> subprocess.Popen[bytes]:
    flags = ["--creds", str(target.admin_creds)] if target.admin_creds else []
    with open(log, "wb") as err:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolgate.bench.floor",
                "--nats-url",
                target.nats_url,
                "--hops",
                str(HOPS),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            preexec_fn=die_with_parent,
        )


async def _run_floor(
    target: Target,
    admin: Client,
    progress: Progress,
    prefix: str,
    calls: int,
    burst: int,
    tmp: Path,
) -> Closed:
    js = admin.jetstream()
    await floor.reset_stream(js)
    log = tmp / "floor-hops.log"
    hops = _start_hops(target, log)
    try:
        assert hops.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(hops.stdout.readline), 30)
        if line.strip() != b"ready":
            raise RuntimeError(f"the floor's hops did not start: {log.read_text()[-2000:]}")
        target.processes.add("floor hops", hops.pid)
        gate = Gate(js, [floor.STREAM], target.processes)
        client = await FloorClient.connect(target.nats_url, target.admin_creds, target.principal)
        try:
            return await closed_loop(client, target.processes, gate, prefix, calls, burst, progress)
        finally:
            await client.close()
    finally:
        hops.terminate()
        hops.wait()
        target.processes.remove("floor hops")
        await floor.delete_stream(js)


async def _driver(kind: str, target: Target) -> Driver:
    if kind == "gateway":
        return await GatewayDriver.connect(target.nats_url, target.agent_creds, target.principal)
    return await PlainClient.connect(target.nats_url, target.agent_creds, target.principal)


async def _wait_for_pipeline(nats_url: str, creds: Path | None, timeout: float = 60.0) -> None:
    """Wait until one call goes through: every service on its path is up."""
    from toolgate.client.gateway_client import GatewayClient

    deadline = time.monotonic() + timeout
    principal = principal_for(creds)
    async with await GatewayClient.connect(
        nats_url, creds, identity=(principal.tenant, principal.agent)
    ) as client:
        while True:
            try:
                await client.call("echo", {}, principal=principal, timeout=5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


async def _measure(
    target: Target, args: argparse.Namespace, run: str, tmp: Path
) -> list[Closed | Open | str]:
    """Everything the arguments ask for; returns what to print (figures, or a note)."""
    progress = Progress()
    admin = await _admin(target)
    gate = Gate(
        admin.jetstream() if admin else None,
        [subjects.CALLS_STREAM, subjects.EVENTS_STREAM],
        target.processes,
    )
    out: list[Closed | Open | str] = []
    try:
        started = time.monotonic()
        say("waiting for one call to go through")
        await _wait_for_pipeline(target.nats_url, target.agent_creds)
        say(
            f"a call went through after {time.monotonic() - started:.1f} s; "
            "waiting for the gateway to go quiet (ClickHouse, audit, first calls)"
        )
        settling = time.monotonic()
        await gate.drain()
        await gate.quiet(STARTUP_QUIET_TIMEOUT_S)
        say(f"quiet after {time.monotonic() - settling:.1f} s more; measuring")
        # This process holds the stack's imports (FastStream, ClickHouse, ...): a full
        # collection over them took 60-400 ms and landed in whichever client's window
        # crossed the threshold (its CPU and its burst). Frozen, a collection sees only
        # what the clients allocate.
        gc.collect()
        gc.freeze()
        if args.curve or args.rate:
            out += await _open_modes(target, args, run, gate, progress)
            return out
        kinds = ["plain", "gateway"] + (["floor"] if admin is not None else [])
        if admin is None:
            out.append("floor: skipped (needs the operator's creds: --creds)")
        rounds: dict[str, list[Closed]] = {kind: [] for kind in kinds}
        for index in range(args.rounds):
            # Every other round in reverse order, so drift on a shared machine evens out.
            for kind in kinds if index % 2 == 0 else kinds[::-1]:
                if args.rounds > 1:
                    say(f"round {index + 1} of {args.rounds}: {KIND_NAMES[kind]}")
                prefix = f"b{run}-{kind}{index}"
                if kind == "floor":
                    assert admin is not None
                    rounds[kind].append(
                        await _run_floor(
                            target, admin, progress, prefix, args.calls, args.burst, tmp
                        )
                    )
                else:
                    driver = await _driver(kind, target)
                    try:
                        rounds[kind].append(
                            await closed_loop(
                                driver,
                                target.processes,
                                gate,
                                prefix,
                                args.calls,
                                args.burst,
                                progress,
                            )
                        )
                    finally:
                        await driver.close()
                done = rounds[kind][-1]
                say(
                    f"{done.name}: p50 {done.p50_ms:.2f} ms, p99 {done.p99_ms:.2f} ms, "
                    f"burst {done.burst_calls_per_s:.0f} calls/s"
                )
        out += [combine(rounds[kind]) for kind in kinds]
        return out
    finally:
        await progress.close()
        if admin is not None:
            await admin.close()


async def _open_modes(
    target: Target, args: argparse.Namespace, run: str, gate: Gate, progress: Progress
) -> list[Closed | Open | str]:
    out: list[Closed | Open | str] = []
    driver = await _driver("plain", target)
    try:
        if args.rate:
            out.append(
                await open_loop(
                    driver,
                    target.processes,
                    gate,
                    f"b{run}-rate",
                    args.rate,
                    args.duration,
                    progress,
                )
            )
            return out
        # The curve: the most the gateway takes in a burst, then fractions of it.
        closed = await closed_loop(
            driver, target.processes, gate, f"b{run}-max", 0, args.burst, progress
        )
        say(f"max burst {closed.burst_calls_per_s:.0f} calls/s")
        out.append(closed)
        for fraction in CURVE_FRACTIONS:
            rate = closed.burst_calls_per_s * fraction
            point = await open_loop(
                driver,
                target.processes,
                gate,
                f"b{run}-curve{round(fraction * 100)}",
                rate,
                args.duration,
                progress,
                warm=False,
            )
            point.extra["fraction"] = fraction
            say(
                f"{fraction:.0%} ({rate:.0f} calls/s): p50 {point.p(0.5):.2f} ms, "
                f"p99 {point.p(0.99):.2f} ms, {point.done_per_s:.0f} calls/s done"
            )
            out.append(point)
        return out
    finally:
        await driver.close()


# ---------------------------------------------------------------- printing


def _ms(value: float | None, width: int = 7) -> str:
    if value is None or math.isnan(value):
        return f"{'-':>{width}}"
    return f"{value:{width}.2f}"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:6.2f}x" if b and not math.isnan(a) and not math.isnan(b) else "     -"


def _process_names(windows: Sequence[Window]) -> list[str]:
    present = {name for window in windows for name in window.cpu_s}
    return [n for n in PROCESS_ORDER if n in present] + sorted(present - set(PROCESS_ORDER))


def _cpu_table(groups: Sequence[tuple[str, Sequence[tuple[str, Window]]]]) -> list[str]:
    """CPU ms per call of every process, one column per measured window, grouped."""
    columns = [column for _, group in groups for column in group]
    names = _process_names([window for _, window in columns])
    width = 9
    lines = [
        "cpu ms/call  " + "".join(f"{title:^{width * len(group)}}" for title, group in groups),
        " " * 13 + "".join(f"{title:>{width}}" for title, _ in columns),
    ]
    for name in names:
        lines.append(
            f"  {name:<11}"
            + "".join(_ms(window.cpu_ms_per_call(name), width) for _, window in columns)
        )
    lines.append(
        "  total      "
        + "".join(f"{window.total_cpu_ms_per_call:{width}.2f}" for _, window in columns)
    )
    lines.append("  cores busy " + "".join(f"{window.cores:{width}.2f}" for _, window in columns))
    return lines


def _print_closed(results: Sequence[Closed], notes: Sequence[str]) -> None:
    print(f"{'':<22}{'p50 ms':>9}{'p99 ms':>9}{'burst calls/s':>15}")
    for r in results:
        spread = ""
        if r.rounds:
            lo, hi = (
                (min(x) for x in zip(*r.rounds, strict=True)),
                (max(x) for x in zip(*r.rounds, strict=True)),
            )
            spread = "   rounds: " + "  ".join(
                f"{a:.{d}f}-{b:.{d}f}" for a, b, d in zip(lo, hi, (2, 2, 0), strict=True)
            )
        print(
            f"{r.name:<22}{_ms(r.p50_ms, 9)}{_ms(r.p99_ms, 9)}{r.burst_calls_per_s:15.0f}" + spread
        )
    by_name = {r.name: r for r in results}
    plain, gateway = by_name.get(PlainClient.name), by_name.get(GatewayDriver.name)
    base = by_name.get(FloorClient.name)
    pairs = [
        (plain, base, "client / floor"),
        (gateway, base, "GatewayClient / floor"),
        (gateway, plain, "GatewayClient / client"),
    ]
    for a, b, label in pairs:
        if a is not None and b is not None:
            print(
                f"{label:<22}{_ratio(a.p50_ms, b.p50_ms):>9}{_ratio(a.p99_ms, b.p99_ms):>9}"
                f"{_ratio(a.burst_calls_per_s, b.burst_calls_per_s):>15}"
            )
    for note in notes:
        print(note)
    failed = [r for r in results if r.failures]
    for r in failed:
        print(f"warning: {r.failures} calls of {r.name} did not end ok (denied? rate limited?)")
    short = {
        PlainClient.name: "client",
        GatewayDriver.name: "GatewayClient",
        FloorClient.name: "floor",
    }
    groups = [
        (short.get(r.name, r.name), [("seq", r.sequential), ("burst", r.burst)]) for r in results
    ]
    print()
    for line in _cpu_table(groups):
        print(line)
    print(
        "(seq: the sequential calls; burst: from its first publish until every consumer, "
        "the audit's too, has caught up)"
    )


def _print_open(point: Open) -> None:
    print(
        f"open loop     {point.rate:.0f} calls/s for {point.duration_s:g} s "
        f"({point.sent} calls, {point.name})"
    )
    print(
        f"latency ms    p50 {_ms(point.p(0.50))}  p90 {_ms(point.p(0.90))}  "
        f"p99 {_ms(point.p(0.99))}  max {_ms(point.p(1.0))}"
    )
    print(
        f"throughput    {point.done_per_s:.0f} calls/s done; {point.lost} lost "
        f"(no publish ack or no result within {RESULT_TIMEOUT_S:.0f} s); "
        f"last publish {point.send_lag_ms:.1f} ms behind its schedule"
    )
    if point.failures:
        print(f"warning: {point.failures} calls did not end ok")
    print()
    for line in _cpu_table([("open loop", [(f"{point.rate:.0f}/s", point.window)])]):
        print(line)


def _print_curve(closed: Closed, points: Sequence[Open]) -> None:
    duration = points[0].duration_s if points else 0
    print(
        f"curve         max burst {closed.burst_calls_per_s:.0f} calls/s "
        f"({closed.burst.calls} calls at once); open loop {duration:g} s per point"
    )
    print(
        f"{'load':>6}{'rate/s':>9}{'done/s':>9}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}"
        f"{'max ms':>9}{'cpu ms/call':>13}{'cores':>7}{'lost':>6}"
    )
    for p in points:
        print(
            f"{p.extra.get('fraction', 0) * 100:5.0f}%{p.rate:9.0f}{p.done_per_s:9.0f}"
            f"{_ms(p.p(0.5), 9)}{_ms(p.p(0.9), 9)}{_ms(p.p(0.99), 9)}{_ms(p.p(1.0), 9)}"
            f"{p.window.total_cpu_ms_per_call:13.2f}{p.window.cores:7.2f}{p.lost:6d}"
        )
    print()
    groups = [
        ("max", [("burst", closed.burst)]),
        ("open loop", [(f"{p.extra.get('fraction', 0) * 100:.0f}%", p.window) for p in points]),
    ]
    for line in _cpu_table(groups):
        print(line)


def _print(results: Sequence[Closed | Open | str]) -> None:
    closed = [r for r in results if isinstance(r, Closed)]
    opened = [r for r in results if isinstance(r, Open)]
    notes = [r for r in results if isinstance(r, str)]
    if opened and closed:
        _print_curve(closed[0], opened)
    elif opened:
        _print_open(opened[0])
    else:
        _print_closed(closed, notes)


# ---------------------------------------------------------------- the command


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load unknown"
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min)"


def _header(args: argparse.Namespace, target: Target) -> str:
    if args.rate:
        what = f"open loop at {args.rate:g} calls/s for {args.duration:g} s"
    elif args.curve:
        what = (
            f"curve: a burst of {args.burst}, then {len(CURVE_FRACTIONS)} open-loop "
            f"points of {args.duration:g} s"
        )
    else:
        what = f"{args.calls} sequential calls, burst of {args.burst}"
    principal = target.principal
    return (
        f"toolgate bench: {what}, tool 'echo', as agent "
        f"{principal.tenant}.{principal.agent}; {target.description}; "
        f"NATS {target.nats_url}; {os.cpu_count()} CPUs, {_load()}"
    )


def run_bench(args: argparse.Namespace) -> int:
    run = str(int(time.time()))
    with (
        tempfile.TemporaryDirectory(prefix="toolgate-bench-") as tmp,
        gateway_target(args, Path(tmp), say_started=True) as target,
    ):
        results = _run(args, target, run, Path(tmp))
    _print(results)
    print(f"(after: {_load()})")
    return 0


def _run(
    args: argparse.Namespace, target: Target, run: str, tmp: Path
) -> list[Closed | Open | str]:
    print(_header(args, target), flush=True)
    found = [name for name in target.processes.pids if name != "client"]
    if not found:
        say("no gateway processes found on this machine: CPU only for this client")
    return asyncio.run(_measure(target, args, run, tmp))
