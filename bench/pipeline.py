"""`toolgate bench`: the full pipeline against a pass-through floor, in one run.

Both sides are driven by the same client loop: publish with a publish ack,
receive on one wildcard subscription, match by call_id. Latency is measured
one call at a time (p50/p99); throughput with a burst published at once.
The floor has as many hops as the pipeline has services, each its own
process like the services, doing no work.

On a private gateway the pipeline's calls come from an agent's own identity
(its account imports its calls subject and its results, as on a real
gateway); against `--nats-url` they are published with the operator's
credentials as agent `bench` of tenant `bench`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nats
from nats.aio.client import Client

from toolgate.bench import floor
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.runtime.creds import connect_options, identity_of_creds
from toolgate.runtime.settings import env_nats_creds
from toolgate.stack.processes import die_with_parent
from toolgate.stack.supervisor import Stack

PRINCIPAL = Principal(tenant="bench", user="u-bench", agent="bench", session="s-bench")
# The services one call passes through: validator, policy, executor, attacher.
HOPS = 4


@dataclass
class Figures:
    p50_ms: float
    p99_ms: float
    burst_calls_per_s: float


Send = Callable[[Client, str, bytes], Awaitable[None]]


def principal_for(creds: Path | None) -> Principal:
    """The bench's principal: the agent `creds` speak for, else bench.bench."""
    identity = identity_of_creds(creds) if creds is not None else None
    tenant, agent = identity or (PRINCIPAL.tenant, PRINCIPAL.agent)
    return Principal(tenant=tenant, user=PRINCIPAL.user, agent=agent, session=PRINCIPAL.session)


async def _measure(nc: Client, send: Send, out_wildcard: str, id_of: Callable[[str], str],
                   calls: int, burst: int, prefix: str, principal: Principal) -> Figures:
    waiting: dict[str, asyncio.Future[None]] = {}

    async def on_out(msg: object) -> None:
        future = waiting.pop(id_of(msg.subject), None)  # type: ignore[attr-defined]
        if future is not None and not future.done():
            future.set_result(None)

    sub = await nc.subscribe(out_wildcard, cb=on_out)
    loop = asyncio.get_running_loop()

    async def one(call_id: str) -> None:
        waiting[call_id] = loop.create_future()
        future = waiting[call_id]
        body = msgspec.json.encode(ToolCall(call_id=call_id, tool="echo", arguments={},
                                            principal=principal))
        await send(nc, call_id, body)
        await asyncio.wait_for(future, 60)

    for i in range(20):  # warm-up: connections, consumers, caches
        await one(f"{prefix}-warm-{i}")
    latencies = []
    for i in range(calls):
        started = time.perf_counter()
        await one(f"{prefix}-lat-{i}")
        latencies.append((time.perf_counter() - started) * 1000)
    started = time.perf_counter()
    await asyncio.gather(*(one(f"{prefix}-burst-{i}") for i in range(burst)))
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    latencies.sort()
    return Figures(p50_ms=statistics.median(latencies),
                   p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
                   burst_calls_per_s=burst / elapsed)


async def _pipeline(nats_url: str, calls: int, burst: int, run: str,
                    creds: Path | None) -> Figures:
    principal = principal_for(creds)
    nc = await nats.connect(nats_url, **connect_options(creds))
    js = nc.jetstream()
    calls_subject = subjects.calls_subject(principal.tenant, principal.agent)

    async def send(_: Client, call_id: str, body: bytes) -> None:
        # As GatewayClient publishes: no Nats-Msg-Id (the gateway dedupes by call_id).
        await js.publish(calls_subject, body, stream=subjects.CALLS_STREAM)

    try:
        results = subjects.agent_results_prefix(principal.tenant, principal.agent)
        return await _measure(nc, send, f"{results}.*",
                              lambda subject: subject.rsplit(".", 1)[-1], calls, burst,
                              f"pipe-{run}", principal)
    finally:
        await nc.close()


async def _floor(nats_url: str, calls: int, burst: int, run: str,
                 creds: Path | None) -> Figures:
    nc = await nats.connect(nats_url, **connect_options(creds))
    js = nc.jetstream()
    await js.add_stream(floor.stream_config())

    async def send(_: Client, call_id: str, body: bytes) -> None:
        # The agent's publish: no Nats-Msg-Id, like the pipeline's first hop.
        await js.publish(floor.hop_subject(0), body, stream=floor.STREAM,
                         headers={floor.CALL_HEADER: call_id})

    hops = [_start_hop(nats_url, i, creds) for i in range(HOPS)]
    try:
        return await _measure(nc, send, floor.out_subject("*"),
                              lambda subject: subject.rsplit(".", 1)[-1], calls, burst,
                              f"floor-{run}", principal_for(None))
    finally:
        for hop in hops:
            hop.terminate()
        for hop in hops:
            hop.wait()
        await nc.close()


def _start_hop(nats_url: str, index: int, creds: Path | None) -> subprocess.Popen[bytes]:
    flags = ["--creds", str(creds)] if creds else []
    return subprocess.Popen([sys.executable, "-m", "toolgate.bench.floor",
                             "--nats-url", nats_url, "--hop", str(index), "--hops", str(HOPS),
                             *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=die_with_parent)


def _print(name: str, figures: Figures) -> None:
    print(f"{name:<9} p50 {figures.p50_ms:7.2f} ms   p99 {figures.p99_ms:7.2f} ms   "
          f"burst {figures.burst_calls_per_s:8.0f} calls/s")


def run_bench(args: argparse.Namespace) -> int:
    run = str(int(time.time()))
    with tempfile.TemporaryDirectory(prefix="toolgate-bench-") as tmp:
        stack = None
        nats_url = args.nats_url
        # The floor declares its own stream and subjects: on a locked bus that is the operator's.
        creds = agent_creds = args.creds
        if creds is not None and identity_of_creds(creds) is not None:
            # An agent's creds drive the pipeline; the floor needs the operator's.
            creds = env_nats_creds("admin")
        if nats_url is None:
            stack = Stack(data_dir=Path(tmp))
            stack.start()
            nats_url = stack.url
            creds, agent_creds = stack.creds_of("admin"), stack.creds_of("agent")
            asyncio.run(_wait_for_pipeline(nats_url, agent_creds))
        try:
            print(f"toolgate bench: {args.calls} sequential calls, burst of {args.burst}, "
                  f"tool 'echo', {HOPS} hops, NATS {nats_url}")
            pipeline = asyncio.run(_pipeline(nats_url, args.calls, args.burst, run,
                                             agent_creds))
            base = asyncio.run(_floor(nats_url, args.calls, args.burst, run, creds))
        finally:
            if stack is not None:
                stack.stop()
    _print("pipeline", pipeline)
    _print("floor", base)
    print(f"ratio     p50 {pipeline.p50_ms / base.p50_ms:5.2f}x   "
          f"p99 {pipeline.p99_ms / base.p99_ms:5.2f}x   "
          f"throughput {pipeline.burst_calls_per_s / base.burst_calls_per_s:5.2f}x of the floor")
    return 0


async def _wait_for_pipeline(nats_url: str, creds: Path | None, timeout: float = 60.0) -> None:
    """Wait until one call goes through: every service is up."""
    from toolgate.client.gateway_client import GatewayClient

    deadline = time.monotonic() + timeout
    principal = principal_for(creds)
    async with await GatewayClient.connect(nats_url, creds) as client:
        while True:
            try:
                await client.call("echo", {}, principal=principal, timeout=5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
