"""The policy service's decision flow, without NATS: a decision in, the event out."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from toolgate.contracts.authorization import arguments_sha256, verify
from toolgate.contracts.calls import Principal, ToolCall, ToolError
from toolgate.contracts.events import (
    ApprovalGranted,
    ApprovalRequested,
    ArgumentsValidated,
    CallAuthorized,
    CallDenied,
    call_fields,
    utc_now,
)
from toolgate.contracts.registry import RateLimit, load_registry
from toolgate.services.policy import logic
from toolgate.services.policy.rate_limits import RateCheck
from toolgate.services.policy.rules import Decision

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
KEY = Ed25519PrivateKey.generate()
SIGNER = logic.Signer(KEY, timedelta(minutes=5))
ECHO = load_registry().get("echo")
LIMITED = ECHO.model_copy(update={"rate_limit": RateLimit(calls=2, per_seconds=60)})  # type: ignore[union-attr]
NOW = utc_now()


def validated(arguments: dict[str, object] | None = None) -> ArgumentsValidated:
    call = ToolCall(
        call_id="c1",
        tool="echo",
        arguments=arguments or {"payload": "x"},
        principal=ALICE,
        task_id="t1",
    )
    return ArgumentsValidated(
        event_id="v1",
        occurred_at=NOW,
        service="validator",
        call=call,
        arguments_sha256=arguments_sha256(call.arguments),
        **call_fields(call),
    )


ALLOW = Decision(allowed=True, policy_version="v1", policy_ids=["registered-tool"], status="ok")
DENY = Decision(
    allowed=False,
    policy_version="v1",
    policy_ids=["no"],
    error=ToolError(code="POLICY_DENIED", message="no"),
)
ASK_TWO = Decision(
    allowed=False,
    policy_version="v1",
    policy_ids=["two"],
    requires_approval=True,
    required_approvals=2,
    error=ToolError(code="APPROVAL_REQUIRED", message="two approvers"),
)


class TestAfterValidation:
    def test_an_allowed_call_is_signed_for_exactly_its_six_tuple(self) -> None:
        event = logic.after_validation(validated(), "seq:1", ALLOW, ECHO, None, SIGNER, 900, NOW)
        assert isinstance(event, CallAuthorized)
        auth = event.authorization
        assert verify(auth, KEY.public_key())
        assert (auth.tenant, auth.agent, auth.user, auth.session, auth.task_id) == (
            "acme",
            "researcher",
            "u-alice",
            "s-1",
            "t1",
        )
        assert auth.arguments_sha256 == arguments_sha256({"payload": "x"})
        assert auth.expires_at == NOW + timedelta(minutes=5)

    def test_a_denial_carries_the_engines_reason_and_policies(self) -> None:
        event = logic.after_validation(validated(), "seq:1", DENY, ECHO, None, SIGNER, 900, NOW)
        assert isinstance(event, CallDenied)
        assert event.error.code == "POLICY_DENIED" and event.policy_ids == ["no"]

    def test_a_call_that_needs_humans_becomes_an_approval_request(self) -> None:
        event = logic.after_validation(validated(), "seq:1", ASK_TWO, ECHO, None, SIGNER, 900, NOW)
        assert isinstance(event, ApprovalRequested)
        assert event.required_approvals == 2
        assert event.expires_at == NOW + timedelta(seconds=900)
        assert event.reason == "two approvers"  # no rule's own reason: the engine's account
        ruled = replace(ASK_TWO, approval_reason="refunds over 500 need two people")
        event = logic.after_validation(validated(), "seq:1", ruled, ECHO, None, SIGNER, 900, NOW)
        assert isinstance(event, ApprovalRequested)
        assert event.reason == "refunds over 500 need two people"

    @pytest.mark.parametrize("decision", [ALLOW, ASK_TWO])
    def test_a_full_rate_limit_denies_before_anything_runs_or_a_human_is_asked(
        self, decision: Decision
    ) -> None:
        assert logic.needs_rate_check(decision, LIMITED)
        full = RateCheck(admitted=False, count=2, retry_after_s=12.0)
        event = logic.after_validation(
            validated(), "seq:1", decision, LIMITED, full, SIGNER, 900, NOW
        )
        assert isinstance(event, CallDenied)
        assert event.error.code == "RATE_LIMITED" and event.error.retryable

    def test_a_denied_call_does_not_use_up_a_rate_limit(self) -> None:
        assert not logic.needs_rate_check(DENY, LIMITED)
        assert not logic.needs_rate_check(ALLOW, ECHO)

    def test_every_outcome_of_one_message_has_the_same_event_id(self) -> None:
        # A redelivery that decides differently is then dropped as a duplicate.
        ids = {
            logic.after_validation(validated(), "seq:7", d, ECHO, None, SIGNER, 900, NOW).event_id
            for d in (ALLOW, DENY, ASK_TWO)
        }
        assert len(ids) == 1

    def test_arguments_changed_after_validation_are_named(self) -> None:
        event = validated()
        tampered = ArgumentsValidated(
            event_id="v1",
            occurred_at=NOW,
            service="validator",
            call=ToolCall(call_id="c1", tool="echo", arguments={"payload": "y"}, principal=ALICE),
            arguments_sha256=event.arguments_sha256,
            **call_fields(event.call),
        )
        assert logic.hash_problem(event) is None
        assert "do not match" in (logic.hash_problem(tampered) or "")


class TestAfterApproval:
    def granted(self, arguments: dict[str, object]) -> ApprovalGranted:
        call = validated().call
        return ApprovalGranted(
            event_id="g1",
            occurred_at=NOW,
            service="approvals",
            call=call,
            policy_version="v1",
            approver="bob",
            approvers=["ann", "bob"],
            required_approvals=2,
            quorum_reached=True,
            arguments_sha256=arguments_sha256(arguments),
            **call_fields(call),
        )

    def test_the_quorum_authorizes_with_the_approvers_recorded(self) -> None:
        granted = self.granted({"payload": "x"})
        assert logic.hash_problem(granted) is None
        event = logic.after_approval(granted, "seq:9", ALLOW, SIGNER, NOW)
        assert isinstance(event, CallAuthorized)
        assert event.authorization.approvals == ["ann", "bob"]

    def test_a_bundle_that_now_denies_wins_over_the_approvals(self) -> None:
        event = logic.after_approval(self.granted({"payload": "x"}), "seq:9", DENY, SIGNER, NOW)
        assert isinstance(event, CallDenied)

    def test_an_approval_bound_to_other_arguments_is_named(self) -> None:
        assert "other arguments" in (logic.hash_problem(self.granted({"payload": "z"})) or "")
