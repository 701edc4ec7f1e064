"""A call that needs a human, end to end on the locked bus: policy -> approvals ->
policy -> executor, with approvers who act only through the approvals service
(the approver creds, account APPROVERS) and only on their own tenants' calls.

The attacks: an approver of another tenant trying to list, show or decide a
call, or to read the replies sent to another approver; two agents using one
call_id; an agent publishing the call_id of a call that waits for approval,
hoping to take over its approval, notice or result.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from tests.harness import Gateway, events_of, flushed
from tests.tools.faulty import runs_of
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import PendingNotice, Principal, ToolCall, ToolResult
from toolgate.contracts.events import (
    ApprovalGranted,
    ApprovalRequested,
    CallAuthorized,
    Event,
    ExecutionSucceeded,
)
from toolgate.runtime.creds import connect_options, inbox_prefix_of
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient, Refused
from toolgate.services.approvals.logic import Refusal
from toolgate.services.approvals.protocol import REQUEST_INFO_HEADER, ApprovalView
from toolgate.stack import nats_auth

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-1")
WALT = Principal(tenant="acme", user="u-walt", agent="writer", session="s-2")
MALLORY = Principal(tenant="globex", user="u-mallory", agent="researcher", session="s-3")


def APPROVER(gateway: Gateway) -> dict[str, Any]:  # reads as a constant
    """An approver's connection: the locked bus lets it reach the approvals service only."""
    return connect_options(gateway.stack.creds_of("inbox"))


def approver(gateway: Gateway, name: str, *tenants: str) -> str:
    """A new approver of `tenants` (names made unique: the gateway is shared)."""
    return add_approver(gateway.data_dir, f"{name}-{uuid.uuid4().hex[:6]}", list(tenants))


def approver_with_creds(gateway: Gateway, name: str, *tenants: str) -> tuple[str, Path]:
    """A new approver with a NATS user of her own, as `toolgate approvals add-approver`
    makes her: (token, creds)."""
    unique = f"{name}-{uuid.uuid4().hex[:6]}"
    token = add_approver(
        gateway.data_dir,
        unique,
        list(tenants),
        mint_nats_user=lambda n: nats_auth.mint_approver(gateway.data_dir, n)[1],
    )
    return token, nats_auth.approver_creds_path(gateway.data_dir, unique)


async def approvals_as(gateway: Gateway, token: str) -> ApprovalsClient:
    return await ApprovalsClient.connect(gateway.url, token=token, **APPROVER(gateway))


def key(principal: Principal, call_id: str) -> str:
    return subjects.call_key(principal.tenant, principal.agent, call_id)


def action(principal: Principal, amount: int, call_id: str | None = None) -> ToolCall:
    return ToolCall(
        call_id=call_id or new_call_id(),
        tool="approved_action",
        arguments={"amount": amount},
        principal=principal,
    )


async def waiting(approvals: ApprovalsClient, call: str) -> ApprovalView:
    """The approval of `call` once the service has it (as this approver may see it)."""
    for _ in range(300):
        state = await approvals.get(call)
        if state is not None:
            return state
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no approval request for {call}")


def of_call(events: list[Event], principal: Principal, call_id: str) -> list[Event]:
    return [
        e
        for e in events_of(events, call_id)
        if e.principal is not None
        and (e.principal.tenant, e.principal.agent) == (principal.tenant, principal.agent)
    ]


async def stored_on(gateway: Gateway, principal: Principal, subject: str) -> list[bytes]:
    """What the results stream holds on `subject`, read by the agent that owns it."""
    nc = await nats.connect(
        gateway.url, **connect_options(await gateway.agent_creds(principal.tenant, principal.agent))
    )
    try:
        msg = await nc.jetstream().get_last_msg(subjects.RESULTS_STREAM, subject, direct=True)
    except NotFoundError:
        return []
    finally:
        await nc.close()
    return [msg.data or b""]


async def pending_notice(
    gateway: Gateway, principal: Principal, call_id: str
) -> PendingNotice | None:
    subject = subjects.pending_subject(principal.tenant, principal.agent, call_id)
    for _ in range(100):
        found = await stored_on(gateway, principal, subject)
        if found:
            return msgspec.json.decode(found[0], type=PendingNotice)
        await asyncio.sleep(0.1)
    return None


