"""`toolgate bench mcp`: what the MCP front door adds to a call, in one run.

Starts a private gateway as `toolgate up` starts it (locked bus, the front
door on loopback; the audit off, so the machine is quieter) and sends the
same no-op call (`echo`) one at a time two ways, interleaved in blocks so a
shared machine's drift hits both alike:

- `MCP front door`: the official SDK's client (`mcp.Client`, Streamable HTTP,
  a bearer token) -> tools/call -> the front door -> the bus -> its result;
- `NATS (GatewayClient)`: the same agent, straight on the wire contract.

Prints p50/p99 of each and the difference. Progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from toolgate.bench.loops import percentile, say

BLOCK = 50
DOOR = "MCP front door"
NATS = "NATS (GatewayClient)"


async def _measure(stack: object, calls: int, token: str) -> dict[str, list[float]]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from toolgate.client.gateway_client import GatewayClient
    from toolgate.stack.supervisor import Stack

    assert isinstance(stack, Stack) and stack.mcp_url is not None
    url = stack.mcp_url
    async with httpx2.AsyncClient() as probe:  # wait for the front door
        deadline = time.monotonic() + 60
        while True:
            try:
                if (await probe.post(url, json={})).status_code == 401:
                    break
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the front door at {url} never answered")
            await asyncio.sleep(0.2)
    modern_http, legacy_http = (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30.0)
        for _ in range(2)
    )
    gateway = await GatewayClient.connect(stack.url, stack.creds_of("agent"))
    async with (
        modern_http,
        legacy_http,
        gateway,
        Client(streamable_http_client(url, http_client=modern_http)) as modern,
        Client(streamable_http_client(url, http_client=legacy_http), mode="legacy") as legacy,
    ):

        def via(door: Client) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                result = await door.call_tool("echo", {"payload": i})
                if result.is_error:
                    raise RuntimeError(f"echo failed through the front door: {result}")

            return call

        async def via_nats(i: int) -> None:
            result = await gateway.call("echo", {"payload": i}, user="u-bench", session="s-bench")
            if not result.ok:
                raise RuntimeError(f"echo failed on NATS: {result}")

        ways = {
            f"{DOOR} {modern.protocol_version}": via(modern),
            f"{DOOR} {legacy.protocol_version}": via(legacy),
            NATS: via_nats,
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        # Warm up every path (connections, the pipeline's first-call costs).
        for way in ways.values():
            for i in range(20):
                await way(i)
        done = 0
        while done < calls:
            block = min(BLOCK, calls - done)
            for name, way in ways.items():
                for i in range(block):
                    started = time.perf_counter()
                    await way(done + i)
                    times[name].append((time.perf_counter() - started) * 1000)
            done += block
            say(f"{done}/{calls} calls each way")
    return times


def _report(times: dict[str, list[float]]) -> None:
    print("no-op tool (echo), one call at a time, the same agent; interleaved blocks of", BLOCK)
    print(f"{'':34} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8}")
    figures = {}
    for name, values in times.items():
        ordered = sorted(values)
        figures[name] = (percentile(ordered, 0.50), percentile(ordered, 0.99))
        print(f"{name:34} {len(values):>6} {figures[name][0]:>8.2f} {figures[name][1]:>8.2f}")
    nats = figures[NATS]
    for name, (p50, p99) in figures.items():
        if name != NATS:
            label = f"adds ({name.removeprefix(DOOR + ' ')})"
            print(f"{label:34} {'':>6} {p50 - nats[0]:>8.2f} {p99 - nats[1]:>8.2f}")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"(load average {load}, {os.cpu_count()} cores)")


def cmd_bench_mcp(args: argparse.Namespace) -> int:
    from toolgate.services.mcp_front.tokens import mint_token
    from toolgate.stack import nats_auth
    from toolgate.stack.supervisor import DEFAULT_AGENT, DEFAULT_TENANT, Stack

    calls = max(1, int(args.calls))
    with tempfile.TemporaryDirectory(prefix="toolgate-bench-mcp-") as tmp:
        say("starting a private gateway as `toolgate up` runs it (locked bus, audit off)")
        stack = Stack(data_dir=Path(tmp) / "gateway", with_audit=False, nats_port=0)
        try:
            stack.start()
            token = mint_token(stack.data_dir, DEFAULT_TENANT, DEFAULT_AGENT)
            # As `toolgate agents token` does: the front door may now act for this agent.
            keys = nats_auth.AuthKeys.load(stack.data_dir)
            _, account = nats_auth.mcp_front_account_jwt(keys, stack.data_dir)
            nats_auth.push_account_jwts_sync(stack.url, stack.data_dir, [account])
            times = asyncio.run(_measure(stack, calls, token))
        finally:
            with contextlib.suppress(Exception):
                stack.stop()
    _report(times)
    sys.stdout.flush()
    return 0
