"""Every retry and every message gets its answer, on the agent's own result subject.

A platform in another language does what plain nats-py does here, with an
agent's creds: subscribe to the result subject, publish the call, wait. Its
retry of a call_id (same agent) must be answered again with the stored bytes,
nothing run or stored twice; a call that reuses a call_id with other arguments is
not a retry: it gets `CALL_ID_REUSED`, never the first call's answer; a body that
is not JSON but names one call_id gets `MALFORMED_CALL`; a call over the size cap
(but under the server's max_payload) gets `PAYLOAD_TOO_LARGE` as a result, not an
error in its publish ack.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.subscription import Subscription

from tests.harness import Gateway, events_of, flushed, make_test_registry
from tests.tools.faulty import runs_of
from tests.waiting import all_settled
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import (
    ANSWERS_ARGUMENTS_HEADER,
    ANSWERS_TOOL_HEADER,
    MAX_CALL_BYTES,
    REFUSED_HEADER,
    PendingNotice,
    ToolResult,
)
from toolgate.contracts.events import (
    ApprovalRequested,
    CallRetried,
    ExecutionStarted,
    MessageDeadLettered,
    ResultAttached,
)
from toolgate.stack.nats_server import MAX_PAYLOAD_BYTES

pytestmark = pytest.mark.system

TENANT, AGENT = "acme", "retrier"
GIVE_UP_S = 30.0  # bounded waits: only to give up, never a threshold under test
PRINCIPAL = {"tenant": TENANT, "user": "u-alice", "agent": AGENT, "session": "s-1"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base: Path = tmp_path_factory.mktemp("retries")
    gateway = Gateway(
        data_dir=base / "data", registry_dir=make_test_registry(base / "registry"), with_audit=True
    )
    gateway.start()
    yield gateway
    gateway.stop()


async def agent(gateway: Gateway) -> Client:
    """A plain nats-py client with the agent's creds, as another language's platform is."""
    creds = await gateway.agent_creds(TENANT, AGENT)
    return await nats.connect(gateway.url, user_credentials=str(creds), allow_reconnect=False)


def call_body(call_id: str, tool: str, arguments: dict[str, object]) -> bytes:
    return json.dumps(
        {"call_id": call_id, "tool": tool, "arguments": arguments, "principal": PRINCIPAL}
    ).encode()


async def listen(nc: Client, subject: str) -> Subscription:
    subscription = await nc.subscribe(subject)
    await flushed(nc)  # subscribed on the server before anything is published
    return subscription


async def send(nc: Client, body: bytes) -> dict[str, object]:
    """Publish a call as JetStream expects (request: the publish ack is the answer)."""
    ack = await nc.request(subjects.calls_subject(TENANT, AGENT), body, timeout=GIVE_UP_S)
    return json.loads(ack.data)


async def stored_on(gateway: Gateway, subject: str) -> int:
    """How many messages the results stream holds on `subject` (read as admin)."""
    nc = await gateway.connect()
    try:
        info = await nc.jsm().stream_info(subjects.RESULTS_STREAM, subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0)
    finally:
        await nc.close()


async def settled(gateway: Gateway) -> None:
    """Every stage has handled every message: the audit every call and every event."""
    await all_settled(gateway)


def audited(gateway: Gateway, call_id: str, event_type: str) -> int:
    rows = gateway.audit_client().query(
        "SELECT count(DISTINCT event_id) FROM event_log"
        " WHERE call_id = {c:String} AND event_type = {t:String}",
        parameters={"c": call_id, "t": event_type},
    )
    return int(rows.result_rows[0][0])


# ---------------------------------------------------------------- retries


async def test_a_retried_call_id_is_answered_again_with_the_same_bytes(gw: Gateway) -> None:
    call_id = new_call_id()
    body = call_body(call_id, "count_runs", {"n": 1})
    result_subject = subjects.results_subject(TENANT, AGENT, call_id)
    nc = await agent(gw)
    try:
        first = await listen(nc, result_subject)
        await send(nc, body)
        original = await first.next_msg(timeout=GIVE_UP_S)
        await first.unsubscribe()

        again = await listen(nc, result_subject)
        await send(nc, body)  # the same call_id, same agent: a retry
        answer = await again.next_msg(timeout=GIVE_UP_S)
    finally:
        await nc.close()

    assert answer.data == original.data
    result = msgspec.json.decode(answer.data, type=ToolResult)
    assert result.ok and result.data == {"call_id": call_id}
    await settled(gw)
    assert runs_of(gw.data_dir).count(call_id) == 1  # ran once
    assert await stored_on(gw, result_subject) == 1  # stored once: the copy was not stored
    events = events_of(await gw.events(), call_id)
    assert sum(isinstance(e, ExecutionStarted) for e in events) == 1
    assert sum(isinstance(e, ResultAttached) for e in events) == 1
    assert sum(isinstance(e, CallRetried) for e in events) == 1  # the retry, on record
    assert audited(gw, call_id, "ResultAttached") == 1
    assert audited(gw, call_id, "CallRequested") == 2  # both messages are on record


async def test_a_retry_of_a_call_waiting_for_a_human_gets_its_pending_notice(
    gw: Gateway,
) -> None:
    call_id = new_call_id()
    body = call_body(call_id, "approved_action", {"amount": 900})
    pending_subject = subjects.pending_subject(TENANT, AGENT, call_id)
    nc = await agent(gw)
    try:
        first = await listen(nc, pending_subject)
        await send(nc, body)
        original = await first.next_msg(timeout=GIVE_UP_S)
        await first.unsubscribe()

        again = await listen(nc, pending_subject)
        await send(nc, body)
        answer = await again.next_msg(timeout=GIVE_UP_S)
    finally:
        await nc.close()

    assert answer.data == original.data
    assert msgspec.json.decode(answer.data, type=PendingNotice).call_id == call_id
    await settled(gw)
    assert await stored_on(gw, pending_subject) == 1
    events = events_of(await gw.events(), call_id)
    assert sum(isinstance(e, ApprovalRequested) for e in events) == 1  # asked once
    assert call_id not in runs_of(gw.data_dir, "approved_action")


# ---------------------------------------------------------------- a call_id reused


async def test_a_call_id_reused_with_other_arguments_is_refused_not_given_the_first_result(
    gw: Gateway,
) -> None:
    """The platform's bug (a counter that restarts, a call_id per turn): the second call
    must not be told the first call's outcome as its own, and must not run."""
    call_id = new_call_id()
    result_subject = subjects.results_subject(TENANT, AGENT, call_id)
    nc = await agent(gw)
    try:
        first = await listen(nc, result_subject)
        await send(nc, call_body(call_id, "count_runs", {"n": 1}))
        original = await first.next_msg(timeout=GIVE_UP_S)
        await first.unsubscribe()

        again = await listen(nc, result_subject)
        await send(nc, call_body(call_id, "count_runs", {"n": 2}))  # another call
        answer = await again.next_msg(timeout=GIVE_UP_S)
    finally:
        await nc.close()

    # The first result names the call it answers.
    assert original.headers is not None
    assert original.headers[ANSWERS_TOOL_HEADER] == "count_runs"
    assert original.headers[ANSWERS_ARGUMENTS_HEADER] == arguments_sha256({"n": 1})
    # The second call is refused, and the refusal names the refused call.
    refusal = msgspec.json.decode(answer.data, type=ToolResult)
    assert not refusal.ok and refusal.status == "invalid_arguments"
    assert refusal.error is not None and refusal.error.code == "CALL_ID_REUSED"
    assert answer.data != original.data
    assert answer.headers is not None and answer.headers[REFUSED_HEADER] == "CALL_ID_REUSED"
    assert answer.headers[ANSWERS_ARGUMENTS_HEADER] == arguments_sha256({"n": 2})
    await settled(gw)
    assert runs_of(gw.data_dir).count(call_id) == 1  # the first call ran, once
    assert await stored_on(gw, result_subject) == 1  # the refusal was not stored
    client = await gw.client(TENANT, AGENT)
    try:
        stored = await client.result(call_id)
    finally:
        await client.close()
    assert stored is not None and stored.ok  # the call_id's result is still the first's
    events = events_of(await gw.events(), call_id)
    retried = [e for e in events if isinstance(e, CallRetried)]
    assert len(retried) == 1 and retried[0].arguments_sha256 == arguments_sha256({"n": 2})


