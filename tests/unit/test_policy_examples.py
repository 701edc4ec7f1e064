"""The worked policy examples (docs/policy-examples.md), loaded into a real bundle and decided."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import Registry, ToolSpec
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, build_bundle, read_bundle_dir
from toolgate.services.policy.engine import CedarEngine
from toolgate.services.policy.entities import MAX_ARGUMENT_CHARS
from toolgate.services.policy.rules import Decision
from toolgate.services.validator.logic import CallChecker, Identity, Rejected, Validated

EXAMPLE = Path(__file__).resolve().parents[2] / "infra/policies/examples/refund_payment.cedar"
REFUND = ToolSpec(
    name="refund_payment",
    description="Refund a payment.",
    function="x.y:z",
    input_schema={"type": "object", "properties": {"amount": {"type": "integer"}}},
    output_schema={"type": "object"},
    read_only=False,
    timeout_s=5,
    risk="medium",
    allowed_agents=["support", "researcher"],
)


def engine() -> CedarEngine:
    files = read_bundle_dir(DEFAULT_BUNDLE_DIR)
    files["refund_payment.cedar"] = EXAMPLE.read_text()
    return CedarEngine(build_bundle(files))


def refund(amount: int, agent: str = "support") -> ToolCall:
    return ToolCall(
        call_id="c1",
        tool="refund_payment",
        arguments={"amount": amount},
        principal=Principal("acme", "u-carol", agent, "s-1"),
    )


def test_small_refund_by_support_agent_is_allowed() -> None:
    decision = engine().decide(refund(100), REFUND)
    assert decision.allowed and not decision.requires_approval


def test_refund_above_500_needs_two_approvers() -> None:
    decision = engine().decide(refund(900), REFUND)
    assert not decision.allowed and decision.requires_approval
    assert decision.required_approvals == 2
    assert "refund-two-approvers-above-500" in decision.policy_ids


def test_refund_by_another_agent_is_denied_whatever_the_amount() -> None:
    decision = engine().decide(refund(100, agent="researcher"), REFUND)
    assert not decision.allowed and not decision.requires_approval
    assert decision.error is not None and decision.error.code == "TOOL_NOT_ALLOWED"


# ------------------------------------------------ amounts the policy might not see
# Each must be denied, or sent to two approvers; never allowed without them.

SUPPORT = Identity(tenant="acme", agent="support")


def refund_raw(amount: bytes) -> bytes:
    principal = msgspec.json.encode(Principal("acme", "u-carol", "support", "s-1"))
    return (
        b'{"call_id": "c1", "tool": "refund_payment", "arguments": {"amount": '
        + amount
        + b'}, "principal": '
        + principal
        + b"}"
    )


def validated_then_decided(amount: bytes) -> Rejected | Decision:
    """What the validator and then the policy make of a refund sent with this JSON amount."""
    checker = CallChecker(Registry({REFUND.name: REFUND}), max_call_bytes=64 * 1024)
    outcome = checker.check(refund_raw(amount), SUPPORT)
    if isinstance(outcome, Rejected):
        return outcome
    assert isinstance(outcome, Validated)
    return engine().decide(outcome.call, REFUND)


@pytest.mark.parametrize("amount", [b"900.0", b"9e2", b"9.0E2"])
def test_integral_float_amounts_above_500_need_two_approvers_like_900(amount: bytes) -> None:
    decision = validated_then_decided(amount)
    assert isinstance(decision, Decision)
    assert decision.awaits_approval and decision.required_approvals == 2
    assert decision.policy_ids == ["refund-two-approvers-above-500"]


def test_an_amount_beyond_cedars_integers_is_denied_naming_it() -> None:
    decision = validated_then_decided(b"1e20")
    assert isinstance(decision, Decision) and not decision.allowed
    assert not decision.awaits_approval
    assert decision.error is not None and decision.error.code == "POLICY_DENIED"
    assert "/amount" in decision.error.message


@pytest.mark.parametrize("amount", [b'"' + b"9" * 300 + b'"', b"900.5"])
def test_amounts_that_are_not_integers_never_reach_the_policy(amount: bytes) -> None:
    outcome = validated_then_decided(amount)
    assert isinstance(outcome, Rejected) and outcome.status == "invalid_arguments"


@pytest.mark.parametrize(
    "amount", [900.0, 9e2, 1e20, 10**20, "9" * 300, "x" * 300, "9" * (MAX_ARGUMENT_CHARS + 1)]
)
def test_engine_alone_never_allows_an_amount_it_cannot_compare(amount: object) -> None:
    # Past a schema that does not say "integer" (an upstream tool, a lax registry
    # entry): the policy itself denies, with or without approvers.
    lax = REFUND.model_copy(update={"input_schema": {"type": "object"}})
    call = msgspec.structs.replace(refund(100), arguments={"amount": amount})
    for approvers in ((), ("ann", "bob")):
        decision = engine().decide(call, lax, approvers)
        assert not decision.allowed and not decision.awaits_approval, (amount, approvers)
        assert decision.error is not None
        assert decision.error.code in ("POLICY_DENIED", "POLICY_ERROR")
