"""The approval rules, pure: bound hash, single use, expiry, no self-approval,
N distinct approvers, one deny ends it, deterministic events, the call's
identity (tenant, agent, call_id) and approvers that belong to tenants."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ErrorCode, Principal, ToolCall
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalGranted,
    ApprovalRequested,
    call_fields,
    decode_event,
    encode_event,
)
from toolgate.services.approvals.logic import (
    DEFAULT_TTL,
    SYSTEM_APPROVER,
    ApprovalState,
    Approver,
    Ballot,
    InvalidIdentity,
    Refusal,
    apply_vote,
    default_expires_at,
    events_of,
    expire,
    new_state,
    pending_notice_id,
)
from toolgate.services.approvals.protocol import REQUEST_INFO_HEADER, Requester, requester_of
from toolgate.services.approvals.store import decode_state, encode_state

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
ARGS = {"task_id": "task_c04", "claim": "x", "source_url": "https://example.org"}
SHA = arguments_sha256(ARGS)
KEY = "acme.researcher.call_1"
BOB, CAROL, DAVE = (Approver(name, ("acme",)) for name in ("bob", "carol", "dave"))


def request(
    n: int = 1,
    ttl: timedelta = DEFAULT_TTL,
    arguments: dict | None = None,
    sha: str | None = None,
    principal: Principal = ALICE,
) -> ApprovalRequested:
    call = ToolCall(
        call_id="call_1",
        tool="save_evidence",
        arguments=arguments or ARGS,
        principal=principal,
        task_id="task_c04",
    )
    return ApprovalRequested(
        event_id="req-1",
        occurred_at=T0,
        service="policy",
        call=call,
        policy_version="p-7",
        policy_ids=["critical-needs-approval"],
        risk="critical",
        required_approvals=n,
        expires_at=T0 + ttl,
        arguments_sha256=sha or arguments_sha256(call.arguments),
        **call_fields(call),
    )


def ballot(
    decision: str = "approve",
    sha: str = SHA,
    reason: str = "looks right",
    vote_id: str = "",
    key: str = KEY,
) -> Ballot:
    return Ballot(
        call_key=key,
        decision=decision,  # type: ignore[arg-type]
        arguments_sha256=sha,
        reason=reason,
        vote_id=vote_id,
    )


def vote(
    state: ApprovalState,
    who: Approver,
    b: Ballot | None = None,
    at: timedelta = timedelta(minutes=1),
):  # type: ignore[no-untyped-def]
    return apply_vote(state, who, b or ballot(), T0 + at)


def test_new_state_binds_the_call_hash_policy_and_expiry() -> None:
    state = new_state(request(n=2))
    assert state.status == "pending" and state.votes == []
    assert state.arguments_sha256 == SHA and state.policy_version == "p-7"
    assert state.requester == "u-alice" and state.tenant == "acme"
    assert state.agent == "researcher" and state.key == KEY
    assert state.required_approvals == 2 and state.expires_at == T0 + DEFAULT_TTL
    assert events_of(state) == []


def test_default_expiry_is_fifteen_minutes() -> None:
    assert default_expires_at(T0) == T0 + timedelta(minutes=15)


def test_one_approval_reaches_a_quorum_of_one() -> None:
    state, out = vote(new_state(request()), BOB)
    assert out.accepted and out.quorum_reached and state.status == "granted"
    [granted] = events_of(state)
    assert isinstance(granted, ApprovalGranted)
    assert granted.quorum_reached and granted.approvers == ["bob"]
    assert granted.arguments_sha256 == SHA and granted.policy_version == "p-7"
    assert granted.call.arguments == ARGS and granted.principal == ALICE


def test_approval_with_another_arguments_hash_is_refused() -> None:
    state = new_state(request())
    after, out = vote(state, BOB, ballot(sha=arguments_sha256({**ARGS, "claim": "y"})))
    assert not out.accepted and out.code == Refusal.ARGUMENTS_MISMATCH
    assert after is state and after.status == "pending"


def test_the_caller_cannot_approve_their_own_call() -> None:
    for name in ("u-alice", "U-Alice", " u-alice "):
        after, out = vote(new_state(request()), Approver(name, ("acme",)))
        assert not out.accepted and out.code == Refusal.SELF_APPROVAL
        assert "cannot approve" in out.message
        assert after.votes == []


def test_the_caller_may_deny_their_own_call() -> None:
    state, out = vote(
        new_state(request()), Approver("u-alice", ("acme",)), ballot("deny", reason="oops")
    )
    assert out.accepted and state.status == "denied"


def test_quorum_needs_n_distinct_approvers() -> None:
    state = new_state(request(n=2))
    state, out = vote(state, BOB)
    assert out.accepted and not out.quorum_reached and state.status == "pending"
    again, out = vote(state, Approver("Bob", ("acme",)))
    assert not out.accepted and out.code == Refusal.DUPLICATE_APPROVER
    assert again is state  # counted once
    state, out = vote(state, CAROL)
    assert out.accepted and out.quorum_reached and state.status == "granted"
    first, second = events_of(state)
    assert isinstance(first, ApprovalGranted) and isinstance(second, ApprovalGranted)
    assert (first.quorum_reached, second.quorum_reached) == (False, True)
    assert second.approvers == ["bob", "carol"] and second.required_approvals == 2


def test_one_deny_ends_it() -> None:
    state, _ = vote(new_state(request(n=2)), BOB)
    state, out = vote(state, CAROL, ballot("deny", reason="wrong task"))
    assert out.accepted and state.status == "denied"
    granted, denied = events_of(state)
    assert isinstance(denied, ApprovalDenied)
    assert denied.approver == "carol" and denied.reason == "wrong task"
    assert denied.status == "approval_denied" and denied.error.code == ErrorCode.APPROVAL_DENIED
    assert "carol" in denied.error.message


@pytest.mark.parametrize("decision", ["granted", "denied", "expired"])
def test_single_use_no_vote_after_the_end(decision: str) -> None:
    state = new_state(request())
    if decision == "granted":
        state, _ = vote(state, BOB)
    elif decision == "denied":
        state, _ = vote(state, BOB, ballot("deny"))
    else:
        expired = expire(state, T0 + DEFAULT_TTL)
        assert expired is not None
        state = expired
    events = events_of(state)
    for who, b in ((CAROL, ballot()), (DAVE, ballot("deny"))):
        after, out = vote(state, who, b)
        assert not out.accepted and out.code == Refusal.ALREADY_DECIDED
        assert after is state and events_of(after) == events
    assert state.status == decision


def test_expiry_ends_it_with_approval_expired() -> None:
    state, _ = vote(new_state(request(n=2)), BOB)
    assert expire(state, T0 + DEFAULT_TTL - timedelta(seconds=1)) is None
    expired = expire(state, T0 + DEFAULT_TTL)
    assert expired is not None and expired.status == "expired"
    last = events_of(expired)[-1]
    assert isinstance(last, ApprovalExpired)
    assert last.status == "approval_expired" and last.error.code == ErrorCode.APPROVAL_EXPIRED
    assert "1 of 2" in last.error.message
    assert expire(expired, T0 + DEFAULT_TTL * 2) is None  # once


def test_a_vote_after_the_expiry_expires_it_and_is_refused() -> None:
    state, out = vote(new_state(request()), BOB, at=DEFAULT_TTL + timedelta(seconds=1))
    assert not out.accepted and out.code == Refusal.APPROVAL_EXPIRED
    assert state.status == "expired" and state.votes == []
    assert [type(e) for e in events_of(state)] == [ApprovalExpired]


def test_a_reason_is_required() -> None:
    _, out = vote(new_state(request()), BOB, ballot(reason="   "))
    assert not out.accepted and out.code == Refusal.REASON_REQUIRED


def test_an_approver_of_other_tenants_cannot_vote() -> None:
    _, out = vote(new_state(request()), Approver("erin", tenants=("globex",)))
    assert not out.accepted and out.code == Refusal.NOT_PERMITTED
    _, out = vote(new_state(request()), Approver("erin", tenants=("globex", "acme")))
    assert out.accepted
    _, out = vote(new_state(request()), Approver("root", all_tenants=True))
    assert out.accepted


def test_an_approver_of_no_tenant_sees_nothing() -> None:
    nobody = Approver("old-style-entry")
    assert not nobody.may_vote_for("acme") and not nobody.may_vote_for("")
    _, out = vote(new_state(request()), nobody)
    assert out.code == Refusal.NOT_PERMITTED


def test_an_approver_of_another_tenant_changes_nothing_not_even_an_expiry() -> None:
    state = new_state(request())
    after, out = vote(state, Approver("erin", ("globex",)), at=DEFAULT_TTL * 2)
    assert out.code == Refusal.NOT_PERMITTED and after is state and after.status == "pending"
    # Nor is a vote id replayed by a namesake of another tenant a way in.
    voted, first = vote(state, BOB, ballot(vote_id="v-9"))
    assert first.accepted
    _, foreign = vote(voted, Approver("bob", ("globex",)), ballot(vote_id="v-9"))
    assert foreign.code == Refusal.NOT_PERMITTED and not foreign.replayed


def test_a_ballot_is_for_one_call_key() -> None:
    after, out = vote(new_state(request()), BOB, ballot(key="acme.other_agent.call_1"))
    assert not out.accepted and out.code == Refusal.BAD_REQUEST and after.votes == []


def test_the_same_call_id_of_two_agents_is_two_approvals_with_distinct_event_ids() -> None:
    writer = Principal(tenant="acme", user="u-alice", agent="writer", session="s-1")
    other = Principal(tenant="globex", user="u-alice", agent="researcher", session="s-1")
    states = [new_state(request(principal=p)) for p in (ALICE, writer, other)]
    assert [s.key for s in states] == [KEY, "acme.writer.call_1", "globex.researcher.call_1"]
    assert len({pending_notice_id(s.key) for s in states}) == 3
    ids = set()
    for state in states:
        approver = Approver("bob", (state.tenant,))
        granted, out = vote(state, approver, ballot(key=state.key))
        assert out.accepted and out.call == state.key
        denied, _ = vote(state, approver, ballot("deny", key=state.key))
        expired = expire(state, T0 + DEFAULT_TTL)
        assert expired is not None
        for final in (granted, denied, expired):
            ids |= {e.event_id for e in events_of(final)}
    assert len(ids) == 9


@pytest.mark.parametrize(
    "tenant,agent,call_id",
    [
        ("ac.me", "researcher", "call_1"),
        ("acme", "*", "call_1"),
        ("acme", "researcher", "a.b"),
        ("", "researcher", "call_1"),
        ("acme", "researcher", ">"),
    ],
)
def test_a_request_without_a_valid_call_key_is_refused(
    tenant: str, agent: str, call_id: str
) -> None:
    principal = Principal(tenant=tenant, user="u-alice", agent=agent, session="s-1")
    event = msgspec.structs.replace(
        request(principal=principal),
        call=ToolCall(call_id=call_id, tool="save_evidence", arguments=ARGS, principal=principal),
    )
    with pytest.raises(InvalidIdentity):
        new_state(event)


def test_a_request_whose_principal_differs_from_its_call_is_denied() -> None:
    event = msgspec.structs.replace(
        request(),
        principal=Principal(tenant="globex", user="u-mallory", agent="researcher", session="s-1"),
    )
    state = new_state(event)
    assert state.status == "denied" and state.tenant == "acme" and state.key == KEY


def test_a_retried_vote_is_answered_again_not_counted_twice() -> None:
    state, first = vote(new_state(request(n=2)), BOB, ballot(vote_id="v-1"))
    again, second = vote(state, BOB, ballot(vote_id="v-1"))
    assert first.accepted and second.accepted and second.replayed
    assert again is state and len(state.votes) == 1
    _, stolen = vote(state, CAROL, ballot(vote_id="v-1"))
    assert not stolen.accepted


def test_a_request_whose_hash_does_not_match_its_arguments_is_denied() -> None:
    state = new_state(request(sha="0" * 64))
    assert state.status == "denied"
    [denied] = events_of(state)
    assert isinstance(denied, ApprovalDenied) and denied.approver == SYSTEM_APPROVER


def test_events_are_deterministic_and_a_stable_prefix() -> None:
    state, _ = vote(new_state(request(n=3)), BOB)
    before = events_of(state)
    state, _ = vote(state, CAROL, at=timedelta(minutes=2))
    state, _ = vote(state, DAVE, at=timedelta(minutes=3))
    after = events_of(state)
    assert after[:1] == before
    assert events_of(state) == after
    assert len({e.event_id for e in after}) == 3
    for event in after:
        assert decode_event(encode_event(event)) == event


def test_state_round_trips_through_the_store_encoding() -> None:
    state, _ = vote(new_state(request(n=2)), BOB)
    assert decode_state(encode_state(state)) == state
    assert msgspec.json.decode(encode_state(state))["votes"][0]["approver"] == "bob"


def test_who_asks_is_read_from_the_server_s_request_info_header_only() -> None:
    assert requester_of(None) is None and requester_of({}) is None  # from inside TOOLGATE
    info = '{"acc": "AXYZ", "user": "UABC", "tags": ["role:approver"], "name_tag": "approver a"}'
    assert requester_of({REQUEST_INFO_HEADER: info}) == Requester(
        account="AXYZ", user="UABC", tags=("role:approver",)
    )
    inbox = requester_of({REQUEST_INFO_HEADER: '{"user": "UDEF", "tags": ["role:inbox"]}'})
    assert inbox is not None and inbox.is_inbox
    # A header that cannot be read names nobody: no approver's user, not the inbox.
    for unreadable in ("not json", "[1, 2]", '{"tags": "role:inbox"}'):
        nobody = requester_of({REQUEST_INFO_HEADER: unreadable})
        assert nobody is not None and nobody.user == "" and not nobody.is_inbox
