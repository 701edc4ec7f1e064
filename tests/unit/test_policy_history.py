"""`toolgate policy test`: classifying decision changes and counting them (no ClickHouse)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from toolgate.cli.policy_history import (
    ALLOW,
    APPROVAL,
    DENY,
    NOT_COMPARABLE,
    NOT_REGISTERED,
    SKIPPED,
    UNCHANGED,
    Recorded,
    classify,
    evaluate_history,
    parse_since,
)
from toolgate.contracts.calls import Principal, ToolCall, ToolError
from toolgate.contracts.registry import load_registry
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, build_bundle, read_bundle_dir
from toolgate.services.policy.rules import Decision

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
FORBID = (
    '@id("no-search-for-researcher")\n@error_code("POLICY_DENIED")\n'
    '@reason("researchers may not search")\nforbid (principal, action, resource)\n'
    'when { context.agent == Agent::"researcher" && '
    'resource == Tool::"search_sources" };\n'
)

ALLOWED = Decision(allowed=True, policy_version="v")
DENIED = Decision(allowed=False, policy_version="v", error=ToolError(code="X", message="x"))
GATED = Decision(allowed=False, policy_version="v", requires_approval=True, required_approvals=2)


def recorded(
    call_id: str, tool: str, agent: str, decision: str, code: str = "", with_call: bool = True
) -> Recorded:
    call = ToolCall(
        call_id=call_id,
        tool=tool,
        principal=Principal(tenant="acme", user="u", agent=agent, session="s"),
        arguments={"query": "cedar", "source_type": "any", "limit": 3},
    )
    return Recorded(call_id, tool, agent, decision, code, 0, call if with_call else None, NOW)


def bundles():  # type: ignore[no-untyped-def]
    files = read_bundle_dir(DEFAULT_BUNDLE_DIR)
    return build_bundle(files), build_bundle({**files, "candidate.cedar": FORBID})


@pytest.mark.parametrize(
    ("old", "new", "kind"),
    [
        (ALLOW, ALLOWED, UNCHANGED),
        (DENY, DENIED, UNCHANGED),
        (APPROVAL, GATED, UNCHANGED),
        (ALLOW, DENIED, "allow -> deny"),
        (DENY, ALLOWED, "deny -> allow"),
        (ALLOW, GATED, "allow -> approval (approval newly required)"),
        (DENY, GATED, "deny -> approval (approval newly required)"),
        (APPROVAL, ALLOWED, "approval -> allow (approval no longer required)"),
        (APPROVAL, DENIED, "approval -> deny (approval no longer required)"),
    ],
)
def test_classify(old, new, kind):
    assert classify(Recorded("c", "t", "a", old), new) == kind


def test_classify_approver_count_change():
    assert (
        classify(Recorded("c", "t", "a", APPROVAL, required_approvals=1), GATED)
        == "approvals 1 -> 2"
    )


def test_parse_since():
    assert parse_since("24h", NOW) == NOW - timedelta(hours=24)
    assert parse_since("30m", NOW) == NOW - timedelta(minutes=30)
    assert parse_since("7d", NOW) == NOW - timedelta(days=7)
    assert parse_since("2026-03-01T09:00:00") == datetime(2026, 3, 1, 9, tzinfo=UTC)
    with pytest.raises(ValueError):
        parse_since("yesterday")


def test_candidate_bundle_changes_and_counts():
    default, candidate = bundles()
    calls = [
        recorded("r1", "search_sources", "researcher", ALLOW),
        recorded("r2", "search_sources", "researcher", ALLOW),
        recorded("w1", "search_sources", "writer", ALLOW),
        recorded("e1", "echo", "researcher", ALLOW),
        recorded("h1", "search_sources", "researcher", ALLOW, with_call=False),
        recorded("rl", "search_sources", "researcher", DENY, code="RATE_LIMITED"),
        recorded("gone", "retired_tool", "researcher", ALLOW),
    ]
    report = evaluate_history(candidate, load_registry(), calls, NOW)
    kinds = {o.recorded.call_id: o.kind for o in report.outcomes}
    assert kinds == {
        "r1": "allow -> deny",
        "r2": "allow -> deny",
        "w1": UNCHANGED,
        "e1": UNCHANGED,
        "h1": SKIPPED,
        "rl": NOT_COMPARABLE,
        "gone": NOT_REGISTERED,
    }
    assert report.summary()["allow -> deny"] == 2
    assert report.by("tool") == {"search_sources": {"allow -> deny": 2}}
    assert report.by("agent") == {"researcher": {"allow -> deny": 2}}
    assert report.examples(1)["allow -> deny"] == ["r1"]
    out = report.to_json(5)
    assert out["changed"] == 2 and out["examples"][SKIPPED] == ["h1"]
    text = report.text(5)
    assert "allow -> deny" in text and "search_sources" in text and "r1 r2" in text
    unchanged = evaluate_history(default, load_registry(), calls, NOW)
    assert unchanged.changed == []
