"""Deciding a recorded call again, here (cli/redecide.py): validation, policy, approval rule."""

from __future__ import annotations

from datetime import UTC, datetime

from toolgate.cli.redecide import (
    ALLOW,
    DENY,
    REJECTED,
    Recorded,
    RecordedClock,
    Verdict,
    differences,
    redecide,
)
from toolgate.contracts.calls import MAX_CALL_BYTES
from toolgate.contracts.registry import load_registry
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, build_bundle, read_bundle_dir
from toolgate.services.policy.engine import CedarEngine
from toolgate.services.validator.logic import CallChecker, Identity

AT = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
WRITER = Identity("acme", "writer")
FORBID = (
    '@id("no-evidence")\n@error_code("POLICY_DENIED")\n@reason("no")\n'
    "forbid (principal, action, resource)\n"
    'when { context.tool == Tool::"save_evidence" };\n'
)


def published(task: str = "t1", **arguments: object) -> dict[str, object]:
    return {
        "call_id": "c1",
        "tool": "save_evidence",
        "task_id": "t1",
        "arguments": {"task_id": task, "claim": "c", "source_url": "https://x.org", **arguments},
        "principal": {"tenant": "acme", "agent": "writer", "user": "u", "session": "s"},
    }


def engine(*extra: str) -> tuple[CedarEngine, RecordedClock]:
    files = read_bundle_dir(DEFAULT_BUNDLE_DIR)
    files.update({f"extra{i}.cedar": text for i, text in enumerate(extra)})
    clock = RecordedClock()
    return CedarEngine(build_bundle(files), clock=clock), clock


def again(call: dict[str, object], recorded: Recorded, *extra: str):  # type: ignore[no-untyped-def]
    cedar, clock = engine(*extra)
    checker = CallChecker(load_registry(), MAX_CALL_BYTES)
    return redecide(call, "", WRITER, recorded, checker, cedar, clock, "c1", "save_evidence")


def allowed_then() -> Recorded:
    cedar, _ = engine()
    checker = CallChecker(load_registry(), MAX_CALL_BYTES)
    decided = redecide(published(), "", WRITER, None, checker, cedar, RecordedClock(), "c1", "x")
    assert decided.now is not None and decided.now.kind == ALLOW
    return Recorded(
        "c1", "save_evidence", "writer", ALLOW, at=AT, tenant="acme",
        policy_ids=list(decided.now.policy_ids),
    )  # fmt: skip


def test_the_same_rules_decide_the_same():
    outcome = again(published(), allowed_then())
    assert outcome.same is True
    assert "SAME decision" in outcome.text("v")


def test_a_new_forbid_is_named_field_by_field():
    outcome = again(published(), allowed_then(), FORBID)
    assert outcome.same is False
    assert outcome.now == Verdict(DENY, "denied", "POLICY_DENIED", ("no-evidence",))
    text = outcome.text("v2").splitlines()[0]
    assert "DIFFERENT decision: decision allow -> deny; status - -> denied; " in text
    assert "error code - -> POLICY_DENIED; policies " in text
    assert text.endswith(" -> no-evidence")


def test_validation_runs_first_as_the_validator_does():
    outcome = again(published(confidence="certain"), allowed_then())
    assert outcome.now is not None and outcome.now.kind == REJECTED
    assert (outcome.now.status, outcome.now.error_code) == (
        "invalid_arguments",
        "SCHEMA_VALIDATION_FAILED",
    )
    # A payload naming another agent than the bus recorded is refused, as it was.
    claim = {"tenant": "acme", "agent": "researcher", "user": "u", "session": "s"}
    other = {**published(), "principal": claim}
    then = Recorded(
        "c1", "save_evidence", "writer", REJECTED, "PRINCIPAL_MISMATCH", status="denied"
    )
    assert again(other, then).same is True


def test_what_cannot_be_compared_says_why():
    rate_limited = Recorded("c1", "save_evidence", "writer", DENY, "RATE_LIMITED", status="denied")
    outcome = again(published(), rate_limited)
    assert outcome.same is None and "rate limited" in outcome.text("v")
    assert again(published(), None).same is None  # type: ignore[arg-type]
    cedar, clock = engine()
    checker = CallChecker(load_registry(), MAX_CALL_BYTES)
    hashed = redecide(None, "not kept", WRITER, None, checker, cedar, clock, "c1", "echo")
    assert hashed.same is None and "NOT COMPARED decision: not kept" in hashed.text("v")


def test_differences_lists_only_what_changed():
    then = Verdict("approval", required_approvals=1, policy_ids=("a",))
    assert differences(then, then) == []
    assert differences(then, Verdict("approval", required_approvals=2, policy_ids=("a",))) == [
        "approvers needed 1 -> 2"
    ]