async def test_gateway_client_gets_call_id_reused_for_a_stored_result_of_another_call(
    gw: Gateway,
) -> None:
    """GatewayClient reads a chosen call_id's stored result at once: it checks that the
    result names its call, so the refusal does not depend on the attacher's answer."""
    client = await gw.client(TENANT, AGENT)
    call_id = new_call_id()
    try:
        first = await client.call(
            "count_runs", {"n": 1}, user="u-alice", session="s-1", call_id=call_id
        )
        other = await client.call(
            "count_runs", {"n": 2}, user="u-alice", session="s-1", call_id=call_id
        )
        retry = await client.call(
            "count_runs", {"n": 1}, user="u-alice", session="s-1", call_id=call_id
        )
        other_tool = await client.call(
            "echo", {"n": 1}, user="u-alice", session="s-1", call_id=call_id
        )
    finally:
        await client.close()

    assert first.ok and first.data == {"call_id": call_id}
    assert other.error is not None and other.error.code == "CALL_ID_REUSED"
    assert retry == first  # the same call again: its stored result
    assert other_tool.error is not None and other_tool.error.code == "CALL_ID_REUSED"
    await settled(gw)
    assert runs_of(gw.data_dir).count(call_id) == 1


async def test_a_call_id_reused_while_the_first_call_waits_for_a_human_is_refused(
    gw: Gateway,
) -> None:
    """An approval is bound to the first call's arguments; a second call under its
    call_id must neither be told it waits for that approval nor get its result. While
    the first call waits, its own caller may be listening on the result subject: the
    gateway sends no refusal there (it would end the first caller's wait wrongly);
    GatewayClient refuses the second call itself, from the stored notice's headers."""
    call_id = new_call_id()
    result_subject = subjects.results_subject(TENANT, AGENT, call_id)
    pending_subject = subjects.pending_subject(TENANT, AGENT, call_id)
    nc = await agent(gw)
    client = await gw.client(TENANT, AGENT)
    try:
        notices = await listen(nc, pending_subject)
        first_caller = await listen(nc, result_subject)
        await send(nc, call_body(call_id, "approved_action", {"amount": 900}))
        notice = await notices.next_msg(timeout=GIVE_UP_S)

        await send(nc, call_body(call_id, "approved_action", {"amount": 90000}))
        other = await client.call(
            "approved_action",
            {"amount": 90000},
            user="u-alice",
            session="s-1",
            call_id=call_id,
            timeout=GIVE_UP_S,
        )
        await settled(gw)  # the attacher has handled both retries
        await flushed(nc)
        assert first_caller.pending_msgs == 0  # nothing reached the first call's caller
        stored = await client.result(call_id)
    finally:
        await client.close()
        await nc.close()

    assert notice.headers is not None
    assert notice.headers[ANSWERS_ARGUMENTS_HEADER] == arguments_sha256({"amount": 900})
    assert other.error is not None and other.error.code == "CALL_ID_REUSED"
    assert stored is None  # the first call still waits for its human
    events = events_of(await gw.events(), call_id)
    assert sum(isinstance(e, ApprovalRequested) for e in events) == 1  # for the first only
    assert sum(isinstance(e, CallRetried) for e in events) == 2
    assert call_id not in runs_of(gw.data_dir, "approved_action")


