"""The README's worked policy examples, loaded into a real bundle and decided."""

from __future__ import annotations

from pathlib import Path

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import ToolSpec
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, build_bundle, read_bundle_dir
from toolgate.services.policy.engine import CedarEngine

EXAMPLE = Path(__file__).resolve().parents[2] / "infra/policies/examples/refund_payment.cedar"
REFUND = ToolSpec(
    name="refund_payment", description="Refund a payment.", function="x.y:z",
    input_schema={"type": "object", "properties": {"amount": {"type": "integer"}}},
    output_schema={"type": "object"}, read_only=False, timeout_s=5, risk="medium",
    allowed_agents=["support", "researcher"])


def engine() -> CedarEngine:
    files = read_bundle_dir(DEFAULT_BUNDLE_DIR)
    files["refund_payment.cedar"] = EXAMPLE.read_text()
    return CedarEngine(build_bundle(files))


def refund(amount: int, agent: str = "support") -> ToolCall:
    return ToolCall(call_id="c1", tool="refund_payment", arguments={"amount": amount},
                    principal=Principal("acme", "u-carol", agent, "s-1"))


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
