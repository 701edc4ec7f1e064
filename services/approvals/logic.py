"""The approval rules, as pure functions over one call's approval state.

An approval request is bound to one call: its identity (tenant, agent,
call_id: the call key, `tenant.agent.call_id`), the SHA-256 of its canonical
arguments, the policy version that asked, the number N of distinct
approvers it needs and an expiry. A vote is checked against that binding:

- it must name the arguments hash the approver was shown (ARGUMENTS_MISMATCH);
- only an approver of the call's tenant may vote (NOT_PERMITTED; the service
  answers UNKNOWN_CALL before it gets here, so nobody learns the call exists);
- the user who made the call cannot approve it (SELF_APPROVAL); denying one's
  own call is allowed: it only stops it;
- an approver counts once (DUPLICATE_APPROVER);
- one deny by any approver ends the request (ApprovalDenied);
- N distinct approvals end it (the last ApprovalGranted has quorum_reached);
- past `expires_at` it ends as ApprovalExpired, whether a vote or the sweeper
  notices first;
- once ended it is single-use: every further vote is refused (ALREADY_DECIDED).

The events a state has produced are a function of the state alone
(`events_of`), with ids derived from the call key (a call_id is unique only
per agent: two agents' calls with one call_id are two approvals, with
distinct event ids), so any replica may publish
them again after a crash and the stream's duplicate window (and the audit's
dedupe by event_id) keeps one copy.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Final, Literal

import msgspec

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ErrorCode, ToolCall, ToolError, is_valid_call_id
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalGranted,
    ApprovalRequested,
    Event,
    derive_event_id,
)

SERVICE: Final = "approvals"
DEFAULT_TTL: Final = timedelta(minutes=15)
MAX_REASON_CHARS: Final = 2000
# The name under which the service itself denies a request it cannot honour.
SYSTEM_APPROVER: Final = "toolgate"

Status = Literal["pending", "granted", "denied", "expired"]
Decision = Literal["approve", "deny"]


class Refusal:
    """Why a vote was not counted. The approver sees the code and a message."""

    UNKNOWN_CALL: Final = "UNKNOWN_CALL"
    # A bare call_id that names calls of several agents: address one as TENANT.AGENT.CALL_ID.
    AMBIGUOUS_CALL: Final = "AMBIGUOUS_CALL"
    INVALID_TOKEN: Final = "INVALID_TOKEN"
    NOT_PERMITTED: Final = "NOT_PERMITTED"
    ALREADY_DECIDED: Final = "ALREADY_DECIDED"
    APPROVAL_EXPIRED: Final = "APPROVAL_EXPIRED"
    ARGUMENTS_MISMATCH: Final = "ARGUMENTS_MISMATCH"
    SELF_APPROVAL: Final = "SELF_APPROVAL"
    DUPLICATE_APPROVER: Final = "DUPLICATE_APPROVER"
    REASON_REQUIRED: Final = "REASON_REQUIRED"
    BAD_REQUEST: Final = "BAD_REQUEST"
    INTERNAL: Final = "INTERNAL"


def default_expires_at(now: datetime) -> datetime:
    """The expiry a request gets unless the policy says otherwise."""
    return now + DEFAULT_TTL


def same_person(a: str, b: str) -> bool:
    return a.strip().casefold() == b.strip().casefold()


class Approver(msgspec.Struct, frozen=True):
    """An authenticated approver: sees and votes on the calls of `tenants` only.

    `all_tenants` (an operator-wide approver, given explicitly with
    `add-approver --all-tenants`) sees every tenant's calls. No tenants and not
    `all_tenants`: sees nothing (fail closed)."""

    name: str
    tenants: tuple[str, ...] = ()
    all_tenants: bool = False

    def may_vote_for(self, tenant: str) -> bool:
        return self.all_tenants or tenant in self.tenants


class Vote(msgspec.Struct, frozen=True, kw_only=True):
    approver: str
    decision: Decision
    reason: str
    at: datetime
    # Chosen by the client; a retried vote with the same id is answered again, not refused.
    vote_id: str = ""


class Ballot(msgspec.Struct, frozen=True, kw_only=True):
    """What an authenticated approver asks: a decision on exactly these arguments."""

    call_key: str
    decision: Decision
    arguments_sha256: str
    reason: str
    vote_id: str = ""


class ApprovalState(msgspec.Struct, frozen=True, kw_only=True):
    """One call's approval, as stored in the KV bucket under its call key."""

    call_id: str
    call: ToolCall
    arguments_sha256: str
    policy_version: str
    policy_ids: list[str] = []
    risk: str
    required_approvals: int
    requested_at: datetime
    expires_at: datetime
    requester: str
    tenant: str
    request_event_id: str
    request_reason: str = ""
    traceparent: str | None = None
    status: Status = "pending"
    votes: list[Vote] = []
    decided_at: datetime | None = None
    # Outbox: how many of events_of(self) are known to be published.
    emitted: int = 0
    # 2: keyed by the call key (tenant.agent.call_id); 1 was keyed by call_id alone.
    schema_version: int = 2

    @property
    def agent(self) -> str:
        return self.call.principal.agent

    @property
    def key(self) -> str:
        """The call's identity, and the state's KV key: `tenant.agent.call_id`."""
        return subjects.call_key(self.tenant, self.agent, self.call_id)

    @property
    def approvers(self) -> list[str]:
        return [v.approver for v in self.votes if v.decision == "approve"]

    @property
    def is_open(self) -> bool:
        return self.status == "pending"

    def is_due(self, now: datetime) -> bool:
        return self.is_open and now >= self.expires_at

    @property
    def unpublished(self) -> bool:
        return self.emitted < len(events_of(self))


