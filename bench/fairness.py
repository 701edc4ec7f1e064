"""`toolgate bench fairness`: one agent's latency while another agent bursts.

Against a private gateway started as `toolgate up` starts it (locked bus, audit
on), two agents of two tenants, each with its own creds (a plain nats-py client
each, as in `toolgate bench`):

1. agent A alone: a burst of `--burst` calls at once (its calls/s: what the gate
   costs an agent that has the gateway to itself);
2. agent B alone: `-n` calls one at a time (p50, p99, max);
3. agent A publishes `--burst` calls at once and waits for all their results;
   while they run, B makes calls one at a time, until A's last result is in.

Printed: B's latency alone and during A's burst, how long A's burst took, and
how many of A's calls were still running when each of B's calls ended (B's call
overtook them: with first-in-first-out stages that number is 0).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from toolgate.bench.drivers import PlainClient
from toolgate.bench.loops import percentile, say
from toolgate.contracts.calls import Principal
from toolgate.stack.nats_auth import add_agent, push_account_jwts
from toolgate.stack.supervisor import Stack

A = Principal(tenant="bench-a", user="u-a", agent="burster", session="s-a")
B = Principal(tenant="bench-b", user="u-b", agent="steady", session="s-b")
WARM_UP_CALLS = 20


@dataclass
class Figures:
    alone_ms: list[float]
    during_ms: list[float]
    burst_calls: int
    burst_s: float
    alone_burst_s: float
    # For each of B's calls during the burst: A's calls not yet done when it ended.
    overtaken: list[int]
    failures: int


def _line(label: str, values: list[float]) -> str:
    done = sorted(values)
    p50, p99, top = (percentile(done, f) for f in (0.5, 0.99, 1.0))
    return f"  {label:<22}{len(done):6d}{p50:10.1f}{p99:10.1f}{top:10.1f}"


async def _measure(url: str, a_creds: Path, b_creds: Path, calls: int, burst: int) -> Figures:
    a = await PlainClient.connect(url, a_creds, A)
    b = await PlainClient.connect(url, b_creds, B)
    run = str(int(time.time()))
    try:
        say("warming up both agents")
        for i in range(WARM_UP_CALLS):
            await a.call(f"f{run}-a-warm-{i}")
            await b.call(f"f{run}-b-warm-{i}")
        await asyncio.sleep(1.0)
        say(f"agent A alone: a burst of {burst} calls")
        t0 = time.perf_counter()
        await asyncio.gather(*(a.call(f"f{run}-a-alone-{i}") for i in range(burst)))
        alone_burst_s = time.perf_counter() - t0
        await asyncio.sleep(2.0)
        say(f"agent B alone: {calls} calls one at a time")
        alone = []
        for i in range(calls):
            t0 = time.perf_counter()
            await b.call(f"f{run}-b-alone-{i}")
            alone.append((time.perf_counter() - t0) * 1000)
        await asyncio.sleep(1.0)
        say(f"agent A: a burst of {burst} calls; agent B: one call at a time meanwhile")
        left = burst

        async def one(i: int) -> None:
            nonlocal left
            try:
                await a.call(f"f{run}-a-burst-{i}")
            finally:
                left -= 1

        started = time.perf_counter()
        flood = asyncio.gather(*(one(i) for i in range(burst)))
        during, overtaken = [], []
        i = 0
        await asyncio.sleep(0.05)  # A's publishes are on their way first
        while True:  # at least one call, however short the burst
            t0 = time.perf_counter()
            await b.call(f"f{run}-b-during-{i}")
            during.append((time.perf_counter() - t0) * 1000)
            overtaken.append(left)
            i += 1
            if left <= 0:
                break
        await flood
        elapsed = time.perf_counter() - started
        return Figures(
            alone, during, burst, elapsed, alone_burst_s, overtaken, a.failures + b.failures
        )
    finally:
        await a.close()
        await b.close()


def print_figures(fig: Figures) -> None:
    print(f"{'agent B latency ms':<24}{'calls':>6}{'p50':>10}{'p99':>10}{'max':>10}")
    print(_line("alone", fig.alone_ms))
    print(_line("during A's burst", fig.during_ms))
    rate = fig.burst_calls / fig.burst_s if fig.burst_s else 0.0
    alone = fig.burst_calls / fig.alone_burst_s if fig.alone_burst_s else 0.0
    print(
        f"agent A's burst alone  {fig.burst_calls} calls in {fig.alone_burst_s:.2f} s "
        f"({alone:.0f} calls/s)"
    )
    print(
        f"agent A's burst with B {fig.burst_calls} calls in {fig.burst_s:.2f} s "
        f"({rate:.0f} calls/s)"
    )
    if fig.overtaken:
        print(
            f"A's calls still running as each B call ended: min {min(fig.overtaken)}, "
            f"median {sorted(fig.overtaken)[len(fig.overtaken) // 2]}, "
            f"first {fig.overtaken[0]}"
        )
    if fig.failures:
        print(f"warning: {fig.failures} calls did not end ok")


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "load unknown"
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min)"


def run_fairness(args: argparse.Namespace) -> int:
    """`toolgate bench fairness`: a private gateway, two agents, figures on stdout."""
    with tempfile.TemporaryDirectory(prefix="toolgate-fairness-") as tmp:
        say("starting a private gateway as `toolgate up` runs it (locked bus, audit on)")
        stack = Stack(data_dir=Path(tmp) / "gateway", executor_args=["--concurrency", "8"])
        try:
            stack.start()
            creds: dict[str, Path] = {}
            tokens: list[str] = []
            for who in (A, B):
                creds[who.agent], token = add_agent(stack.data_dir, who.tenant, who.agent)
                tokens.append(token)
            asyncio.run(push_account_jwts(stack.url, stack.data_dir, tokens))
            print(
                f"toolgate bench fairness: agent {B.tenant}.{B.agent}, {args.calls} calls "
                f"alone, then one at a time during agent {A.tenant}.{A.agent}'s burst of "
                f"{args.burst}; tool 'echo'; a private gateway (locked bus, audit on); "
                f"{os.cpu_count()} CPUs, {_load()}",
                flush=True,
            )
            fig = asyncio.run(
                _measure(stack.url, creds[A.agent], creds[B.agent], args.calls, args.burst)
            )
        finally:
            stack.stop()
    print_figures(fig)
    print(f"(after: {_load()})")
    return 0
