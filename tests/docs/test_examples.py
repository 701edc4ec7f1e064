"""The refund example docs/policy-examples.md runs: its registry, bundle and tool (package data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolgate.contracts.calls import Principal
from toolgate.contracts.registry import load_registry
from toolgate.contracts.tooling import ToolContext, ToolRefused
from toolgate.infra.examples import refund
from toolgate.infra.examples.refund.refund import read_refunds, refund_payment
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, build_bundle, read_bundle_dir

REPO_ROOT = Path(__file__).resolve().parents[2]


def context(data_dir: Path, call_id: str, agent: str = "support") -> ToolContext:
    return ToolContext(
        call_id=call_id,
        tool="refund_payment",
        principal=Principal("acme", "u-carol", agent, "s-1"),
        task_id=None,
        data_dir=data_dir,
    )


def test_registry_declares_refund_payment_for_the_support_agent() -> None:
    spec = load_registry(refund.REGISTRY_DIR).get("refund_payment")
    assert spec is not None and spec.allowed_agents == ["support"] and spec.idempotent
    assert spec.input_schema["properties"]["amount"]["type"] == "integer"  # cents, exact


def test_bundle_is_the_default_bundle_plus_the_shipped_example(tmp_path: Path) -> None:
    written = refund.prepare(tmp_path)
    assert written == tmp_path / "examples" / "refund" / "policy"
    files = read_bundle_dir(written)
    expected = read_bundle_dir(DEFAULT_BUNDLE_DIR)
    expected["refund_payment.cedar"] = (
        REPO_ROOT / "infra/policies/examples/refund_payment.cedar"
    ).read_text()
    assert files == expected
    assert "refund-two-approvers-above-500" in build_bundle(files).policies


def test_prepare_keeps_a_bundle_file_changed_on_purpose(tmp_path: Path) -> None:
    changed = refund.prepare(tmp_path) / "refund_payment.cedar"
    changed.write_text("// mine\n")
    refund.prepare(tmp_path)
    assert changed.read_text() == "// mine\n"


def test_a_refund_is_recorded_once_per_call_and_a_payment_refunded_once(tmp_path: Path) -> None:
    arguments = {"payment_id": "pay_1001", "amount": 900, "reason": "damaged"}
    first = refund_payment(arguments, context(tmp_path, "c1"))
    again = refund_payment(arguments, context(tmp_path, "c1"))  # the executor ran it again
    assert first["duplicate"] is False and again["duplicate"] is True
    assert {k: v for k, v in again.items() if k != "duplicate"} == {
        k: v for k, v in first.items() if k != "duplicate"
    }
    with pytest.raises(ToolRefused, match="already refunded"):
        refund_payment(arguments, context(tmp_path, "c2"))
    rows = read_refunds(tmp_path, "acme")
    assert [(r["call_key"], r["amount"]) for r in rows] == [("acme.support.c1", 900)]