class VoteOutcome(msgspec.Struct, frozen=True, kw_only=True):
    accepted: bool
    # The call key the vote was applied to (empty when no call was found).
    call: str = ""
    code: str = ""
    message: str = ""
    status: Status = "pending"
    approvers: list[str] = []
    required_approvals: int = 1
    quorum_reached: bool = False
    replayed: bool = False


class InvalidIdentity(ValueError):
    """The request's tenant, agent or call_id cannot form a call key."""


def new_state(event: ApprovalRequested) -> ApprovalState:
    """The state of a fresh request. A request whose hash does not match its
    own arguments is denied at once: nobody could approve what it claims.

    Raises InvalidIdentity if the call has no valid call key (the validator
    lets no such call through; the request is dead-lettered)."""
    p = event.call.principal
    if not (
        subjects.is_identity_token(p.tenant)
        and subjects.is_identity_token(p.agent)
        and is_valid_call_id(event.call.call_id)
    ):
        raise InvalidIdentity(
            f"no call key for tenant {p.tenant!r}, agent {p.agent!r}, "
            f"call_id {event.call.call_id!r}"
        )
    computed = arguments_sha256(event.call.arguments)
    state = ApprovalState(
        call_id=event.call.call_id,
        call=event.call,
        arguments_sha256=computed,
        policy_version=event.policy_version,
        policy_ids=list(event.policy_ids),
        risk=event.risk,
        required_approvals=max(1, event.required_approvals),
        requested_at=event.occurred_at,
        expires_at=event.expires_at,
        requester=event.call.principal.user,
        tenant=event.call.principal.tenant,
        request_event_id=event.event_id,
        request_reason=event.reason,
        traceparent=event.traceparent,
    )
    if (
        event.arguments_sha256 not in (None, computed)
        or event.call_id != event.call.call_id
        or event.principal not in (None, event.call.principal)
    ):
        return msgspec.structs.replace(
            state,
            status="denied",
            decided_at=event.occurred_at,
            votes=[
                Vote(
                    approver=SYSTEM_APPROVER,
                    decision="deny",
                    at=event.occurred_at,
                    reason="the approval request does not match its call "
                    "(call_id, principal or arguments hash differ)",
                )
            ],
        )
    return state


def outcome(
    state: ApprovalState, accepted: bool, code: str = "", message: str = "", replayed: bool = False
) -> VoteOutcome:
    approvers = state.approvers
    return VoteOutcome(
        accepted=accepted,
        call=state.key,
        code=code,
        message=message,
        status=state.status,
        approvers=approvers,
        required_approvals=state.required_approvals,
        quorum_reached=state.status == "granted",
        replayed=replayed,
    )


def expire(state: ApprovalState, now: datetime) -> ApprovalState | None:
    """The expired state, if the request is open and past its expiry; else None."""
    if not state.is_due(now):
        return None
    return msgspec.structs.replace(state, status="expired", decided_at=now)


