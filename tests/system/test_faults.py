"""Crashes, duplicates and bad input: the invariants that make toolgate trustworthy."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import nats
import pytest

from tests.harness import Gateway, count_types, events_of, publish_event
from tests.tools.faulty import runs_of
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall, ToolError
from toolgate.contracts.events import (
    ArgumentsValidated,
    Authorization,
    CallAbandoned,
    CallAuthorized,
    CallDenied,
    ExecutionRefused,
    MessageDeadLettered,
    encode_event,
    utc_now,
)
from toolgate.runtime.creds import connect_options
from toolgate.runtime.settling import MAX_ATTEMPTS
from toolgate.services.executor.tools.save_evidence import read_evidence
from toolgate.services.validator.logic import MAX_ARGUMENT_DEPTH

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")


async def _wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.2)


async def test_same_call_id_twice_runs_once_and_gets_the_same_result(
    shared_gateway: Gateway,
) -> None:
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    async with await shared_gateway.client() as client:
        first = await client.submit(call)
        second = await client.submit(call)
    assert first.ok and first == second
    assert runs_of(shared_gateway.data_dir).count(call.call_id) == 1


async def test_republish_by_the_same_agent_emits_nothing_and_keeps_the_first_result(
    shared_gateway: Gateway,
) -> None:
    """v2: no Nats-Msg-Id; the validator's claim on (tenant, agent, call_id) stops it.

    (v1 let the second copy through to the executor, which replayed its recorded
    outcome and a second ResultAttached followed; now nothing follows at all.)
    """
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    async with await shared_gateway.client() as client:
        first = await client.submit(call)
        # The agent's own raw publish, as any NATS client of that identity would send it.
        nc = await nats.connect(
            shared_gateway.url,
            **connect_options(await shared_gateway.agent_creds(BOB.tenant, BOB.agent)),
        )
        ack = await nc.jetstream().publish(
            subjects.calls_subject(BOB.tenant, BOB.agent), msgspec.json.encode(call)
        )
        await nc.close()
        assert not ack.duplicate  # stored: the stream itself does not dedupe calls

        async def validator_done() -> bool:
            return await shared_gateway.settled(subjects.CALLS_STREAM, "validator")

        await _wait_for(validator_done)
        again = await client.result(call.call_id)
    assert again == first
    assert runs_of(shared_gateway.data_dir).count(call.call_id) == 1
    types = count_types(events_of(await shared_gateway.events(), call.call_id))
    assert types["ArgumentsValidated"] == 1 and types["ExecutionStarted"] == 1
    assert types["ResultAttached"] == 1


async def test_the_same_call_id_from_another_agent_is_another_call(shared_gateway: Gateway) -> None:
    call_id = new_call_id()
    async with (
        await shared_gateway.client("acme", "researcher") as researcher,
        await shared_gateway.client("acme", "writer") as writer,
    ):
        mine = await researcher.call("count_runs", {}, user="u-bob", session="s-9", call_id=call_id)
        theirs = await writer.call(
            "count_runs", {"n": 2}, user="u-carol", session="s-2", call_id=call_id
        )
        assert mine.ok and theirs.ok
        # Each agent reads its own result under the shared call_id, and only its own.
        assert await researcher.result(call_id) == mine
        assert await writer.result(call_id) == theirs
    assert runs_of(shared_gateway.data_dir).count(call_id) == 2
    senders = {
        (e.principal.tenant, e.principal.agent)
        for e in events_of(await shared_gateway.events(), call_id)
        if type(e).__name__ == "ExecutionSucceeded" and e.principal
    }
    assert senders == {("acme", "researcher"), ("acme", "writer")}


async def test_a_second_authorization_of_a_finished_call_replays_instead_of_running(
    shared_gateway: Gateway,
) -> None:
    """Invariant 2: a genuine authorization delivered again (a redelivery, a copy under
    another event id) replays the recorded outcome; the stored result stays the first."""
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    async with await shared_gateway.client() as client:
        first = await client.submit(call)
        genuine = next(
            e
            for e in events_of(await shared_gateway.events(), call.call_id)
            if isinstance(e, CallAuthorized)
        )
        await publish_event(
            shared_gateway.url,
            msgspec.structs.replace(genuine, event_id=new_call_id()),
            **shared_gateway.admin,
        )

        async def replayed() -> bool:
            events = events_of(await shared_gateway.events(), call.call_id)
            return sum(1 for e in events if type(e).__name__ == "ExecutionSucceeded") == 2

        await _wait_for(replayed)

        async def attacher_done() -> bool:
            return await shared_gateway.settled(
                subjects.EVENTS_STREAM, "attacher-ExecutionSucceeded"
            )

        await _wait_for(attacher_done)
        again = await client.result(call.call_id)
    assert again == first
    assert runs_of(shared_gateway.data_dir).count(call.call_id) == 1
    events = events_of(await shared_gateway.events(), call.call_id)
    outcomes = [e for e in events if type(e).__name__ == "ExecutionSucceeded"]
    assert [e.replayed for e in outcomes] == [False, True]
    # Results are written once: the replayed outcome attaches nothing new.
    assert count_types(events)["ResultAttached"] == 1


async def test_executor_killed_mid_run_every_call_one_result_evidence_once(
    gateway: Gateway,
) -> None:
    calls = [
        ToolCall(
            call_id=f"ev-{i:03d}",
            tool="save_evidence",
            arguments={
                "task_id": "task_kill",
                "claim": f"claim {i}",
                "source_url": "https://example.org",
            },
            principal=BOB,
            task_id="task_kill",
        )
        for i in range(200)
    ]
    executor = gateway.service("executor")
    async with await gateway.client() as client:
        for call in calls:
            await client.publish(call)

        async def some_ran() -> bool:
            evidence = read_evidence(
                gateway.data_dir / "tools" / "save_evidence", "acme", "task_kill"
            )
            return len(evidence) >= 20

        await _wait_for(some_ran)
        executor.kill()
        stored_at_kill = len(
            read_evidence(gateway.data_dir / "tools" / "save_evidence", "acme", "task_kill")
        )
        executor.start()
        results = await asyncio.gather(*(client.submit(call, timeout=120) for call in calls))
    assert stored_at_kill < 200, "the kill must land mid-run to prove anything"
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    evidence = read_evidence(gateway.data_dir / "tools" / "save_evidence", "acme", "task_kill")
    assert sorted(row["call_id"] for row in evidence) == sorted(c.call_id for c in calls)
    events = await gateway.events()
    for call in calls:
        assert count_types(events_of(events, call.call_id))["ResultAttached"] == 1, call.call_id


async def test_interrupted_non_idempotent_call_is_not_run_again(gateway: Gateway) -> None:
    call = ToolCall(
        call_id=new_call_id(), tool="count_runs", arguments={"sleep_s": 30}, principal=BOB
    )
    async with await gateway.client() as client:
        await client.publish(call)

        async def started() -> bool:
            return call.call_id in runs_of(gateway.data_dir)

        await _wait_for(started)
        gateway.service("executor").kill()
        gateway.service("executor").start()
        result = await client.submit(call, timeout=120)
    assert result.status == "execution_error"
    assert result.error is not None and result.error.code == "OUTCOME_UNKNOWN"
    assert runs_of(gateway.data_dir).count(call.call_id) == 1


async def test_malformed_oversized_and_deep_calls_get_clear_answers(
    shared_gateway: Gateway,
) -> None:
    # What any NATS client of the agent's identity can publish on its own calls subject.
    nc = await nats.connect(
        shared_gateway.url,
        **connect_options(await shared_gateway.agent_creds(BOB.tenant, BOB.agent)),
    )
    js = nc.jetstream()
    mine = subjects.calls_subject(BOB.tenant, BOB.agent)
    missing_tool_id = new_call_id()
    async with await shared_gateway.client() as client:
        waiting = asyncio.create_task(_result_of(client, missing_tool_id))
        await js.publish(mine, b"{not json at all")
        await js.publish(mine, b'{"call_id": "bad.id.with.dots", "tool": "echo"}')
        await js.publish(
            mine,
            msgspec.json.encode(
                {"call_id": missing_tool_id, "arguments": {}, "principal": msgspec.to_builtins(BOB)}
            ),
        )
        missing_tool = await waiting

        # A call over MAX_CALL_BYTES (under the server's max_payload) is stored and the
        # validator answers it; GatewayClient answers one locally, without sending it.
        big = ToolCall(
            call_id=new_call_id(),
            tool="echo",
            arguments={"payload": "x" * (5 * 1024 * 1024)},
            principal=BOB,
        )
        await js.publish(mine, msgspec.json.encode(big))
        oversized = await _result_of(client, big.call_id)
        unsent = msgspec.structs.replace(big, call_id=new_call_id())
        refused_locally = await client.submit(unsent)
        assert refused_locally.error is not None
        assert refused_locally.error.code == "PAYLOAD_TOO_LARGE"
        assert await client.result(unsent.call_id) is None  # never sent, nothing stored

        deep: object = "leaf"
        for _ in range(MAX_ARGUMENT_DEPTH + 1):
            deep = [deep]
        too_deep = await client.call("echo", {"payload": deep}, user="u-bob", session="s-9")
    await nc.close()
    assert missing_tool.status == "invalid_arguments"
    assert missing_tool.error is not None and missing_tool.error.code == "MALFORMED_CALL"
    assert "tool" in missing_tool.error.message
    assert oversized.status == "invalid_arguments"
    assert oversized.error is not None and oversized.error.code == "PAYLOAD_TOO_LARGE"
    assert too_deep.status == "invalid_arguments"
    assert too_deep.error is not None and too_deep.error.code == "NESTING_TOO_DEEP"

    async def dead_letters_recorded() -> bool:
        events = await shared_gateway.events()
        return len([e for e in events if isinstance(e, MessageDeadLettered)]) >= 3

    await _wait_for(dead_letters_recorded)
    letters = [e for e in await shared_gateway.events() if isinstance(e, MessageDeadLettered)]
    assert any("malformed ToolCall" in e.reason for e in letters)
    assert any("subject-safe" in e.reason for e in letters)
    assert {e.source_subject for e in letters if e.service == "validator"} == {mine}
    big_events = events_of(await shared_gateway.events(), big.call_id)
    assert [type(e).__name__ for e in big_events] == ["ArgumentsRejected", "ResultAttached"]
    assert shared_gateway.all_alive()


async def _result_of(client, call_id: str):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        result = await client.result(call_id)
        if result is not None:
            return result
        await asyncio.sleep(0.1)
    raise TimeoutError(call_id)


async def test_forged_executor_message_is_refused_and_never_runs(shared_gateway: Gateway) -> None:
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    forged = CallAuthorized(
        event_id=new_call_id(),
        call_id=call.call_id,
        occurred_at=utc_now(),
        service="attacker",
        tool="count_runs",
        principal=BOB,
        call=call,
        policy_version="made-up",
        authorization=Authorization(
            call_id=call.call_id,
            tool="count_runs",
            arguments_sha256=arguments_sha256(call.arguments),
            policy_version="made-up",
            expires_at=utc_now() + timedelta(hours=1),
            signature="Zm9yZ2Vk",
        ),
    )
    nc = await shared_gateway.connect()
    await nc.jetstream().publish(
        subjects.event_subject(CallAuthorized, "count_runs"), encode_event(forged)
    )
    await nc.close()

    async def refused() -> bool:
        return any(
            isinstance(e, ExecutionRefused)
            for e in events_of(await shared_gateway.events(), call.call_id)
        )

    await _wait_for(refused)
    assert call.call_id not in runs_of(shared_gateway.data_dir)


async def test_arguments_altered_after_authorization_are_refused(shared_gateway: Gateway) -> None:
    """Take a real, signed authorization and change the arguments it carries."""
    call = ToolCall(
        call_id=new_call_id(), tool="echo", arguments={"payload": "safe"}, principal=BOB
    )
    async with await shared_gateway.client() as client:
        assert (await client.submit(call)).ok
    genuine = next(
        e
        for e in events_of(await shared_gateway.events(), call.call_id)
        if isinstance(e, CallAuthorized)
    )
    altered_call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    tampered = msgspec.structs.replace(
        genuine,
        event_id=new_call_id(),
        call_id=altered_call.call_id,
        call=altered_call,
        tool="count_runs",
    )
    nc = await shared_gateway.connect()
    await nc.jetstream().publish(
        subjects.event_subject(CallAuthorized, "count_runs"), encode_event(tampered)
    )
    await nc.close()

    async def refused() -> bool:
        return any(
            isinstance(e, ExecutionRefused)
            for e in events_of(await shared_gateway.events(), altered_call.call_id)
        )

    await _wait_for(refused)
    assert altered_call.call_id not in runs_of(shared_gateway.data_dir)


async def test_a_genuine_authorization_moved_to_another_principal_is_refused(
    shared_gateway: Gateway,
) -> None:
    """v2: the policy signs the six-tuple, and the outcome key is (tenant, agent, call_id):
    a signed decision for BOB's call, moved to another tenant's identity, must not run
    as a new call of that tenant."""
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    async with await shared_gateway.client() as client:
        assert (await client.submit(call)).ok
    genuine = next(
        e
        for e in events_of(await shared_gateway.events(), call.call_id)
        if isinstance(e, CallAuthorized)
    )
    other = msgspec.structs.replace(BOB, tenant="globex")
    moved = msgspec.structs.replace(
        genuine,
        event_id=new_call_id(),
        principal=other,
        call=msgspec.structs.replace(genuine.call, principal=other),
    )
    await publish_event(shared_gateway.url, moved, **shared_gateway.admin)

    async def refused() -> bool:
        return any(
            isinstance(e, ExecutionRefused) and e.principal == other
            for e in events_of(await shared_gateway.events(), call.call_id)
        )

    await _wait_for(refused)
    assert runs_of(shared_gateway.data_dir).count(call.call_id) == 1


async def test_nats_server_restart_loses_no_call(gateway: Gateway) -> None:
    calls = [
        ToolCall(call_id=f"nr-{i:03d}", tool="echo", arguments={"payload": i}, principal=BOB)
        for i in range(100)
    ]
    async with await gateway.client() as client:
        for call in calls[:50]:
            await client.publish(call)
    assert gateway.stack.nats is not None
    gateway.stack.nats.stop()
    gateway.stack.nats.start()
    async with await gateway.client() as client:
        for call in calls[50:]:
            await client.publish(call)
        results = await asyncio.gather(*(client.submit(c, timeout=120) for c in calls))
    assert [r.data for r in results] == [{"payload": i} for i in range(100)]
    assert gateway.all_alive()


async def test_a_stage_that_gives_up_on_a_call_still_answers_the_agent(
    shared_gateway: Gateway,
) -> None:
    """A stage whose attempts run out (here: the policy service, handed an event of the
    wrong type on its subject, as a producer's bug would; it raises every time) records
    a dead letter and ends the call: the agent gets an error result it can act on,
    instead of waiting for a result that never comes."""
    call_id = new_call_id()
    misrouted = CallDenied(
        event_id=new_call_id(),
        call_id=call_id,
        occurred_at=utc_now(),
        service="a-buggy-producer",
        tool="echo",
        principal=BOB,
        status="denied",
        error=ToolError(code="POLICY_DENIED", message="not for the policy service"),
    )
    nc = await shared_gateway.connect()
    await nc.jetstream().publish(
        subjects.event_subject(ArgumentsValidated, "echo"), encode_event(misrouted)
    )
    await nc.close()
    async with await shared_gateway.client() as client:
        result = await _result_of(client, call_id)
    assert (result.ok, result.status) == (False, "execution_error")
    assert result.error is not None and result.error.code == "GATEWAY_GAVE_UP"
    assert result.error.retryable and "the tool did not run" in result.error.message
    events = events_of(await shared_gateway.events(), call_id)
    letters = [e for e in events if isinstance(e, MessageDeadLettered)]
    assert [(e.service, e.principal) for e in letters] == [("policy", BOB)]
    assert f"after {MAX_ATTEMPTS} failed attempt(s)" in letters[0].reason
    assert "TypeError" in letters[0].reason
    assert [e.service for e in events if isinstance(e, CallAbandoned)] == ["policy"]
    assert not any(isinstance(e, CallAuthorized) for e in events)