async def test_approved_call_runs_once_bound_to_its_approver(shared_gateway: Gateway) -> None:
    carol = approver(shared_gateway, "carol", "acme")
    bob_as_approver = add_approver(shared_gateway.data_dir, "u-bob", ["acme"])
    call = action(BOB, 10)
    sha = arguments_sha256(call.arguments)
    async with (
        await shared_gateway.client() as client,
        await approvals_as(shared_gateway, carol) as approvals,
    ):
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(approvals, key(BOB, call.call_id))
        assert state.required_approvals == 1 and state.arguments_sha256 == sha
        assert call.call_id not in runs_of(shared_gateway.data_dir, "approved_action")

        self_vote = await approvals.vote(
            state.key, "approve", arguments_sha256=sha, reason="mine", token=bob_as_approver
        )
        assert not self_vote.accepted and self_vote.code == Refusal.SELF_APPROVAL
        other_args = await approvals.vote(
            state.key,
            "approve",
            reason="looks fine",
            arguments_sha256=arguments_sha256({"amount": 99999}),
        )
        assert not other_args.accepted and other_args.code == Refusal.ARGUMENTS_MISMATCH
        granted = await approvals.vote(
            call.call_id, "approve", arguments_sha256=sha, reason="refund checked"
        )  # a bare call_id works too
        assert granted.accepted and granted.quorum_reached and granted.call == state.key
        result = await submitted
        again = await approvals.vote(state.key, "approve", arguments_sha256=sha, reason="twice")
    assert result.ok, result
    assert not again.accepted and again.code == Refusal.ALREADY_DECIDED  # single use
    assert runs_of(shared_gateway.data_dir, "approved_action").count(call.call_id) == 1
    events = events_of(await shared_gateway.events(), call.call_id)
    requested = next(e for e in events if isinstance(e, ApprovalRequested))
    authorized = next(e for e in events if isinstance(e, CallAuthorized))
    assert authorized.authorization.approvals == [granted.approvers[0]]
    assert authorized.authorization.arguments_sha256 == sha == requested.arguments_sha256


async def test_denied_approval_ends_the_call_without_running_it(shared_gateway: Gateway) -> None:
    dave = approver(shared_gateway, "dave", "acme")
    call = action(BOB, 5)
    async with (
        await shared_gateway.client() as client,
        await approvals_as(shared_gateway, dave) as approvals,
    ):
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(approvals, key(BOB, call.call_id))
        denied = await approvals.vote(
            state.key, "deny", arguments_sha256=state.arguments_sha256, reason="not this customer"
        )
        result = await submitted
    assert denied.accepted
    assert result.status == "approval_denied" and not result.ok
    assert call.call_id not in runs_of(shared_gateway.data_dir, "approved_action")


