"""`toolgate policy test DIR` against a real (embedded) ClickHouse audit store."""

from __future__ import annotations

import asyncio
import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from tests.integration.test_audit_queries import RESEARCHER, T0, WRITER, Story, messages
from toolgate.cli.main import main
from toolgate.contracts.calls import ToolError
from toolgate.contracts.events import CallDenied
from toolgate.contracts.registry import AuditSpec, Registry, load_registry
from toolgate.services.audit.chain import ensure_seal_key
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import RowBuilder
from toolgate.services.audit.writer import AuditWriter
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR

FORBID = (
    '@id("no-search-for-researcher")\n@error_code("POLICY_DENIED")\n'
    '@reason("researchers may not search")\nforbid (principal, action, resource)\n'
    'when { context.agent == Agent::"researcher" && '
    'resource == Tool::"search_sources" };\n'
)
SINCE = (T0 - timedelta(hours=1)).isoformat()


def sink_registry() -> Registry:
    """The registry the sink recorded with: echo's arguments only hashed, one more tool."""
    tools = {spec.name: spec for spec in load_registry()}
    tools["echo"] = tools["echo"].model_copy(update={"audit": AuditSpec(arguments="hash")})
    tools["wire_money"] = tools["echo"].model_copy(
        update={
            "name": "wire_money",
            "risk": "critical",
            "requires_approval": True,
            "audit": AuditSpec(),
        }
    )
    return Registry(tools)


def stories() -> list[Story]:
    found = []
    for i, (call_id, tool, who) in enumerate(
        [
            ("rs-1", "search_sources", RESEARCHER),
            ("rs-2", "search_sources", RESEARCHER),
            ("ws-1", "search_sources", WRITER),
            ("rf-1", "fetch_document", RESEARCHER),
            ("re-1", "echo", RESEARCHER),
        ]
    ):
        found.append(Story(call_id, tool, who, T0 + timedelta(seconds=i)).validated().authorized())
    found.append(
        Story("rl-1", "search_sources", RESEARCHER, T0 + timedelta(seconds=10))
        .validated()
        .add(
            CallDenied,
            status="denied",
            policy_version="pv-1",
            error=ToolError(code="RATE_LIMITED", message="slow down"),
        )
    )
    found.append(
        Story("wm-1", "wire_money", WRITER, T0 + timedelta(seconds=20))
        .validated()
        .approval("u-boss", True)
        .authorized()
    )
    found.append(
        Story("old-1", "search_sources", RESEARCHER, T0 - timedelta(hours=2))
        .validated()
        .authorized()
    )
    return found


async def record(url: str, keys: Path) -> None:
    writer = AuditWriter(
        ClickHouseTarget.from_url(url),
        RowBuilder(sink_registry()),
        ensure_seal_key(keys),
        "test-sink",
    )
    await writer.start()
    batch = messages(stories())
    await writer.write([m for m in batch if m.stream == "TOOLGATE_CALLS"])  # type: ignore[misc]
    await writer.write([m for m in batch if m.stream == "TOOLGATE_EVENTS"])  # type: ignore[misc]
    await writer.close()


@pytest.fixture(scope="module")
def history_url(clickhouse_server, tmp_path_factory):  # type: ignore[no-untyped-def]
    url = clickhouse_server.url_for("admin", "policy_history")
    asyncio.run(record(url, tmp_path_factory.mktemp("keys")))
    return url


def candidate_dir(tmp_path: Path, extra: str) -> Path:
    directory = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, directory)
    (directory / "candidate.cedar").write_text(extra)
    return directory


def run(capsys, bundle: Path, url: str, *extra: str) -> tuple[int, str]:  # type: ignore[no-untyped-def]
    code = main(["policy", "test", str(bundle), "--since", SINCE, "--clickhouse-url", url, *extra])
    return code, capsys.readouterr().out


def test_candidate_forbid_turns_allows_into_denies(history_url, tmp_path, capsys):
    code, out = run(capsys, candidate_dir(tmp_path, FORBID), history_url, "--format", "json")
    assert code == 1
    report = json.loads(out)
    assert report["calls"] == 7  # old-1 was decided before --since
    assert report["changed"] == 2
    assert report["summary"] == {
        "allow -> deny": 2,
        "unchanged": 2,
        "skipped: arguments not stored": 1,
        "not comparable: rate limited": 1,
        "tool not registered": 1,
    }
    assert report["by_tool"] == {"search_sources": {"allow -> deny": 2}}
    assert report["by_agent"] == {"researcher": {"allow -> deny": 2}}
    assert report["examples"]["allow -> deny"] == ["rs-1", "rs-2"]
    assert report["examples"]["skipped: arguments not stored"] == ["re-1"]
    assert report["examples"]["tool not registered"] == ["wm-1"]


def test_text_output(history_url, tmp_path, capsys):
    code, out = run(capsys, candidate_dir(tmp_path, FORBID), history_url, "--limit", "1")
    assert code == 1
    assert "2 would change" in out and "allow -> deny" in out
    assert "changes by tool:" in out and "changes by agent:" in out
    assert "allow -> deny: rs-1\n" in out + "\n"


def test_unchanged_bundle_changes_nothing(history_url, capsys):
    code, out = run(capsys, DEFAULT_BUNDLE_DIR, history_url, "--format", "json")
    assert code == 0
    report = json.loads(out)
    assert report["changed"] == 0 and report["summary"]["unchanged"] == 4


def test_bad_bundle_exits_2(history_url, tmp_path, capsys):
    code = main(
        [
            "policy",
            "test",
            str(candidate_dir(tmp_path, "forbid (oops")),
            "--clickhouse-url",
            history_url,
        ]
    )
    assert code == 2
    assert "rejected" in capsys.readouterr().err


def test_first_decision_is_the_one_before_approval(history_url):
    from toolgate.cli.policy_history import APPROVAL, parse_since, read_recorded

    recorded = {
        r.call_id: r
        for r in read_recorded(ClickHouseTarget.from_url(history_url).client(), parse_since(SINCE))
    }
    assert recorded["wm-1"].decision == APPROVAL and recorded["wm-1"].required_approvals == 1
    assert recorded["re-1"].call is None and recorded["rs-1"].call is not None
