"""Real MCP clients and servers for the tests: the official SDK's client against the front
door, and an upstream MCP server (tests/tools/mcp_upstream.py) as a process of its own."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import platform
import shutil
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
    """A result's body: an `ok` one's structured content; an error's JSON text (an error
    carries no structured content: it would not match the tool's outputSchema)."""
    if result.is_error:
        assert result.structured_content is None, result
        body = json.loads(result.content[0].text)
        assert isinstance(body, dict), result
        return body
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


# ---------------------------------------------------------------- the MCP Inspector's CLI

INSPECTOR_PACKAGE = "@modelcontextprotocol/inspector@2.12.0"
# The Inspector needs node 22.19 or later; the npm registry serves node itself, as the
# package of one platform's binary (node-<os>-<arch>).
NODE_VERSION = "22.23.3"
INSPECTOR_DIR = REPO_ROOT / ".cache" / "mcp-inspector"


def node_package() -> str:
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine().lower()
    )
    system = {"linux": "linux", "darwin": "darwin"}.get(sys.platform, sys.platform)
    return f"node-{system}-{arch}@{NODE_VERSION}"


class InspectorMissing(RuntimeError):
    """The Inspector's CLI could not be installed: the message says why and what to do."""


def install_inspector(directory: Path = INSPECTOR_DIR) -> list[str]:
    """The command that runs the Inspector's CLI (`node .../index.js --cli`), installed
    from the npm registry into `directory` on first use (node too); InspectorMissing
    if it cannot be."""
    package = node_package().rpartition("@")[0]
    node = directory / "node_modules" / package / "bin" / "node"
    launcher = (
        directory
        / "node_modules"
        / "@modelcontextprotocol"
        / "inspector"
        / "clients"
        / "launcher"
        / "build"
        / "index.js"
    )
    directory.mkdir(parents=True, exist_ok=True)
    # One install at a time (test processes running side by side share the folder).
    with open(directory / ".install.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (node.exists() and launcher.exists()):
            npm_install(directory)
        if not (node.exists() and launcher.exists()):
            raise InspectorMissing(f"npm installed nothing runnable into {directory}")
    return [str(node), str(launcher), "--cli"]


def npm_install(directory: Path) -> None:
    """`npm install` node and the Inspector into `directory` (the registry only)."""
    npm = shutil.which("npm")
    if npm is None:
        raise InspectorMissing(
            "npm is not installed: the MCP Inspector test installs node "
            f"{NODE_VERSION} and {INSPECTOR_PACKAGE} with it (apt-get install npm)"
        )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "package.json").write_text('{"private": true}\n')
    done = subprocess.run(
        [
            npm,
            "install",
            "--no-audit",
            "--no-fund",
            "--no-save",
            "--ignore-scripts",
            node_package(),
            INSPECTOR_PACKAGE,
        ],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise InspectorMissing(
            f"npm could not install {node_package()} and {INSPECTOR_PACKAGE} into "
            f"{directory} (exit {done.returncode}): {' | '.join(tail)}"
        )


def inspector(
    command: list[str], url: str, token: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """The Inspector's CLI against `url` with `token`, as a user runs it."""
    return subprocess.run(
        [*command, url, "--transport", "http", "--header", f"Authorization: Bearer {token}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        # Its catalog would go to ~/.mcp-inspector; keep it out of the home folder.
        env={**os.environ, "MCP_CATALOG_PATH": str(INSPECTOR_DIR / "catalog.json")},
    )