async def test_an_approver_of_globex_cannot_list_show_or_decide_acme_calls(
    shared_gateway: Gateway,
) -> None:
    gus = approver(shared_gateway, "gus", "globex")
    erin = approver(shared_gateway, "erin", "acme")
    secret = 424242
    call = action(BOB, secret)
    sha = arguments_sha256(call.arguments)
    async with (
        await shared_gateway.client() as client,
        await approvals_as(shared_gateway, erin) as as_erin,
        await approvals_as(shared_gateway, gus) as as_gus,
    ):
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(as_erin, key(BOB, call.call_id))
        assert state.call.arguments == {"amount": secret}

        # List: acme's call is not among what gus sees, nor any trace of it.
        listed = await as_gus.list_pending()
        assert listed.approver is not None and listed.approver.tenants == ["globex"]
        assert all(v.tenant == "globex" for v in listed.calls)
        wire = msgspec.json.encode(listed).decode()
        assert call.call_id not in wire and str(secret) not in wire

        # Show: by key or by bare call_id, answered as a call that does not exist.
        for ref in (state.key, call.call_id):
            shown = await as_gus.show(ref)
            assert (shown.ok, shown.code, shown.approval) == (False, Refusal.UNKNOWN_CALL, None)
            assert str(secret) not in shown.message
        absent = await as_gus.show(key(BOB, "call_that_never_was"))
        assert absent.message.replace("call_that_never_was", "X") == (
            await as_gus.show(state.key)
        ).message.replace(call.call_id, "X")

        # Vote: neither approve (with the right hash) nor deny lands.
        for decision in ("approve", "deny"):
            for ref in (state.key, call.call_id):
                out = await as_gus.vote(
                    ref,
                    decision,
                    arguments_sha256=sha,  # type: ignore[arg-type]
                    reason="globex deciding acme's call",
                )
                assert not out.accepted and out.code == Refusal.UNKNOWN_CALL
                assert out.call == "" and out.approvers == []
        untouched = await as_erin.get(state.key)
        assert untouched is not None and untouched.status == "pending"
        assert untouched.votes == []

        # The approver's NATS identity reaches the approvals service and nothing else:
        # no bucket, no events, no results to read arguments from.
        errors: list[Exception] = []

        async def remember(exc: Exception) -> None:
            errors.append(exc)

        nc = await nats.connect(shared_gateway.url, error_cb=remember, **APPROVER(shared_gateway))
        try:
            with pytest.raises((NatsError, asyncio.TimeoutError, TimeoutError)):
                await nc.jetstream(timeout=2).key_value(subjects.APPROVALS_BUCKET)
            with pytest.raises((NatsError, asyncio.TimeoutError, TimeoutError)):
                await nc.jetstream(timeout=2).get_last_msg(
                    subjects.EVENTS_STREAM, subjects.event_filter(ApprovalRequested)
                )
            await flushed(nc)
        finally:
            await nc.close()
        refused_by_server = " ".join(str(e) for e in errors).lower()
        assert "permissions violation" in refused_by_server
        assert f"stream.info.kv_{subjects.APPROVALS_BUCKET}" in refused_by_server
        assert f"msg.get.{subjects.EVENTS_STREAM.lower()}" in refused_by_server

        # acme's own approver decides it; the call runs as asked.
        out = await as_erin.vote(state.key, "approve", arguments_sha256=sha, reason="checked")
        assert out.accepted and out.quorum_reached
        result = await submitted
    assert result.ok, result
    events = events_of(await shared_gateway.events(), call.call_id)
    grants = [e for e in events if isinstance(e, ApprovalGranted)]
    assert [g.approver for g in grants] == [out.approvers[0]]


async def test_an_approver_of_globex_reads_none_of_the_replies_to_acme_s_approver(
    shared_gateway: Gateway,
) -> None:
    erin, erin_creds = approver_with_creds(shared_gateway, "erin", "acme")
    gus, gus_creds = approver_with_creds(shared_gateway, "gus", "globex")
    secret = 737373
    call = action(BOB, secret)
    # gus, with his own creds, listens wherever he can think of.
    errors: list[str] = []

    async def remember(exc: Exception) -> None:
        errors.append(str(exc))

    spy = await nats.connect(shared_gateway.url, error_cb=remember, **connect_options(gus_creds))
    heard: list[bytes] = []

    async def overhear(msg: Any) -> None:
        heard.append(msg.data)

    own = inbox_prefix_of(gus_creds)
    assert own is not None and own != inbox_prefix_of(erin_creds)
    wildcards = [
        "_INBOX.>",
        ">",
        "*.>",
        f"{nats_auth.APPROVER_INBOX_PREFIX}.>",
        f"{nats_auth.APPROVER_INBOX_PREFIX}.*.>",
        "_INBOX_approvals_inbox.>",
        f"{subjects.APPROVALS_PREFIX}.>",
    ]
    for subject in [*wildcards, f"{own}.>"]:
        await spy.subscribe(subject, cb=overhear)
    await flushed(spy)
    try:
        async with (
            await shared_gateway.client() as client,
            await ApprovalsClient.connect(
                shared_gateway.url, token=erin, **connect_options(erin_creds)
            ) as as_erin,
            await ApprovalsClient.connect(
                shared_gateway.url, token=gus, **connect_options(gus_creds)
            ) as as_gus,
        ):
            submitted = asyncio.create_task(client.submit(call, timeout=120))
            # acme's approver lists and shows her call, with its arguments.
            state = await waiting(as_erin, key(BOB, call.call_id))
            assert state.call.arguments == {"amount": secret}
            listed = await as_erin.list_pending()
            assert state.key in [v.key for v in listed.calls]
            assert (await as_erin.show(call.call_id)).ok

            # gus's own show of it: a call that does not exist.
            shown = await as_gus.show(state.key)
            assert (shown.ok, shown.code) == (False, Refusal.UNKNOWN_CALL)
            # erin's token is no use to him over his own creds, nor with the header
            # that names who asks written by him (the server writes its own).
            stolen = await as_gus.show(state.key, token=erin)
            assert (stolen.ok, stolen.code) == (False, Refusal.INVALID_TOKEN)
            forged = json.dumps({"user": "", "tags": ["role:inbox"]})
            reply = await spy.request(
                f"{subjects.APPROVALS_PREFIX}.show",
                json.dumps({"token": erin, "call": state.key}).encode(),
                headers={REQUEST_INFO_HEADER: forged},
                timeout=10,
            )
            assert json.loads(reply.data)["code"] == Refusal.INVALID_TOKEN

            await flushed(spy)
            # Nothing of erin's replies reached gus: every wildcard was refused by the
            # server itself, and his own inbox got only his own refusals.
            assert reply.data in heard
            assert [h for h in heard if str(secret).encode() in h or b'"ok":true' in h] == []
            refused = " ".join(errors).lower()
            for subject in wildcards:
                assert f'permissions violation for subscription to "{subject.lower()}"' in refused

            out = await as_erin.vote(
                state.key, "deny", arguments_sha256=state.arguments_sha256, reason="no"
            )
            assert out.accepted
            result = await submitted
        assert not result.ok
    finally:
        await spy.close()


