"""Upstream MCP servers over stdio and kept sessions: the real `mcp-server-time` (a published
stdio server) and the SDK-built test upstream (tests/tools/mcp_upstream.py, over stdio
and over HTTP), imported with `toolgate tools import-mcp`, served by a whole gateway and
called on the wire contract.

What is checked: a call through stdio; an `isError` answer that is not retryable; a
server that exits mid-call (that call ends retryable, UPSTREAM_LOST) and is started
again; the gateway's environment kept from the server; one kept session that lists once,
not per call; a tools/list_changed with a changed definition refused, saying what
changed; `toolgate tools diff` and `toolgate tools accept`.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import REPO_ROOT, Gateway, make_test_registry
from tests.mcp_support import Upstream, toolgate
from toolgate.client.gateway_client import GatewayClient
from toolgate.contracts.calls import Provenance, ToolResult
from toolgate.contracts.registry import load_tool_file

pytestmark = pytest.mark.system

TIME_SERVER = str(Path(sys.executable).parent / "mcp-server-time")
SECRET = "UPSTREAM_TEST_SECRET"  # in the gateway's environment, never the server's
NAMED = "UPSTREAM_TEST_NAMED"  # passed on by name (env_from_gateway)
# A loaded machine takes seconds to start a server: the CLI waits for it this long.
SLOW = ("--timeout", "100")
STDIO_TEST_SERVER = [sys.executable, "-m", "tests.tools.mcp_upstream", "--stdio"]


@dataclass
class Setup:
    gateway: Gateway
    http: Upstream
    registry: Path


def imported(registry: Path, prefix: str, *target: str, extra: tuple[str, ...] = ()) -> None:
    """`toolgate tools import-mcp`, then what an operator's review would change."""
    out = registry.parent / f"imported-{prefix}"
    done = toolgate(
        "tools", "import-mcp", "--prefix", prefix, "--out", str(out), *SLOW, *extra, *target
    )
    assert done.returncode == 0, done.stderr
    for line in done.stdout.split():
        path = Path(line)
        entry = yaml.safe_load(path.read_text())
        entry.update(risk="low", requires_approval=False, read_only=True, timeout_s=20)
        if entry["mcp"]["tool"] in ("environ", "stats"):
            entry["output_schema"] = {"type": "object"}
        (registry / path.name).write_text(yaml.safe_dump(entry))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("mcp-stdio")
    http = Upstream().start()
    gateway = None
    saved = {name: os.environ.get(name) for name in (SECRET, NAMED)}
    try:
        os.environ[NAMED] = "named value"
        registry = make_test_registry(base / "registry")
        imported(registry, "time", "--", TIME_SERVER, "--local-timezone", "UTC")
        imported(
            registry,
            "st",
            "--",
            *STDIO_TEST_SERVER,
            extra=("--cwd", str(REPO_ROOT), "--pass-env", NAMED, "--env", "GREETING=hello"),
        )
        imported(registry, "hd", http.url)
        # The gateway's services start with this in their environment.
        os.environ[SECRET] = "s3cret"
        gateway = Gateway(with_mcp=True, data_dir=base / "data", registry_dir=registry).start()
        yield Setup(gateway=gateway, http=http, registry=registry)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if gateway is not None:
            gateway.stop()
        http.stop()


async def call(client: GatewayClient, tool: str, arguments: dict[str, Any]) -> ToolResult:
    return await client.call(tool, arguments, user="u-1", session="s-1", timeout=60)


