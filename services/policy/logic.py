"""The policy service's decision flow as pure functions: a decision in, the event out.

The handlers in app.py do the I/O (look resources up, ask the rate limiter,
publish); these functions say which event a call gets and build it, so the
flow is tested without NATS (tests/unit/test_policy_logic.py).

    ArgumentsValidated -> CallDenied        the engine denies, or a rate limit is full
                       -> ApprovalRequested the engine wants N humans first
                       -> CallAuthorized    allowed: signed for exactly this call
    ApprovalGranted (quorum reached) -> CallAuthorized | CallDenied (decided again)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from toolgate.contracts.authorization import arguments_sha256, sign
from toolgate.contracts.calls import ErrorCode, ToolCall, ToolError
from toolgate.contracts.events import (
    ApprovalGranted,
    ApprovalRequested,
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    CallDenied,
    Event,
    ResourceSeen,
    carried_fields,
    derive_event_id,
)
from toolgate.contracts.registry import ToolSpec
from toolgate.services.policy.rate_limits import RATE_LIMITED, RateCheck
from toolgate.services.policy.rules import Decision

SERVICE = "policy"
# Every outcome of one input message gets this id, whatever it is: should a
# redelivery decide differently (a bundle was pushed, a rate window turned),
# its event is dropped as a duplicate instead of giving the call two decisions.
DECISION = "decision"


@dataclass(frozen=True)
class Signer:
    """What an authorization is signed with, and how long it stays good."""

    private_key: Ed25519PrivateKey
    ttl: timedelta


def denied(
    event: Event,
    message_id: str,
    decision: Decision,
    now: datetime,
    resources: Sequence[ResourceSeen] | None = None,
) -> CallDenied:
    return CallDenied(
        event_id=derive_event_id(message_id, DECISION),
        occurred_at=now,
        service=SERVICE,
        status=decision.status,
        error=decision.error or ToolError(code=ErrorCode.POLICY_DENIED, message="denied"),
        policy_version=decision.policy_version,
        policy_ids=decision.policy_ids,
        resources=list(resources or ()),
        **carried_fields(event),
    )


def refused(
    event: Event,
    message_id: str,
    policy_version: str,
    now: datetime,
    code: str,
    message: str,
    retryable: bool = False,
) -> CallDenied:
    """Denied before (or beside) the engine's word: a bad hash, a full rate limit."""
    return denied(
        event,
        message_id,
        Decision(
            allowed=False,
            policy_version=policy_version,
            error=ToolError(code=code, message=message, retryable=retryable),
        ),
        now,
    )


def authorized(
    event: Event,
    call: ToolCall,
    message_id: str,
    decision: Decision,
    signer: Signer,
    now: datetime,
    approvers: Sequence[str] = (),
    resources: Sequence[ResourceSeen] | None = None,
    checked_sha256: str | None = None,
) -> CallAuthorized:
    """Allowed: signed for exactly this call of this principal (the whole six-tuple).
    `checked_sha256`: the SHA-256 of the call's arguments as `hash_problem` found it
    (then it is not computed a second time), else None."""
    authorization = sign(
        Authorization(
            call_id=call.call_id,
            tool=call.tool,
            arguments_sha256=checked_sha256 or arguments_sha256(call.arguments),
            policy_version=decision.policy_version,
            approvals=sorted(set(approvers)),
            expires_at=now + signer.ttl,
            tenant=call.principal.tenant,
            agent=call.principal.agent,
            user=call.principal.user,
            session=call.principal.session,
            task_id=call.task_id,
        ),
        signer.private_key,
    )
    return CallAuthorized(
        event_id=derive_event_id(message_id, DECISION),
        occurred_at=now,
        service=SERVICE,
        call=call,
        policy_version=decision.policy_version,
        policy_ids=decision.policy_ids,
        authorization=authorization,
        resources=list(resources or ()),
        **carried_fields(event),
    )


def hash_problem(event: ArgumentsValidated | ApprovalGranted) -> str | None:
    """Why the call in `event` is not the one that was validated or approved, or None."""
    call = event.call
    if isinstance(event, ApprovalGranted):
        if (
            call.call_id != event.call_id
            or arguments_sha256(call.arguments) != event.arguments_sha256
        ):
            return "the approval is bound to other arguments than this call's"
        return None
    if arguments_sha256(call.arguments) != event.arguments_sha256:
        return "the arguments do not match the hash they were validated with"
    return None


def needs_rate_check(decision: Decision, spec: ToolSpec | None) -> bool:
    """A call the engine did not deny counts against its limit, before a human is asked too."""
    return (
        (decision.allowed or decision.awaits_approval)
        and spec is not None
        and spec.rate_limit is not None
    )


def after_validation(
    event: ArgumentsValidated,
    message_id: str,
    decision: Decision,
    spec: ToolSpec | None,
    rate: RateCheck | None,
    signer: Signer,
    approval_ttl_s: float,
    now: datetime,
    resources: Sequence[ResourceSeen] | None = None,
    checked_sha256: str | None = None,
) -> Event:
    """The event a validated call gets, given the engine's decision and the rate limiter's.
    `checked_sha256`: the arguments' hash, once `hash_problem` found none (see `authorized`)."""
    call = event.call
    if not decision.allowed and not decision.awaits_approval:
        return denied(event, message_id, decision, now, resources)
    assert spec is not None  # the engine denies an unregistered tool
    if rate is not None and not rate.admitted:
        assert spec.rate_limit is not None
        return refused(
            event,
            message_id,
            decision.policy_version,
            now,
            RATE_LIMITED,
            retryable=True,
            message=f"{spec.rate_limit.calls} calls per {spec.rate_limit.per_seconds:g} s "
            f"for this user and tool; retry in {rate.retry_after_s:.1f} s",
        )
    if decision.awaits_approval:
        return ApprovalRequested(
            event_id=derive_event_id(message_id, DECISION),
            occurred_at=now,
            service=SERVICE,
            call=call,
            policy_version=decision.policy_version,
            policy_ids=decision.policy_ids,
            risk=spec.risk,
            required_approvals=decision.required_approvals,
            expires_at=now + timedelta(seconds=approval_ttl_s),
            # The approval rule's own reason when it gives one, else the engine's account.
            reason=decision.approval_reason or (decision.error.message if decision.error else ""),
            resources=list(resources or ()),
            **carried_fields(event),
        )
    return authorized(
        event,
        call,
        message_id,
        decision,
        signer,
        now,
        resources=resources,
        checked_sha256=checked_sha256,
    )


def after_approval(
    event: ApprovalGranted,
    message_id: str,
    decision: Decision,
    signer: Signer,
    now: datetime,
    resources: Sequence[ResourceSeen] | None = None,
    checked_sha256: str | None = None,
) -> Event:
    """The quorum was reached and the call decided again (bundle and resources as now).
    `checked_sha256`: the arguments' hash, once `hash_problem` found none (see `authorized`)."""
    if not decision.allowed:
        return denied(event, message_id, decision, now, resources)
    return authorized(
        event,
        event.call,
        message_id,
        decision,
        signer,
        now,
        event.approvers,
        resources,
        checked_sha256,
    )