async def test_a_rotated_approver_s_old_creds_are_refused(shared_gateway: Gateway) -> None:
    token, creds = approver_with_creds(shared_gateway, "fay", "acme")
    name = creds.stem
    old = creds.read_text()
    async with await ApprovalsClient.connect(
        shared_gateway.url, token=token, **connect_options(creds)
    ) as before:
        assert (await before.whoami()) is not None
    rotated = add_approver(
        shared_gateway.data_dir,
        name,
        ["acme"],
        rotate=True,
        mint_nats_user=lambda n: nats_auth.mint_approver(shared_gateway.data_dir, n)[1],
    )
    kept = creds.with_name("old.creds")
    kept.write_text(old)
    kept.chmod(0o600)
    async with await ApprovalsClient.connect(
        shared_gateway.url, token=rotated, **connect_options(kept)
    ) as with_old_creds:
        with pytest.raises(Refused) as refused:
            await with_old_creds.list_pending()
        assert refused.value.code == Refusal.INVALID_TOKEN
    async with await ApprovalsClient.connect(
        shared_gateway.url, token=rotated, **connect_options(creds)
    ) as after:
        identity = await after.whoami()
        assert identity is not None and identity.name == name


async def test_one_call_id_from_two_agents_is_two_independent_approvals(
    shared_gateway: Gateway,
) -> None:
    fay = approver(shared_gateway, "fay", "acme")
    call_id = new_call_id()
    mine, walts = action(BOB, 11, call_id), action(WALT, 22, call_id)
    async with (
        await shared_gateway.client("acme", "researcher") as researcher,
        await shared_gateway.client("acme", "writer") as writer,
        await approvals_as(shared_gateway, fay) as approvals,
    ):
        first = asyncio.create_task(researcher.submit(mine, timeout=120))
        second = asyncio.create_task(writer.submit(walts, timeout=120))
        a = await waiting(approvals, key(BOB, call_id))
        b = await waiting(approvals, key(WALT, call_id))
        assert (a.call.arguments, b.call.arguments) == ({"amount": 11}, {"amount": 22})
        assert (a.requester, b.requester) == ("u-bob", "u-walt")
        ambiguous = await approvals.show(call_id)
        assert ambiguous.code == Refusal.AMBIGUOUS_CALL
        assert a.key in ambiguous.message and b.key in ambiguous.message
        with pytest.raises(Refused):
            await approvals.get(call_id)

        # Each agent is told it waits, on its own subject, about its own call.
        notice_a = await pending_notice(shared_gateway, BOB, call_id)
        notice_b = await pending_notice(shared_gateway, WALT, call_id)
        assert notice_a is not None and notice_a.expires_at == a.expires_at.isoformat()
        assert notice_b is not None and notice_b.expires_at == b.expires_at.isoformat()

        granted = await approvals.vote(
            a.key, "approve", reason="researcher's is fine", arguments_sha256=a.arguments_sha256
        )
        assert granted.accepted and granted.quorum_reached
        result_a = await first
        still = await approvals.get(b.key)
        assert still is not None and still.status == "pending" and still.votes == []
        denied = await approvals.vote(
            b.key, "deny", reason="writer's is not", arguments_sha256=b.arguments_sha256
        )
        assert denied.accepted
        result_b = await second
    assert result_a.ok and result_a.call_id == call_id
    assert result_b.status == "approval_denied" and result_b.call_id == call_id
    events = await shared_gateway.events()
    ran_a = [e for e in of_call(events, BOB, call_id) if isinstance(e, ExecutionSucceeded)]
    ran_b = [e for e in of_call(events, WALT, call_id) if isinstance(e, ExecutionSucceeded)]
    assert len(ran_a) == 1 and ran_b == []
    ids_a = {e.event_id for e in of_call(events, BOB, call_id)}
    ids_b = {e.event_id for e in of_call(events, WALT, call_id)}
    assert ids_a and ids_b and not ids_a & ids_b