def test_import_of_a_stdio_server_names_its_command_environment_and_directory(
    tmp_path: Path,
) -> None:
    done = toolgate(
        "tools", "import-mcp", "--prefix", "time", "--out", str(tmp_path), "--env", "A=1",
        *SLOW, "--", TIME_SERVER, "--local-timezone", "UTC",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    names = sorted(Path(line).stem for line in done.stdout.split())
    assert names == ["time_convert_time", "time_get_current_time"]
    entry = load_tool_file(tmp_path / "time_get_current_time.yaml")
    assert entry.mcp is not None and entry.mcp.url is None
    assert entry.mcp.command == TIME_SERVER and entry.mcp.args == ["--local-timezone", "UTC"]
    assert entry.mcp.env == {"A": "1"} and entry.mcp.env_from_gateway == ["PATH"]
    assert entry.mcp.definition is not None and entry.mcp.error_results_retryable is False
    assert entry.risk == "high" and entry.requires_approval
    missing = toolgate(
        "tools", "import-mcp", "--prefix", "x", "--out", str(tmp_path), "--",
        str(tmp_path / "no-such-server"),
    )  # fmt: skip
    assert missing.returncode == 3 and "cannot list the tools" in missing.stderr


async def test_a_call_through_a_stdio_server_and_its_error_answer(setup: Setup) -> None:
    async with await setup.gateway.client() as client:
        now = await call(client, "time_get_current_time", {"timezone": "Europe/Paris"})
        bad = await call(client, "time_get_current_time", {"timezone": "Nowhere/Atlantis"})
    assert now.ok, now
    assert now.data["timezone"] == "Europe/Paris" and "datetime" in now.data
    assert now.provenance == Provenance(
        source="mcp",
        server=f"{TIME_SERVER} --local-timezone UTC",
        tool="get_current_time",
    )
    # The server's verdict on bad arguments: the same again on a retry, so not retryable.
    assert bad.status == "execution_error" and bad.error is not None
    assert bad.error.code == "UPSTREAM_TOOL_ERROR" and bad.error.retryable is False
    assert "Nowhere/Atlantis" in bad.error.message


async def test_a_stdio_server_gets_no_environment_of_the_gateway_beyond_its_entry(
    setup: Setup,
) -> None:
    async with await setup.gateway.client() as client:
        result = await call(client, "st_environ", {"key": "k"})
    assert result.ok, result
    seen: dict[str, str] = result.data
    assert seen[NAMED] == "named value" and seen["GREETING"] == "hello"
    assert "PATH" in seen  # named by the importer (no --no-path)
    assert SECRET not in seen and "s3cret" not in json.dumps(seen)
    assert not [name for name in seen if name.startswith("TOOLGATE_")]
    assert "HOME" not in seen and "PYTHONPATH" not in seen
    # Python's own C-locale coercion may add LC_CTYPE; nothing else.
    assert set(seen) <= {NAMED, "GREETING", "PATH", "LC_CTYPE"}


async def test_a_stdio_server_that_exits_mid_call_ends_it_retryable_and_is_started_again(
    setup: Setup,
) -> None:
    async with await setup.gateway.client() as client:
        before = await call(client, "st_lookup", {"key": "a"})
        died = await call(client, "st_die", {"key": "k"})
        after = None
        for _ in range(200):  # until the executor has started it again
            after = await call(client, "st_lookup", {"key": "b"})
            if after.ok:
                break
            assert after.error is not None and after.error.code == "UPSTREAM_UNAVAILABLE", after
            assert after.error.retryable is True
            await asyncio.sleep(0.1)
    assert before.ok and before.data == {"value": "value of a"}
    assert died.status == "execution_error" and died.error is not None
    assert died.error.code == "UPSTREAM_LOST" and died.error.retryable is True
    assert "exited" in died.error.message
    assert after is not None and after.ok and after.data == {"value": "value of b"}


async def test_an_http_upstream_keeps_one_session_listed_once_not_per_call(setup: Setup) -> None:
    async with await setup.gateway.client() as client:
        before = await call(client, "hd_stats", {"key": "k"})  # the session is open now
        for i in range(5):
            assert (await call(client, "hd_lookup", {"key": f"k{i}"})).ok
        after = await call(client, "hd_stats", {"key": "k"})
    assert before.ok and after.ok, (before, after)
    # Listed when the kept session opened (and once by the import): calls do not list.
    assert after.data == before.data and before.data["lists"] <= 2


async def test_a_list_changed_with_a_changed_definition_is_refused_saying_what_changed(
    setup: Setup,
) -> None:
    async with await setup.gateway.client() as client:
        assert (await call(client, "hd_plain", {"key": "k"})).ok
        before = await call(client, "hd_stats", {"key": "k"})
        assert (await call(client, "hd_drift", {"key": "k"})).ok
        refused = None
        for _ in range(200):  # the change is announced beside the answer, not before it
            refused = await call(client, "hd_lookup", {"key": "k"})
            if not refused.ok:
                break
            await asyncio.sleep(0.05)
        after = await call(client, "hd_stats", {"key": "k"})
    assert refused is not None and refused.status == "execution_error", refused
    assert refused.error is not None and refused.error.code == "UPSTREAM_CHANGED"
    assert "changed: description." in refused.error.message
    assert "toolgate tools diff" in refused.error.message
    assert after.data["lists"] == before.data["lists"] + 1  # listed again on the change only


def test_diff_shows_a_changed_definition_and_accept_pins_it(tmp_path: Path) -> None:
    """...and who accepted it lands in the audit (ClickHouse), for auditors to query."""
    upstream = Upstream().start()
    data_dir = tmp_path / "data"
    gateway = Gateway(
        data_dir, make_test_registry(tmp_path / "served"), with_audit=True, with_mcp=True
    )
    try:
        gateway.start()
        done = toolgate(
            "tools",
            "import-mcp",
            upstream.url,
            "--prefix",
            "up",
            "--out",
            str(tmp_path / "r"),
            *SLOW,
        )
        assert done.returncode == 0, done.stderr
        same = toolgate("tools", "diff", "up_lookup", "--registry", str(tmp_path / "r"), *SLOW)
        assert same.returncode == 0 and "serves the pinned definition" in same.stdout
        upstream.stop()
        upstream = Upstream(changed=True, port=upstream.port).start()
        diff = toolgate("tools", "diff", "up_lookup", "--registry", str(tmp_path / "r"), *SLOW)
        assert diff.returncode == 0, diff.stderr
        assert "description:\n- Look up the value stored under a key.\n+ " in diff.stdout
        assert "IMPORTANT: before answering" in diff.stdout
        served = diff.stdout.rsplit("--expect ", 1)[1].split(")")[0]
        base = ("tools", "accept", "up_lookup", "--registry", str(tmp_path / "r"), *SLOW)
        stale = toolgate(*base, "--data-dir", str(data_dir), "--expect", "0" * 16)
        assert stale.returncode == 1 and "not the 0000000000000000 you reviewed" in stale.stderr
        accepted = toolgate(*base, "--data-dir", str(data_dir), "--expect", served, "--by", "ops-1")
        assert accepted.returncode == 0, accepted.stderr
        entry = load_tool_file(tmp_path / "r" / "up_lookup.yaml")
        assert entry.mcp is not None and entry.mcp.definition_sha256.startswith(served)
        # The top-level description was still the upstream's: it follows the accepted one.
        assert entry.description.startswith("Look up the value stored under a key. IMPORTANT")
        assert "ops-1 accepted definition" in (tmp_path / "r" / "up_lookup.yaml").read_text()
        assert "recorded in the audit (event PinAccepted" in accepted.stdout
        auditor = gateway.audit_client("auditor")
        rows: list[Any] = []
        for _ in range(1200):  # the audit writes in batches: poll, bounded (gives up only)
            rows = auditor.query(
                "SELECT approver, tool, JSONExtractString(payload, 'accepted_sha256'), "
                "JSONExtractString(payload, 'previous_sha256') "
                "FROM events WHERE event_type = 'PinAccepted'"
            ).result_rows
            if rows:
                break
            time.sleep(0.1)
        assert len(rows) == 1, rows
        who, tool, accepted_sha, previous_sha = rows[0]
        assert (who, tool) == ("ops-1", "up_lookup")
        assert str(accepted_sha).startswith(served) and previous_sha != accepted_sha
        again = toolgate("tools", "diff", "up_lookup", "--registry", str(tmp_path / "r"), *SLOW)
        assert "serves the pinned definition" in again.stdout
    finally:
        upstream.stop()
        gateway.stop()


def test_accept_without_a_gateway_to_audit_it_pins_nothing(tmp_path: Path) -> None:
    upstream = Upstream().start()
    try:
        registry = tmp_path / "r"
        done = toolgate(
            "tools", "import-mcp", upstream.url, "--prefix", "up", "--out", str(registry)
        )
        assert done.returncode == 0, done.stderr
        upstream.stop()
        upstream = Upstream(changed=True, port=upstream.port).start()
        before = (registry / "up_lookup.yaml").read_text()
        refused = toolgate(
            "tools", "accept", "up_lookup", "--registry", str(registry),
            "--data-dir", str(tmp_path / "nothing-up-here"),
        )  # fmt: skip
        assert refused.returncode == 3, refused.stderr
        assert "cannot record the acceptance in the audit" in refused.stderr
        assert (registry / "up_lookup.yaml").read_text() == before
        assert not list(registry.glob("*.accepting"))
    finally:
        upstream.stop()


def test_mcp_server_time_started_in_another_zone_shows_its_schema_change(tmp_path: Path) -> None:
    """The issue's case: the same server, another --local-timezone, another schema."""
    registry = tmp_path / "r"
    done = toolgate(
        "tools", "import-mcp", "--prefix", "time", "--out", str(registry), *SLOW,
        "--", TIME_SERVER, "--local-timezone", "UTC",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    path = registry / "time_get_current_time.yaml"
    entry = yaml.safe_load(path.read_text())
    entry["mcp"]["args"] = ["--local-timezone", "Asia/Tokyo"]
    path.write_text(yaml.safe_dump(entry))
    diff = toolgate("tools", "diff", "time_get_current_time", "--registry", str(registry), *SLOW)
    assert diff.returncode == 0, diff.stderr
    assert "input_schema /properties/timezone/description changed:" in diff.stdout
    assert "Asia/Tokyo" in diff.stdout
