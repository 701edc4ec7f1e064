"""`toolgate bench mcp`: what the MCP front door adds to a call, in one run.

Starts a private gateway as `toolgate up` starts it (locked bus, the front
door on loopback; the audit off, so the machine is quieter) and sends the
same no-op call (`echo`) one at a time, interleaved in blocks so a shared
machine's drift hits every way alike:

- `SDK client <era>`: the official SDK's client (`mcp.Client`, Streamable
  HTTP, a bearer token), in both protocol eras -> tools/call -> the front
  door -> the bus -> its result: what an MCP agent sees;
- `plain POST`: the same 2026-07-28 tools/call request the SDK's client
  sends, written on one keep-alive HTTP/1.1 connection and read back by
  Content-Length: what the front door itself adds, without an SDK client's
  own cost on the same cores;
- `plain POST, SDK pipeline`: the same request to a second front door on the same
  gateway that sends every request through the SDK's pipeline (its common call path
  off: services/mcp_front/common_call.py): what that path saves, A/B in one run;
- `NATS (GatewayClient)`: the same call straight on the wire contract, as
  another agent of the same tenant (an agent's results reach every connection
  listening for that agent: one agent for both would wake each client for
  the other's results).

- upstream MCP servers (a no-op `echo` server, bench/mcp_echo.py, over stdio and
  over Streamable HTTP): a direct SDK session to the server, and the same tool
  through the gateway (GatewayClient -> the executor's kept session): what the
  gateway adds to an upstream call.

Prints p50/p99 of each, what each front-door way adds over NATS, what the gateway
adds over a direct session to each upstream, and the CPU per call of the front door
and of this client. Progress to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from toolgate.bench import procs
from toolgate.bench.loops import percentile, say

BLOCK = 50
NATS = "NATS (GatewayClient)"
PLAIN = "plain POST 2026-07-28"
PLAIN_SDK = "plain POST, SDK pipeline"
MODERN_ERA = "2026-07-28"
FRONT_DOOR = "mcp"  # the front door's process, as the stack names it
SDK_DOOR = "mcp-sdk"  # the second front door, every request through the SDK's pipeline
# Upstream rows: (direct session, through the gateway), per transport.
UPSTREAM_ROWS = {
    "stdio": ("upstream stdio, direct", "upstream stdio, gateway"),
    "http": ("upstream HTTP, direct", "upstream HTTP, gateway"),
}
ECHO_COMMAND = [sys.executable, "-m", "toolgate.bench.mcp_echo"]


def write_upstream_registry(directory: Path, http_url: str) -> dict[str, str]:
    """Registry entries for the bench's echo upstream over stdio and HTTP (imported as
    `toolgate tools import-mcp` does, then made low risk): {transport: tool name}."""
    import yaml

    from toolgate.cli.mcp import list_upstream, registry_entry
    from toolgate.contracts.registry import McpUpstream

    directory.mkdir(parents=True, exist_ok=True)
    names: dict[str, str] = {}
    transports: dict[str, dict[str, Any]] = {
        "stdio": {"command": ECHO_COMMAND[0], "args": [*ECHO_COMMAND[1:], "--stdio"]},
        "http": {"url": http_url},
    }
    for transport, fields in transports.items():
        upstream = McpUpstream(**fields, tool="-", definition_sha256="0" * 64)
        (tool,) = asyncio.run(asyncio.wait_for(list_upstream(upstream), 60))
        entry = registry_entry(fields, upstream.server, f"up_{transport}", tool, ["*"])
        entry.update(risk="low", requires_approval=False, read_only=True)
        (directory / f"{entry['name']}.yaml").write_text(yaml.safe_dump(entry))
        names[transport] = entry["name"]
    return names


@contextlib.asynccontextmanager
async def direct_sessions(http_url: str) -> Any:
    """SDK sessions straight to the echo upstream: {transport: client}."""
    from mcp import Client
    from mcp.client.stdio import StdioServerParameters

    async with (
        Client(
            StdioServerParameters(command=ECHO_COMMAND[0], args=[*ECHO_COMMAND[1:], "--stdio"]),
            cache=None,
        ) as stdio,
        Client(http_url, cache=None) as http,
    ):
        yield {"stdio": stdio, "http": http}


class PlainPost:
    """The least an MCP client can do: one keep-alive HTTP/1.1 connection and the
    same JSON-RPC `tools/call` POST the SDK's client sends in the 2026-07-28 era
    (its `_meta` envelope and routing headers), the answer read by Content-Length.
    A measuring stick for the server side only, not a client to build on."""

    def __init__(self, url: str, token: str) -> None:
        parts = urlsplit(url)
        self.host, self.port, self.path = parts.hostname or "", parts.port or 80, parts.path
        self.token = token
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> PlainPost:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def reopen(self) -> None:
        """A new connection: the door closes one left idle past its keep-alive timeout
        (5 s), as it is while the slower ways run their blocks."""
        await self.__aexit__()
        await self.__aenter__()

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()

    async def call(self, request_id: int, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        assert self.reader is not None and self.writer is not None
        body = json.dumps(
            {
                "jsonrpc": "2.0",
                "id": request_id,
                "method": "tools/call",
                "params": {
                    "name": tool,
                    "arguments": arguments,
                    "_meta": {
                        "io.modelcontextprotocol/protocolVersion": MODERN_ERA,
                        "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"},
                        "io.modelcontextprotocol/clientCapabilities": {},
                    },
                },
            },
            separators=(",", ":"),
        ).encode()
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {self.token}\r\n"
            "Accept: application/json, text/event-stream\r\nContent-Type: application/json\r\n"
            f"MCP-Protocol-Version: {MODERN_ERA}\r\nMcp-Method: tools/call\r\n"
            f"Mcp-Name: {tool}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line, *header_lines = (
            (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        )
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in header_lines if line)
        }
        if "content-length" not in headers:
            raise RuntimeError(f"the front door answered without Content-Length: {status_line}")
        answer = await self.reader.readexactly(int(headers["content-length"]))
        if status_line.split(" ", 2)[1] != "200":
            raise RuntimeError(f"the front door answered {status_line}: {answer[:300]!r}")
        found = json.loads(answer)
        assert isinstance(found, dict)
        return found


async def _wait_for_door(url: str) -> None:
    import httpx2

    async with httpx2.AsyncClient() as probe:  # 401 without a token: it is up
        deadline = time.monotonic() + 60
        while True:
            try:
                if (await probe.post(url, json={})).status_code == 401:
                    return
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the front door at {url} never answered")
            await asyncio.sleep(0.2)


async def _measure(
    stack: object,
    calls: int,
    token: str,
    nats_creds: Path,
    upstream_tools: dict[str, str],
    http_url: str,
    sdk_door: tuple[str, int],
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    from toolgate.client.gateway_client import GatewayClient
    from toolgate.stack.supervisor import Stack

    assert isinstance(stack, Stack) and stack.mcp_url is not None
    url = stack.mcp_url
    sdk_url, sdk_pid = sdk_door
    await _wait_for_door(url)
    await _wait_for_door(sdk_url)
    modern_http, legacy_http = (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {token}"}, timeout=30.0)
        for _ in range(2)
    )
    gateway = await GatewayClient.connect(stack.url, nats_creds)
    processes = procs.of_stack(stack)
    processes.add(SDK_DOOR, sdk_pid)
    async with (
        modern_http,
        legacy_http,
        gateway,
        PlainPost(url, token) as plain,
        PlainPost(sdk_url, token) as plain_sdk,
        Client(streamable_http_client(url, http_client=modern_http)) as modern,
        Client(streamable_http_client(url, http_client=legacy_http), mode="legacy") as legacy,
        direct_sessions(http_url) as direct,
    ):

        def via(door: Client) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                result = await door.call_tool("echo", {"payload": i})
                if result.is_error:
                    raise RuntimeError(f"echo failed through the front door: {result}")

            return call

        def via_plain(post: PlainPost) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                answer = await post.call(i, "echo", {"payload": i})
                if answer.get("result", {}).get("isError") is not False:
                    raise RuntimeError(f"echo failed through the front door: {answer}")

            return call

        async def via_nats(i: int) -> None:
            result = await gateway.call("echo", {"payload": i}, user="u-bench", session="s-bench")
            if not result.ok:
                raise RuntimeError(f"echo failed on NATS: {result}")

        def upstream_direct(client: Client) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                result = await client.call_tool("echo", {"payload": i})
                if result.is_error:
                    raise RuntimeError(f"echo failed on a direct upstream session: {result}")

            return call

        def upstream_gateway(tool: str) -> Callable[[int], Awaitable[None]]:
            async def call(i: int) -> None:
                result = await gateway.call(tool, {"payload": i}, user="u-bench", session="s")
                if not result.ok:
                    raise RuntimeError(f"{tool} failed through the gateway: {result}")

            return call

        ways = {
            f"SDK client {modern.protocol_version}": via(modern),
            f"SDK client {legacy.protocol_version}": via(legacy),
            PLAIN: via_plain(plain),
            PLAIN_SDK: via_plain(plain_sdk),
            NATS: via_nats,
        }
        for transport, (direct_row, gateway_row) in UPSTREAM_ROWS.items():
            ways[direct_row] = upstream_direct(direct[transport])
            ways[gateway_row] = upstream_gateway(upstream_tools[transport])
        posts = {PLAIN: plain, PLAIN_SDK: plain_sdk}
        times: dict[str, list[float]] = {name: [] for name in ways}
        cpu: dict[str, dict[str, float]] = {name: {} for name in ways}
        # Warm up every path (connections, the pipeline's first-call costs).
        for name, way in ways.items():
            if name in posts:
                await posts[name].reopen()
            for i in range(20):
                await way(i)
        done = 0
        while done < calls:
            block = min(BLOCK, calls - done)
            for name, way in ways.items():
                if name in posts:
                    await posts[name].reopen()  # not timed
                before = processes.snapshot()
                for i in range(block):
                    started = time.perf_counter()
                    await way(done + i)
                    times[name].append((time.perf_counter() - started) * 1000)
                for process, seconds in procs.delta(before, processes.snapshot()).items():
                    cpu[name][process] = cpu[name].get(process, 0.0) + seconds
            done += block
            say(f"{done}/{calls} calls each way")
    return times, cpu


def _report(times: dict[str, list[float]], cpu: dict[str, dict[str, float]]) -> None:
    print("no-op tool (echo), one call at a time; interleaved blocks of", BLOCK)
    print(
        f"{'':26} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'adds p50':>9} {'adds p99':>9}"
        f" {'door cpu':>9} {'client cpu':>11} {'all cpu':>8}"
    )
    nats = sorted(times[NATS])
    nats_p50, nats_p99 = percentile(nats, 0.50), percentile(nats, 0.99)
    upstream_rows = {row for rows in UPSTREAM_ROWS.values() for row in rows}
    for name, values in times.items():
        ordered = sorted(values)
        p50, p99 = percentile(ordered, 0.50), percentile(ordered, 0.99)
        adds = (
            ""
            if name == NATS or name in upstream_rows
            else f"{p50 - nats_p50:>9.2f} {p99 - nats_p99:>9.2f}"
        )
        per_call = {process: s * 1000 / len(values) for process, s in cpu[name].items()}
        print(
            f"{name:26} {len(values):>6} {p50:>8.2f} {p99:>8.2f} {adds:>19}"
            f" {per_call.get(SDK_DOOR if name == PLAIN_SDK else FRONT_DOOR, 0.0):>9.2f}"
            f" {per_call.get('client', 0.0):>11.2f}"
            f" {sum(per_call.values()):>8.2f}"
        )
    print(
        "(adds: over NATS; cpu: ms of CPU per call of the front door's process, of this\n"
        " client (the SDK's or GatewayClient), and of every process of the gateway and this\n"
        " client together)"
    )
    for transport, (direct_row, gateway_row) in UPSTREAM_ROWS.items():
        direct, through = sorted(times[direct_row]), sorted(times[gateway_row])
        print(
            f"upstream {transport}: the gateway adds "
            f"{percentile(through, 0.50) - percentile(direct, 0.50):.2f} ms at p50, "
            f"{percentile(through, 0.99) - percentile(direct, 0.99):.2f} ms at p99 over a "
            "direct session to the same server (a local tool on NATS: "
            f"{nats_p50:.2f} ms at p50)"
        )
    common, sdk = sorted(times[PLAIN]), sorted(times[PLAIN_SDK])
    door_cpu = {  # of the door that answered the way
        way: cpu[way].get(door, 0.0) * 1000 / len(times[way])
        for way, door in ((PLAIN, FRONT_DOOR), (PLAIN_SDK, SDK_DOOR))
    }
    print(
        f"the common call path: plain POST adds {percentile(common, 0.50) - nats_p50:.2f} ms "
        f"at p50 ({(percentile(common, 0.50) - nats_p50) / nats_p50:.2f}x of NATS), door CPU "
        f"{door_cpu[PLAIN]:.2f} ms a call; through the SDK's pipeline "
        f"{percentile(sdk, 0.50) - nats_p50:.2f} ms "
        f"({(percentile(sdk, 0.50) - nats_p50) / nats_p50:.2f}x), door CPU "
        f"{door_cpu[PLAIN_SDK]:.2f} ms"
    )
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"(load average {load}, {os.cpu_count()} cores)")


def _wait_and_register(upstream: Any, registry: Path, http_url: str) -> dict[str, str]:
    deadline = time.monotonic() + 60
    while True:
        try:
            return write_upstream_registry(registry, http_url)
        except Exception:
            if upstream.poll() is not None or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def cmd_bench_mcp(args: argparse.Namespace) -> int:
    import subprocess

    from toolgate.services.mcp_front.tokens import mint_token
    from toolgate.stack import nats_auth
    from toolgate.stack.supervisor import DEFAULT_AGENT, DEFAULT_TENANT, Stack, free_port

    calls = max(1, int(args.calls))
    with tempfile.TemporaryDirectory(prefix="toolgate-bench-mcp-") as tmp:
        say("starting the echo upstream (HTTP) and a private gateway as `toolgate up` runs it")
        port = free_port()
        http_url = f"http://127.0.0.1:{port}/mcp"
        upstream = subprocess.Popen([*ECHO_COMMAND, "--port", str(port)])
        stack = None
        sdk_door: subprocess.Popen[bytes] | None = None
        try:
            upstream_tools = _wait_and_register(upstream, Path(tmp) / "registry", http_url)
            stack = Stack(
                data_dir=Path(tmp) / "gateway",
                registry_dirs=[Path(tmp) / "registry"],
                with_audit=False,
                nats_port=0,
            )
            stack.start()
            token = mint_token(stack.data_dir, DEFAULT_TENANT, DEFAULT_AGENT)
            # As `toolgate agents token` does: the front door may now act for this agent.
            keys = nats_auth.AuthKeys.load(stack.data_dir)
            _, account = nats_auth.mcp_front_account_jwt(keys, stack.data_dir)
            nats_creds, nats_agent = nats_auth.add_agent(stack.data_dir, DEFAULT_TENANT, "bench")
            nats_auth.push_account_jwts_sync(stack.url, stack.data_dir, [account, nats_agent])
            sdk_port = free_port()
            sdk_door = subprocess.Popen(sdk_door_command(stack, sdk_port))
            times, cpu = asyncio.run(
                _measure(
                    stack,
                    calls,
                    token,
                    nats_creds,
                    upstream_tools,
                    http_url,
                    (f"http://127.0.0.1:{sdk_port}/mcp", sdk_door.pid),
                )
            )
        finally:
            if sdk_door is not None:
                sdk_door.terminate()
                sdk_door.wait(10)
            if stack is not None:
                with contextlib.suppress(Exception):
                    stack.stop()
            upstream.terminate()
            upstream.wait(10)
    _report(times, cpu)
    sys.stdout.flush()
    return 0


def sdk_door_command(stack: Any, port: int) -> list[str]:
    """A second front door on `stack`'s bus, every request through the SDK's pipeline."""
    command = [sys.executable, "-m", "toolgate.bench.mcp", "--nats-url", stack.url]
    command += ["--creds", str(stack.creds_of("mcp_front")), "--data-dir", str(stack.data_dir)]
    for directory in stack.registry_dirs:
        command += ["--registry", str(directory)]
    return command + ["--port", str(port)]


def serve_sdk_door(argv: list[str]) -> int:
    """`python -m toolgate.bench.mcp ...`: the front door with its common call path off."""
    from toolgate.runtime.settings import GatewaySettings
    from toolgate.services.mcp_front.app import FrontDoorOptions, serve

    parser = argparse.ArgumentParser(prog="toolgate.bench.mcp")
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--creds", type=Path)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--registry", type=Path, action="append", default=[])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    settings = GatewaySettings(
        nats_url=args.nats_url,
        nats_creds=args.creds,
        data_dir=args.data_dir,
        registry_dirs=tuple(args.registry),
    )
    serve(settings, FrontDoorOptions(port=args.port, common_path=False))
    return 0


if __name__ == "__main__":
    sys.exit(serve_sdk_door(sys.argv[1:]))