async def test_a_waiting_call_cannot_be_hijacked_by_another_agent_with_its_call_id(
    shared_gateway: Gateway,
) -> None:
    acme_approver = approver(shared_gateway, "hal", "acme")
    globex_approver = approver(shared_gateway, "ivy", "globex")
    call_id = new_call_id()
    victim = action(BOB, 7, call_id)
    async with (
        await shared_gateway.client("acme", "researcher") as researcher,
        await shared_gateway.client("globex", "researcher") as attacker,
        await approvals_as(shared_gateway, acme_approver) as as_acme,
        await approvals_as(shared_gateway, globex_approver) as as_globex,
    ):
        submitted = asyncio.create_task(researcher.submit(victim, timeout=120))
        state = await waiting(as_acme, key(BOB, call_id))
        notice = await pending_notice(shared_gateway, BOB, call_id)
        assert notice is not None

        # The attacker (another tenant's agent) publishes the same call_id, other arguments,
        # and also tries its own principal pointing at the victim's identity.
        hijack = action(MALLORY, 999_999, call_id)
        attack = asyncio.create_task(attacker.submit(hijack, timeout=120))
        forged = msgspec.structs.replace(hijack, principal=BOB)
        refused: ToolResult = await attacker.submit(
            msgspec.structs.replace(forged, call_id=new_call_id()), timeout=60
        )
        assert refused.status == "denied" and refused.error is not None
        assert refused.error.code == "PRINCIPAL_MISMATCH"
        theirs = await waiting(as_globex, key(MALLORY, call_id))
        assert theirs.call.arguments == {"amount": 999_999}

        # The victim's approval, notice and (later) result are untouched by all that.
        mine = await as_acme.get(state.key)
        assert mine is not None and mine.call.arguments == {"amount": 7}
        assert mine.requested_at == state.requested_at and mine.votes == []
        assert await pending_notice(shared_gateway, BOB, call_id) == notice
        assert (
            len(
                await stored_on(
                    shared_gateway, BOB, subjects.pending_subject(BOB.tenant, BOB.agent, call_id)
                )
            )
            == 1
        )
        assert await researcher.result(call_id) is None
        # The victim's approver still sees only the victim's call under that id.
        assert (await as_acme.get(call_id)) == mine

        # Approving the victim's call runs the victim's call, for the victim only.
        granted = await as_acme.vote(
            state.key,
            "approve",
            reason="victim's call checked",
            arguments_sha256=arguments_sha256({"amount": 7}),
        )
        assert granted.accepted and granted.quorum_reached
        result = await submitted
        assert result.ok and result.call_id == call_id
        assert await researcher.result(call_id) == result
        assert await attacker.result(call_id) is None  # the attacker's call still waits
        left = await as_globex.get(key(MALLORY, call_id))
        assert left is not None and left.status == "pending"
        assert (
            await as_globex.vote(
                left.key, "deny", reason="no", arguments_sha256=left.arguments_sha256
            )
        ).accepted
        attacked = await attack
    assert attacked.status == "approval_denied"
    events = await shared_gateway.events()
    authorized = [e for e in of_call(events, BOB, call_id) if isinstance(e, CallAuthorized)]
    assert len(authorized) == 1
    assert (authorized[0].authorization.tenant, authorized[0].authorization.agent) == (
        "acme",
        "researcher",
    )
    assert authorized[0].call.arguments == {"amount": 7}
    assert not [
        e
        for e in of_call(events, MALLORY, call_id)
        if isinstance(e, CallAuthorized | ExecutionSucceeded)
    ]
