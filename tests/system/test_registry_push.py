"""The registry is served by the gateway: `toolgate tools push DIR`, followed without restarts.

A whole gateway on the locked bus. The operator pushes a directory that adds a tool:
every service (and the executor, which starts consuming the new tool's queue) moves
to it with no process restarted, and an agent calls it. Its own listing, asked on its
own subject, shows it; another agent's or another tenant's listing cannot be asked at
all (the server refuses). A write to the bucket that is unsigned, tampered with, or an
older signed version is refused by every service, which keeps the version it serves.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import nats
import pytest
import yaml
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from tests.harness import Gateway
from tests.mcp_support import agent_token, mcp_client, wait_for_front_door
from tests.tools.faulty import runs_of
from toolgate.client.frameworks.session import GatewaySession
from toolgate.client.gateway_client import GatewayClient
from toolgate.contracts import subjects
from toolgate.contracts.registry_bundle import ToolListing
from toolgate.runtime.bundle_bucket import ACTIVE_KEY
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.runtime.signed_bundles import StoredBundle

pytestmark = [pytest.mark.system, pytest.mark.front_door]

NO_ANSWER_S = 2.0  # how long a refused request is waited on before it counts as unanswered
TRIES = 300  # polls of 0.1 s at most: only to give up, never a threshold under test

PUSHED = {
    "name": "pushed_counter",
    "description": "Counts its runs. Pushed while the gateway runs. Test only.",
    "function": "tests.tools.faulty:count_runs",
    "input_schema": {
        "type": "object",
        "properties": {"amount": {"type": "integer"}},
        "additionalProperties": False,
    },
    "output_schema": {
        "type": "object",
        "properties": {"call_id": {"type": "string"}},
        "required": ["call_id"],
    },
    "read_only": False,
    "idempotent": True,
    "timeout_s": 10,
    "risk": "low",
    "allowed_agents": ["researcher"],
}


def toolgate(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it beside `toolgate up` (what it recorded in data_dir)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli.main", *args],
        cwd=data_dir.parent,
        env={**env, "TOOLGATE_DATA_DIR": str(data_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def registry_with(gateway: Gateway, target: Path, *tools: dict[str, object]) -> Path:
    """The gateway's registry directory plus `tools`."""
    shutil.copytree(gateway.registry_dir, target)
    for tool in tools:
        (target / f"{tool['name']}.yaml").write_text(yaml.safe_dump(tool))
    return target


async def status_of(client: GatewayClient, tool: str) -> str:
    return (await client.call(tool, {"amount": 1}, user="u-alice", session="s-1")).status


async def until_status(client: GatewayClient, tool: str, wanted: str) -> None:
    for _ in range(TRIES):
        if await status_of(client, tool) == wanted:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{tool} never answered {wanted}")


async def until_logged(gateway: Gateway, service: str, text: str) -> None:
    log = gateway.service(service).log_path
    for _ in range(TRIES):
        if text in log.read_text():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{service} never logged {text!r}")


async def ask_listing(nc: nats.aio.client.Client, tenant: str, agent: str) -> ToolListing:
    reply = await nc.request(subjects.tools_listing_subject(tenant, agent), b"", NO_ANSWER_S)
    return msgspec.json.decode(reply.data, type=ToolListing)


def test_a_pushed_tool_is_served_and_runs_without_a_restart(
    gateway: Gateway, tmp_path: Path
) -> None:
    pids = {s.name: s.process.pid for s in gateway.stack.services if s.process is not None}
    pushed = registry_with(gateway, tmp_path / "pushed", PUSHED)

    async def before() -> None:
        async with await gateway.client() as client:
            assert await status_of(client, "pushed_counter") == "unknown_tool"
            listing = await client.tool_listing()
            assert "pushed_counter" not in {t.name for t in listing.tools}
            assert listing.number == 0

    asyncio.run(before())
    done = toolgate(gateway.data_dir, "tools", "push", str(pushed), "--by", "alice")
    assert done.returncode == 0, done.stderr
    assert "as version 1" in done.stdout

    async def after() -> None:
        async with await gateway.client() as client:
            await until_status(client, "pushed_counter", "ok")
            listing = await client.tool_listing()
            assert listing.number == 1
            assert "pushed_counter" in {t.name for t in listing.tools}
        # The MCP front door lists it and calls it (it asks the gateway for the listing).
        url = await wait_for_front_door(gateway)
        token = await agent_token(gateway, "acme", "researcher")
        async with mcp_client(url, token) as door:
            listed = {tool.name for tool in (await door.list_tools()).tools}
            assert "pushed_counter" in listed
            answer = await door.call_tool("pushed_counter", {"amount": 2})
            assert not answer.is_error, answer
        # A framework session shows the agent its listing as served, not local files.
        creds = await gateway.agent_creds("acme", "researcher")
        session = await GatewaySession.connect(gateway.url, creds, user="u-1", session="s-1")
        async with session:
            assert "pushed_counter" in {spec.name for spec in session.tools()}
        local = await GatewaySession.connect(
            gateway.url, creds, user="u-1", session="s-1", local_registry=True
        )
        async with local:  # told to read the local files: the pushed tool is not there
            assert "pushed_counter" not in {spec.name for spec in local.tools()}
        async with await gateway.client("acme", "writer") as writer:
            # allowed_agents: researcher only. Not listed, and denied if called anyway.
            listing = await writer.tool_listing()
            assert "pushed_counter" not in {t.name for t in listing.tools}
            assert await status_of(writer, "pushed_counter") == "denied"

    asyncio.run(after())
    assert runs_of(gateway.data_dir, "pushed_counter")
    # Nothing was restarted to get there.
    assert gateway.all_alive()
    assert pids == {s.name: s.process.pid for s in gateway.stack.services if s.process}
    shown = toolgate(gateway.data_dir, "tools", "list")
    assert shown.returncode == 0, shown.stderr
    assert "version 1 (pushed from" in shown.stdout and "by alice" in shown.stdout
    assert "pushed_counter" in shown.stdout


