"""Upstream MCP servers as gated tools: a real upstream built with the SDK (its own process
on a free port), imported with `toolgate tools import-mcp`, served by a whole gateway and
called through the whole gate, by the MCP front door and by the wire contract.

Attacks: an upstream that changes a tool's description after it was reviewed; one that
lists a tool twice (the changed definition beside the reviewed one, in either order); one
that returns output breaking its schema; one that hangs; one that reports an error.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.harness import Gateway, make_test_registry
from tests.mcp_support import (
    Upstream,
    agent_token,
    mcp_client,
    structured,
    toolgate,
    wait_for_front_door,
)
from tests.tools.mcp_upstream import DUPLICATE_ORDERS
from toolgate.contracts.calls import Provenance
from toolgate.contracts.registry import load_tool_file

pytestmark = pytest.mark.system


@dataclass
class Setup:
    gateway: Gateway
    steady: Upstream
    drifting: Upstream
    doubling: Upstream


def import_into(registry: Path, upstream: Upstream, prefix: str) -> list[Path]:
    """`toolgate tools import-mcp`, then what an operator's review would change."""
    out = registry.parent / f"imported-{prefix}"
    done = toolgate("tools", "import-mcp", upstream.url, "--prefix", prefix, "--out", str(out))
    assert done.returncode == 0, done.stderr
    written = [Path(line) for line in done.stdout.split()]
    for path in written:
        entry = yaml.safe_load(path.read_text())
        # What the importer writes until someone reviews it: high risk, approval needed.
        assert entry["risk"] == "high" and entry["requires_approval"] is True
        entry.update(risk="low", requires_approval=False, read_only=True, timeout_s=2)
        (registry / path.name).write_text(yaml.safe_dump(entry))
    return written


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("mcp-upstream")
    steady, drifting, doubling = Upstream().start(), Upstream().start(), Upstream().start()
    gateway = None
    # Tests replace `drifting` and `doubling` (a redeployed upstream): stop whatever runs
    # at the end.
    running = Setup(gateway=None, steady=steady, drifting=drifting, doubling=doubling)  # type: ignore[arg-type]
    try:
        registry = make_test_registry(base / "registry")
        import_into(registry, steady, "up")
        import_into(registry, drifting, "drift")
        import_into(registry, doubling, "dup")
        gateway = Gateway(with_mcp=True, data_dir=base / "data", registry_dir=registry).start()
        asyncio.run(wait_for_front_door(gateway))
        running.gateway = gateway
        yield running
    finally:
        if gateway is not None:
            gateway.stop()
        running.steady.stop()
        running.drifting.stop()
        running.doubling.stop()


def test_import_writes_one_pinned_registry_file_per_upstream_tool(tmp_path: Path) -> None:
    upstream = Upstream().start()
    try:
        done = toolgate(
            "tools", "import-mcp", upstream.url, "--prefix", "up", "--out", str(tmp_path)
        )
    finally:
        upstream.stop()
    assert done.returncode == 0, done.stderr
    names = sorted(Path(line).stem for line in done.stdout.split())
    assert names == [
        "up_broken",
        "up_die",
        "up_drift",
        "up_environ",
        "up_failing",
        "up_lookup",
        "up_plain",
        "up_slow",
        "up_stats",
    ]
    lookup = load_tool_file(tmp_path / "up_lookup.yaml")
    assert lookup.mcp is not None and lookup.mcp.tool == "lookup" and lookup.mcp.url == upstream.url
    assert lookup.description == "Look up the value stored under a key."
    assert lookup.output_schema["required"] == ["value"]
    assert lookup.risk == "high" and lookup.requires_approval and not lookup.read_only
    plain = load_tool_file(tmp_path / "up_plain.yaml")
    assert plain.output_schema["required"] == ["content"]  # no schema upstream: its content
    refused = toolgate(
        "tools", "import-mcp", "http://127.0.0.1:1/mcp", "--prefix", "x", "--out", str(tmp_path)
    )
    assert refused.returncode == 3 and "cannot list the tools" in refused.stderr
    bad = toolgate(
        "tools", "import-mcp", upstream.url, "--prefix", "Bad-Name", "--out", str(tmp_path)
    )
    assert bad.returncode == 2 and "--prefix" in bad.stderr


async def test_an_upstream_tool_runs_through_the_gate_and_says_where_it_came_from(
    setup: Setup,
) -> None:
    token = await agent_token(setup.gateway, "acme", "researcher")
    async with mcp_client(setup.gateway.stack.mcp_url or "", token) as c:
        listed = {tool.name for tool in (await c.list_tools()).tools}
        assert {"up_lookup", "up_plain"} <= listed
        result = await c.call_tool("up_lookup", {"key": "k1"})
        bad = await c.call_tool("up_lookup", {"key": 5})
        plain = await c.call_tool("up_plain", {"key": "k2"})
    assert result.is_error is False
    assert structured(result) == {"value": "value of k1"}
    assert result.meta is not None
    assert result.meta["toolgate/provenance"] == {
        "source": "mcp",
        "server": setup.steady.url,
        "tool": "lookup",
        "trust": "untrusted",
    }
    # The gate validates arguments against the imported schema before the upstream sees them.
    assert bad.is_error and structured(bad)["status"] == "invalid_arguments"
    # Upstream content passes through as MCP content, not wrapped again in JSON text.
    assert plain.structured_content is None and plain.is_error is False
    assert [b.model_dump(mode="json", exclude_none=True) for b in plain.content] == [
        {"type": "text", "text": "plain k2"}
    ]
    # The same, on the wire contract: the ToolResult carries the provenance.
    async with await setup.gateway.client("acme", "researcher") as gateway:
        direct = await gateway.call("up_lookup", {"key": "k3"}, user="u-1", session="s-1")
    assert direct.ok and direct.data == {"value": "value of k3"}
    assert direct.provenance == Provenance(source="mcp", server=setup.steady.url, tool="lookup")


