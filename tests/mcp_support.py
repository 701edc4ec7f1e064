"""Real MCP clients and servers for the tests: the official SDK's client against the front
door, and an upstream MCP server (tests/tools/mcp_upstream.py) as a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

from tests.harness import REPO_ROOT, Gateway
from toolgate.services.mcp_front.tokens import mint_token
from toolgate.stack.nats_auth import AuthKeys, mcp_front_account_jwt, push_account_jwts
from toolgate.stack.supervisor import free_port


@contextlib.asynccontextmanager
async def mcp_client(url: str, token: str | None, mode: str = "auto") -> AsyncIterator[Client]:
    """The SDK's client on `url`, sending `token` as its bearer token."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode) as client:  # type: ignore[arg-type]
        yield client


async def agent_token(gateway: Gateway, tenant: str, agent: str) -> str:
    """A bearer token for (tenant, agent), minted as `toolgate agents token` does: the
    front door's account then imports this agent's subjects (told to the server)."""
    await gateway.agent_creds(tenant, agent)
    token = mint_token(gateway.data_dir, tenant, agent)
    _, account = mcp_front_account_jwt(AuthKeys.load(gateway.data_dir), gateway.data_dir)
    await push_account_jwts(gateway.url, gateway.data_dir, [account])
    return token


async def wait_for_front_door(gateway: Gateway, timeout: float = 60.0) -> str:
    """The front door's URL, once it answers (401 without a token: it is up)."""
    url = gateway.stack.mcp_url
    assert url is not None
    deadline = time.monotonic() + timeout
    async with httpx2.AsyncClient() as http:
        while True:
            try:
                answer = await http.post(url, json={})
                if answer.status_code == 401:
                    return url
            except httpx2.TransportError:
                pass
            if time.monotonic() > deadline:
                log = gateway.data_dir / "logs" / "mcp.log"
                raise TimeoutError(f"front door never answered: {log.read_text()[-2000:]}")
            await asyncio.sleep(0.1)


class Upstream:
    """tests/tools/mcp_upstream.py on a free loopback port, as a process of its own."""

    def __init__(self, changed: bool = False, port: int = 0, duplicate: str | None = None) -> None:
        self.port = port or free_port()
        self.changed = changed
        self.duplicate = duplicate  # list `lookup` twice: "changed-first" or "pinned-first"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def start(self, timeout: float = 30.0) -> Upstream:
        command = [sys.executable, "-m", "tests.tools.mcp_upstream", "--port", str(self.port)]
        if self.changed:
            command.append("--changed")
        if self.duplicate:
            command += ["--duplicate", self.duplicate]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, env=env)
        deadline = time.monotonic() + timeout
        with httpx2.Client() as http:
            while True:
                try:
                    http.get(self.url)
                    return self
                except httpx2.TransportError:
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError("the upstream MCP server did not start") from None
                    time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def toolgate(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """The `toolgate` command, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli", *args],
        cwd=cwd or REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def structured(result: Any) -> dict[str, Any]:
    assert isinstance(result.structured_content, dict), result
    return result.structured_content
