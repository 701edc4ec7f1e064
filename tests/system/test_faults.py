"""Crashes, duplicates and bad input: the invariants that make toolgate trustworthy."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec
import pytest

from tests.harness import Gateway, count_types, events_of
from tests.tools.faulty import runs_of
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import (
    Authorization,
    CallAuthorized,
    ExecutionRefused,
    MessageDeadLettered,
    encode_event,
    utc_now,
)
from toolgate.services.client.gateway_client import new_call_id
from toolgate.services.executor.tools.save_evidence import read_evidence

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")


async def _wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.2)


async def test_same_call_id_twice_runs_once_and_gets_the_same_result(
        shared_gateway: Gateway) -> None:
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={},
                    principal=BOB)
    async with await shared_gateway.client() as client:
        first = await client.submit(call)
        second = await client.submit(call)
    assert first.ok and first == second
    assert runs_of(shared_gateway.data_dir).count(call.call_id) == 1


async def test_republish_outside_the_dedupe_window_replays_instead_of_running(
        shared_gateway: Gateway) -> None:
    """Without Nats-Msg-Id the stream cannot drop it: the executor's record must."""
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    async with await shared_gateway.client() as client:
        first = await client.submit(call)
        nc = await shared_gateway.connect()
        await nc.jetstream().publish(subjects.CALLS, msgspec.json.encode(call))
        await nc.close()

        async def replayed() -> bool:
            events = events_of(await shared_gateway.events(), call.call_id)
            return count_types(events)["ResultAttached"] == 2

        await _wait_for(replayed)
        again = await client.result(call.call_id)
    assert again == first
    assert runs_of(shared_gateway.data_dir).count(call.call_id) == 1
    outcomes = [e for e in events_of(await shared_gateway.events(), call.call_id)
                if type(e).__name__ == "ExecutionSucceeded"]
    assert [e.replayed for e in outcomes] == [False, True]


async def test_executor_killed_mid_run_every_call_one_result_evidence_once(
        gateway: Gateway) -> None:
    calls = [ToolCall(call_id=f"ev-{i:03d}", tool="save_evidence", arguments={
        "task_id": "task_kill", "claim": f"claim {i}", "source_url": "https://example.org"},
        principal=BOB, task_id="task_kill") for i in range(200)]
    executor = gateway.service("executor")
    async with await gateway.client() as client:
        for call in calls:
            await client.publish(call)

        async def some_ran() -> bool:
            evidence = read_evidence(gateway.data_dir / "tools" / "save_evidence",
                                     "acme", "task_kill")
            return len(evidence) >= 20

        await _wait_for(some_ran)
        executor.kill()
        stored_at_kill = len(read_evidence(gateway.data_dir / "tools" / "save_evidence",
                                           "acme", "task_kill"))
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
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={"sleep_s": 30},
                    principal=BOB)
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


async def test_malformed_and_oversized_calls_get_clear_answers(shared_gateway: Gateway) -> None:
    nc = await shared_gateway.connect()
    js = nc.jetstream()
    missing_tool_id = new_call_id()
    oversized_id = new_call_id()
    async with await shared_gateway.client() as client:
        waiting = {cid: asyncio.create_task(_result_of(client, cid))
                   for cid in (missing_tool_id, oversized_id)}
        await js.publish(subjects.CALLS, b"{not json at all")
        await js.publish(subjects.CALLS, b'{"call_id": "bad.id.with.dots", "tool": "echo"}')
        await js.publish(subjects.CALLS, msgspec.json.encode(
            {"call_id": missing_tool_id, "arguments": {}, "principal": msgspec.to_builtins(BOB)}))
        big = ToolCall(call_id=oversized_id, tool="echo",
                       arguments={"payload": "x" * (5 * 1024 * 1024)}, principal=BOB)
        await js.publish(subjects.CALLS, msgspec.json.encode(big))
        missing_tool = await waiting[missing_tool_id]
        oversized = await waiting[oversized_id]
    await nc.close()
    assert missing_tool.status == "invalid_arguments"
    assert missing_tool.error is not None and missing_tool.error.code == "MALFORMED_CALL"
    assert "tool" in missing_tool.error.message
    assert oversized.status == "invalid_arguments"
    assert oversized.error is not None and oversized.error.code == "PAYLOAD_TOO_LARGE"

    async def dead_letters_recorded() -> bool:
        events = await shared_gateway.events()
        return len([e for e in events if isinstance(e, MessageDeadLettered)]) >= 3

    await _wait_for(dead_letters_recorded)
    reasons = [e.reason for e in await shared_gateway.events()
               if isinstance(e, MessageDeadLettered)]
    assert any("malformed ToolCall" in r for r in reasons)
    assert any("subject-safe" in r for r in reasons)
    assert shared_gateway.all_alive()


async def _result_of(client, call_id: str):  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + 60
    while asyncio.get_running_loop().time() < deadline:
        result = await client.result(call_id)
        if result is not None:
            return result
        await asyncio.sleep(0.1)
    raise TimeoutError(call_id)


async def test_forged_executor_message_is_refused_and_never_runs(
        shared_gateway: Gateway) -> None:
    call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={}, principal=BOB)
    forged = CallAuthorized(
        event_id=new_call_id(), call_id=call.call_id, occurred_at=utc_now(), service="attacker",
        tool="count_runs", principal=BOB, call=call, policy_version="made-up",
        authorization=Authorization(
            call_id=call.call_id, tool="count_runs",
            arguments_sha256=arguments_sha256(call.arguments), policy_version="made-up",
            expires_at=utc_now() + timedelta(hours=1), signature="Zm9yZ2Vk"))
    nc = await shared_gateway.connect()
    await nc.jetstream().publish(subjects.event_subject(CallAuthorized, "count_runs"),
                                 encode_event(forged))
    await nc.close()

    async def refused() -> bool:
        return any(isinstance(e, ExecutionRefused)
                   for e in events_of(await shared_gateway.events(), call.call_id))

    await _wait_for(refused)
    assert call.call_id not in runs_of(shared_gateway.data_dir)


async def test_arguments_altered_after_authorization_are_refused(
        shared_gateway: Gateway) -> None:
    """Take a real, signed authorization and change the arguments it carries."""
    call = ToolCall(call_id=new_call_id(), tool="echo", arguments={"payload": "safe"},
                    principal=BOB)
    async with await shared_gateway.client() as client:
        assert (await client.submit(call)).ok
    genuine = next(e for e in events_of(await shared_gateway.events(), call.call_id)
                   if isinstance(e, CallAuthorized))
    altered_call = ToolCall(call_id=new_call_id(), tool="count_runs", arguments={},
                            principal=BOB)
    tampered = msgspec.structs.replace(
        genuine, event_id=new_call_id(), call_id=altered_call.call_id, call=altered_call,
        tool="count_runs")
    nc = await shared_gateway.connect()
    await nc.jetstream().publish(subjects.event_subject(CallAuthorized, "count_runs"),
                                 encode_event(tampered))
    await nc.close()

    async def refused() -> bool:
        return any(isinstance(e, ExecutionRefused) for e in
                   events_of(await shared_gateway.events(), altered_call.call_id))

    await _wait_for(refused)
    assert altered_call.call_id not in runs_of(shared_gateway.data_dir)


async def test_nats_server_restart_loses_no_call(gateway: Gateway) -> None:
    calls = [ToolCall(call_id=f"nr-{i:03d}", tool="echo", arguments={"payload": i},
                      principal=BOB) for i in range(100)]
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