async def test_upstream_output_that_breaks_its_schema_never_reaches_the_agent(
    setup: Setup,
) -> None:
    token = await agent_token(setup.gateway, "acme", "researcher")
    async with mcp_client(setup.gateway.stack.mcp_url or "", token) as c:
        result = await c.call_tool("up_broken", {"key": "k"})
    assert result.is_error is True
    body = structured(result)
    assert body["status"] == "invalid_tool_result"
    assert body["error"]["code"] == "OUTPUT_SCHEMA_VIOLATION"
    assert "leaked detail" not in json.dumps(body) and "leaked detail" not in str(result.content)


async def test_a_hanging_upstream_times_out_and_an_error_is_an_execution_error(
    setup: Setup,
) -> None:
    token = await agent_token(setup.gateway, "acme", "researcher")
    async with mcp_client(setup.gateway.stack.mcp_url or "", token) as c:
        slow = await c.call_tool("up_slow", {"key": "k"})
        failing = await c.call_tool("up_failing", {"key": "k"})
    assert slow.is_error and structured(slow)["status"] == "timeout"
    assert structured(slow)["error"]["code"] == "TOOL_TIMEOUT"
    assert failing.is_error and structured(failing)["status"] == "execution_error"
    assert "the backend said no" in structured(failing)["error"]["message"]
    # The upstream's verdict on these arguments: a retry gets the same, so not retryable.
    assert structured(failing)["error"]["code"] == "UPSTREAM_TOOL_ERROR"
    assert structured(failing)["error"]["retryable"] is False
    assert failing.meta is not None and failing.meta["toolgate/provenance"]["tool"] == "failing"


async def test_an_upstream_that_changed_a_reviewed_definition_is_refused(setup: Setup) -> None:
    token = await agent_token(setup.gateway, "acme", "researcher")
    url = setup.gateway.stack.mcp_url or ""
    async with mcp_client(url, token) as c:
        before = await c.call_tool("drift_lookup", {"key": "k"})
    assert before.is_error is False
    # The upstream is redeployed with a description that tries to steer the model.
    setup.drifting.stop()
    changed = Upstream(changed=True, port=setup.drifting.port).start()
    setup.drifting = changed
    async with mcp_client(url, token) as c:
        after = await c.call_tool("drift_lookup", {"key": "k"})
        listed = {tool.name: tool for tool in (await c.list_tools()).tools}
    assert after.is_error is True
    assert structured(after)["status"] == "execution_error"
    assert structured(after)["error"]["code"] == "UPSTREAM_CHANGED"
    # The agent still sees the reviewed description, never the upstream's new one.
    assert listed["drift_lookup"].description == "Look up the value stored under a key."


@pytest.mark.parametrize("order", DUPLICATE_ORDERS)
async def test_an_upstream_that_lists_a_tool_twice_is_refused_whatever_the_order(
    setup: Setup, order: str
) -> None:
    """The reviewed definition beside a changed one: the pin must not pass on either."""
    token = await agent_token(setup.gateway, "acme", "researcher")
    url = setup.gateway.stack.mcp_url or ""
    setup.doubling.stop()
    setup.doubling = Upstream(duplicate=order, port=setup.doubling.port).start()
    async with mcp_client(url, token) as c:
        result = await c.call_tool("dup_lookup", {"key": "k"})
        other = await c.call_tool("dup_plain", {"key": "k"})  # the whole listing is suspect
    for refused in (result, other):
        assert refused.is_error is True
        body = structured(refused)
        assert body["status"] == "execution_error", body
        assert body["error"]["code"] == "UPSTREAM_DUPLICATE_TOOL"
        assert "'lookup' more than once" in body["error"]["message"]


@pytest.mark.parametrize("order", DUPLICATE_ORDERS)
def test_importing_an_upstream_that_lists_a_tool_twice_is_refused(
    tmp_path: Path, order: str
) -> None:
    upstream = Upstream(duplicate=order).start()
    try:
        done = toolgate(
            "tools", "import-mcp", upstream.url, "--prefix", "up", "--out", str(tmp_path)
        )
    finally:
        upstream.stop()
    assert done.returncode == 1, done.stderr
    assert "'lookup' more than once (UPSTREAM_DUPLICATE_TOOL)" in done.stderr
    assert list(tmp_path.iterdir()) == []