def apply_vote(
    state: ApprovalState, approver: Approver, ballot: Ballot, now: datetime
) -> tuple[ApprovalState, VoteOutcome]:
    """Apply one authenticated vote. Returns the new state (the same object if
    nothing changed) and what to tell the approver."""
    if not approver.may_vote_for(state.tenant):
        # First of all: an approver of another tenant changes nothing, not even an expiry.
        return state, outcome(
            state,
            False,
            Refusal.NOT_PERMITTED,
            f"{approver.name} may not vote on calls of tenant {state.tenant}",
        )
    if ballot.call_key != state.key:
        return state, outcome(state, False, Refusal.BAD_REQUEST, "this ballot is for another call")
    if ballot.vote_id:
        for vote in state.votes:
            if vote.vote_id == ballot.vote_id:
                if not same_person(vote.approver, approver.name):
                    return state, outcome(
                        state,
                        False,
                        Refusal.BAD_REQUEST,
                        "this vote id belongs to another approver",
                    )
                return state, outcome(state, True, message="vote already recorded", replayed=True)
    if not state.is_open:
        return state, outcome(
            state,
            False,
            Refusal.ALREADY_DECIDED,
            f"this approval request is already {state.status}; an approval is single-use",
        )
    expired = expire(state, now)
    if expired is not None:
        return expired, outcome(
            expired,
            False,
            Refusal.APPROVAL_EXPIRED,
            f"this approval request expired at {state.expires_at.isoformat()}",
        )
    if ballot.arguments_sha256 != state.arguments_sha256:
        return state, outcome(
            state,
            False,
            Refusal.ARGUMENTS_MISMATCH,
            "the arguments hash does not match this call's arguments "
            f"({state.arguments_sha256}); look at the call again",
        )
    reason = ballot.reason.strip()
    if not reason:
        return state, outcome(state, False, Refusal.REASON_REQUIRED, "give a reason")
    if len(reason) > MAX_REASON_CHARS:
        return state, outcome(
            state,
            False,
            Refusal.BAD_REQUEST,
            f"the reason is longer than {MAX_REASON_CHARS} characters",
        )
    if ballot.decision == "approve" and same_person(approver.name, state.requester):
        return state, outcome(
            state,
            False,
            Refusal.SELF_APPROVAL,
            f"{approver.name} made this call and cannot approve it; another approver must",
        )
    if any(same_person(v.approver, approver.name) for v in state.votes):
        return state, outcome(
            state,
            False,
            Refusal.DUPLICATE_APPROVER,
            f"{approver.name} has already voted on this call; an approver counts once",
        )
    vote = Vote(
        approver=approver.name,
        decision=ballot.decision,
        reason=reason,
        at=now,
        vote_id=ballot.vote_id,
    )
    votes = [*state.votes, vote]
    if ballot.decision == "deny":
        new = msgspec.structs.replace(state, votes=votes, status="denied", decided_at=now)
        return new, outcome(new, True, message="denied: the call will not run")
    approvals = sum(1 for v in votes if v.decision == "approve")
    if approvals >= state.required_approvals:
        new = msgspec.structs.replace(state, votes=votes, status="granted", decided_at=now)
        return new, outcome(
            new,
            True,
            message="approved: quorum reached, the policy re-checks the call before it runs",
        )
    new = msgspec.structs.replace(state, votes=votes)
    return new, outcome(
        new, True, message=f"approved: {approvals} of {state.required_approvals} approvals"
    )


def _carried(state: ApprovalState) -> dict[str, Any]:
    return {
        "call_id": state.call_id,
        "tool": state.call.tool,
        "principal": state.call.principal,
        "task_id": state.call.task_id,
        "arguments_sha256": state.arguments_sha256,
        "traceparent": state.traceparent,
        "service": SERVICE,
    }


# Derived ids take the call key (tenant.agent.call_id), never the call_id alone:
# `Nats-Msg-Id` dedupe is stream-wide, so ids from a bare call_id would drop
# another agent's event (or pending notice) as a duplicate.


def granted_event_id(key: str, approver: str) -> str:
    return derive_event_id(f"approval:{key}", f"approval-granted/{approver.strip().casefold()}")


def denied_event_id(key: str) -> str:
    return derive_event_id(f"approval:{key}", "approval-denied")


def expired_event_id(key: str) -> str:
    return derive_event_id(f"approval:{key}", "expired")


def pending_notice_id(key: str) -> str:
    return derive_event_id(f"approval:{key}", "approval-pending")


def events_of(state: ApprovalState) -> list[Event]:
    """Every event this state stands for, in order. Deterministic: same state, same events."""
    events: list[Event] = []
    approvers: list[str] = []
    for vote in state.votes:
        if vote.decision == "approve":
            approvers.append(vote.approver)
            events.append(
                ApprovalGranted(
                    event_id=granted_event_id(state.key, vote.approver),
                    occurred_at=vote.at,
                    call=state.call,
                    policy_version=state.policy_version,
                    approver=vote.approver,
                    reason=vote.reason,
                    approvers=list(approvers),
                    required_approvals=state.required_approvals,
                    quorum_reached=state.status == "granted"
                    and len(approvers) == state.required_approvals,
                    **_carried(state),
                )
            )
        else:
            events.append(
                ApprovalDenied(
                    event_id=denied_event_id(state.key),
                    occurred_at=vote.at,
                    approver=vote.approver,
                    reason=vote.reason,
                    error=ToolError(
                        code=ErrorCode.APPROVAL_DENIED,
                        message=f"denied by {vote.approver}: {vote.reason}",
                        retryable=False,
                    ),
                    **_carried(state),
                )
            )
    if state.status == "expired":
        assert state.decided_at is not None
        given = len(approvers)
        events.append(
            ApprovalExpired(
                event_id=expired_event_id(state.key),
                occurred_at=state.decided_at,
                error=ToolError(
                    code=ErrorCode.APPROVAL_EXPIRED,
                    message=f"no decision before {state.expires_at.isoformat()}: "
                    f"{given} of {state.required_approvals} approvals given",
                    retryable=False,
                ),
                **_carried(state),
            )
        )
    return events