def test_an_agent_gets_its_own_listing_and_no_one_elses(gateway: Gateway) -> None:
    async def check() -> None:
        acme = await gateway.agent_creds("acme", "researcher")
        await gateway.agent_creds("acme", "writer")
        await gateway.agent_creds("globex", "researcher")
        nc = await nats.connect(nats_servers(gateway.url), **connect_options(acme))
        try:
            mine = await ask_listing(nc, "acme", "researcher")
            assert (mine.tenant, mine.agent) == ("acme", "researcher") and mine.tools
            for tenant, agent in (("acme", "writer"), ("globex", "researcher")):
                with pytest.raises((NatsTimeout, NoRespondersError)):
                    await ask_listing(nc, tenant, agent)
        finally:
            await nc.close()

    asyncio.run(check())


def test_unsigned_tampered_and_older_registries_are_refused(
    gateway: Gateway, tmp_path: Path
) -> None:
    first = registry_with(gateway, tmp_path / "first", PUSHED)
    second_tool = dict(PUSHED, name="pushed_second")
    second = registry_with(gateway, tmp_path / "second", PUSHED, second_tool)
    assert toolgate(gateway.data_dir, "tools", "push", str(first)).returncode == 0
    assert toolgate(gateway.data_dir, "tools", "push", str(second)).returncode == 0

    async def attack() -> None:
        async with await gateway.client() as client:
            await until_status(client, "pushed_second", "ok")
            nc = await gateway.connect("admin")  # a writer of the bucket without the key
            try:
                kv = await nc.jetstream().key_value(subjects.REGISTRY_BUCKET)
                history = await kv.history(ACTIVE_KEY)
                version_1 = history[0].value
                assert version_1 is not None
                stored = msgspec.json.decode(version_1, type=StoredBundle)
                evil = dict(PUSHED, name="pushed_evil", allowed_agents=["*"])
                files = {**stored.files, "pushed_evil.yaml": yaml.safe_dump(evil)}
                tampered = msgspec.structs.replace(stored, files=files, number=9)
                unsigned = msgspec.structs.replace(tampered, signature="")
                for value in (
                    version_1,  # an older signed version, put back
                    msgspec.json.encode(tampered),
                    msgspec.json.encode(unsigned),
                ):
                    revision = await kv.put(ACTIVE_KEY, value)
                    for service in ("validator", "executor", "policy"):
                        await until_logged(
                            gateway,
                            service,
                            f"{subjects.REGISTRY_BUCKET}/{ACTIVE_KEY} revision {revision} refused",
                        )
                    # Version 2 is still what every service serves.
                    assert await status_of(client, "pushed_second") == "ok"
                    assert await status_of(client, "pushed_evil") == "unknown_tool"
            finally:
                await nc.close()

    asyncio.run(attack())
    shown = toolgate(gateway.data_dir, "tools", "list")
    assert "version 2" in shown.stdout and "newest write is refused" in shown.stdout
    # Restarted now, with the unsigned write the bucket's newest: they serve version 2,
    # the validator's record of the last one accepted.
    for name in ("validator", "executor"):
        gateway.service(name).stop()
        gateway.service(name).start()

    async def after_restart() -> None:
        async with await gateway.client() as client:
            await until_status(client, "pushed_second", "ok")
            assert await status_of(client, "pushed_evil") == "unknown_tool"
            assert (await client.tool_listing()).number == 2

    asyncio.run(after_restart())
    assert gateway.all_alive()