# ---------------------------------------------------------------- bodies that are not JSON


@pytest.mark.parametrize(
    "broken",
    [
        lambda call_id: (
            b'{"call_id": "%s", "tool": "echo", "arguments": {"amount": NaN}}' % call_id.encode()
        ),
        lambda call_id: b'{"call_id": "%s", "tool": "echo", "arguments": {"payl' % call_id.encode(),
    ],
    ids=["NaN", "truncated"],
)
async def test_a_body_that_is_not_json_but_names_its_call_id_gets_malformed_call(
    gw: Gateway, broken
) -> None:  # type: ignore[no-untyped-def]
    call_id = new_call_id()
    result_subject = subjects.results_subject(TENANT, AGENT, call_id)
    nc = await agent(gw)
    try:
        answers = await listen(nc, result_subject)
        await send(nc, broken(call_id))
        answer = await answers.next_msg(timeout=GIVE_UP_S)
    finally:
        await nc.close()
    result = msgspec.json.decode(answer.data, type=ToolResult)
    assert (result.call_id, result.status) == (call_id, "invalid_arguments")
    assert result.error is not None and result.error.code == "MALFORMED_CALL"
    await settled(gw)
    dead = [e for e in events_of(await gw.events(), call_id) if isinstance(e, MessageDeadLettered)]
    assert len(dead) == 1  # and a dead letter, as for any malformed call


# ---------------------------------------------------------------- sizes


async def test_a_call_of_7_mib_gets_payload_too_large_as_its_result(gw: Gateway) -> None:
    call_id = new_call_id()
    body = call_body(call_id, "echo", {"payload": "x" * (7 * 1024 * 1024)})
    assert MAX_CALL_BYTES < len(body) < MAX_PAYLOAD_BYTES
    result_subject = subjects.results_subject(TENANT, AGENT, call_id)
    nc = await agent(gw)
    try:
        answers = await listen(nc, result_subject)
        ack = await send(nc, body)
        answer = await answers.next_msg(timeout=GIVE_UP_S)
    finally:
        await nc.close()
    assert "error" not in ack and ack["stream"] == subjects.CALLS_STREAM
    result = msgspec.json.decode(answer.data, type=ToolResult)
    assert (result.call_id, result.status) == (call_id, "invalid_arguments")
    assert result.error is not None and result.error.code == "PAYLOAD_TOO_LARGE"
    assert str(len(body)) in result.error.message
    await settled(gw)
    assert not any(isinstance(e, ExecutionStarted) for e in events_of(await gw.events(), call_id))
