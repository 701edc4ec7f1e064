"""A call that needs a human, end to end: policy -> approvals -> policy -> executor."""

from __future__ import annotations

import asyncio

import pytest

from tests.harness import Gateway, events_of
from tests.tools.faulty import runs_of
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import ApprovalRequested, CallAuthorized
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.services.client.gateway_client import new_call_id
from toolgate.services.stack.nats_auth import connect_options

pytestmark = pytest.mark.system

def APPROVER(gateway: Gateway) -> dict[str, object]:  # noqa: N802 (reads as a constant)
    """An approver's connection: the locked bus lets it vote and read approvals only."""
    return connect_options(gateway.stack.creds_of("approver"))


BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-1")


async def _pending(approvals: ApprovalsClient, call_id: str):  # type: ignore[no-untyped-def]
    for _ in range(300):
        state = await approvals.get(call_id)
        if state is not None:
            return state
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no approval request for {call_id}")


async def test_approved_call_runs_once_bound_to_its_approver(shared_gateway: Gateway) -> None:
    carol = add_approver(shared_gateway.data_dir, "carol")
    bob_as_approver = add_approver(shared_gateway.data_dir, "u-bob")
    call = ToolCall(call_id=new_call_id(), tool="approved_action", arguments={"amount": 10},
                    principal=BOB)
    sha = arguments_sha256(call.arguments)
    async with await shared_gateway.client() as client, \
            await ApprovalsClient.connect(
                shared_gateway.url, **APPROVER(shared_gateway)) as approvals:
        waiting = asyncio.create_task(client.submit(call, timeout=120))
        state = await _pending(approvals, call.call_id)
        assert state.required_approvals == 1 and state.arguments_sha256 == sha
        assert call.call_id not in runs_of(shared_gateway.data_dir, "approved_action")

        self_vote = await approvals.vote(call.call_id, "approve", arguments_sha256=sha,
                                         reason="mine", token=bob_as_approver)
        assert not self_vote.accepted and self_vote.code == "SELF_APPROVAL"
        other_args = await approvals.vote(call.call_id, "approve", reason="looks fine",
                                          arguments_sha256=arguments_sha256({"amount": 99999}),
                                          token=carol)
        assert not other_args.accepted and other_args.code == "ARGUMENTS_MISMATCH"
        granted = await approvals.vote(call.call_id, "approve", arguments_sha256=sha,
                                       reason="refund checked", token=carol)
        assert granted.accepted and granted.quorum_reached
        result = await waiting
        again = await approvals.vote(call.call_id, "approve", arguments_sha256=sha,
                                     reason="twice", token=carol)
    assert result.ok, result
    assert not again.accepted  # single use
    assert runs_of(shared_gateway.data_dir, "approved_action").count(call.call_id) == 1
    events = events_of(await shared_gateway.events(), call.call_id)
    requested = next(e for e in events if isinstance(e, ApprovalRequested))
    authorized = next(e for e in events if isinstance(e, CallAuthorized))
    assert authorized.authorization.approvals == ["carol"]
    assert authorized.authorization.arguments_sha256 == sha == requested.arguments_sha256


async def test_denied_approval_ends_the_call_without_running_it(shared_gateway: Gateway) -> None:
    dave = add_approver(shared_gateway.data_dir, "dave")
    call = ToolCall(call_id=new_call_id(), tool="approved_action", arguments={"amount": 5},
                    principal=BOB)
    async with await shared_gateway.client() as client, \
            await ApprovalsClient.connect(
                shared_gateway.url, **APPROVER(shared_gateway)) as approvals:
        waiting = asyncio.create_task(client.submit(call, timeout=120))
        state = await _pending(approvals, call.call_id)
        denied = await approvals.vote(call.call_id, "deny", arguments_sha256=state.arguments_sha256,
                                      reason="not this customer", token=dave)
        result = await waiting
    assert denied.accepted
    assert result.status == "approval_denied" and not result.ok
    assert call.call_id not in runs_of(shared_gateway.data_dir, "approved_action")
