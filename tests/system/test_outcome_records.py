"""How many records a call costs the executor, and that fewer lose nothing (issue #26).

An inline, idempotent tool (echo) is run first and recorded once (`done`, by a
create); a tool that runs in a thread or may have effects keeps its `started`
record before it runs. Either way the call's start and end are both stored, in
that order, and a call_id used again replays rather than runs.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import msgspec
import pytest

from tests.harness import Gateway, count_types, events_of
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import (
    CallAuthorized,
    ExecutionStarted,
    ExecutionSucceeded,
    derive_event_id,
    encode_event,
)
from toolgate.services.executor.logic import OutcomeRecord

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
STARTED_AT = datetime(2026, 12, 4, 9, 0, 0, 123456, tzinfo=UTC)


async def _writes_to_outcome(
    gateway: Gateway, tool: str, arguments: dict[str, object]
) -> list[str]:
    """Run one call; the states written to its outcome record, in order (a KV watch)."""
    call = ToolCall(call_id=new_call_id(), tool=tool, arguments=arguments, principal=BOB)
    key = subjects.call_key(BOB.tenant, BOB.agent, call.call_id)
    nc = await gateway.connect()
    states: list[str] = []
    try:
        kv = await nc.jetstream().key_value(subjects.OUTCOMES_BUCKET)
        watcher = await kv.watch(key)
        async with await gateway.client() as client:
            result = await client.submit(call)
        assert result.ok, result

        async def watch() -> None:
            async for entry in watcher:
                if entry is None:  # the end of what was stored before the watch
                    continue
                states.append(msgspec.msgpack.decode(entry.value or b"", type=OutcomeRecord).state)
                if states[-1] == "done":
                    return

        await asyncio.wait_for(watch(), 30)
        await asyncio.sleep(0.5)  # a write after `done` would show here
        while True:
            try:
                entry = await asyncio.wait_for(watcher.updates(), 0.1)
            except TimeoutError:
                break
            if entry is not None:
                states.append("late")
        await watcher.stop()
    finally:
        await nc.close()
    events = events_of(await gateway.events(), call.call_id)
    kinds = [type(e).__name__ for e in events]
    assert count_types(events)["ExecutionStarted"] == 1
    assert count_types(events)["ExecutionSucceeded"] == 1
    assert kinds.index("ExecutionStarted") < kinds.index("ExecutionSucceeded")
    return states


async def test_an_inline_idempotent_tool_is_recorded_once_and_both_events_are_stored(
    shared_gateway: Gateway,
) -> None:
    assert await _writes_to_outcome(shared_gateway, "echo", {"payload": 1}) == ["done"]


async def test_a_tool_that_may_have_effects_is_recorded_started_before_it_runs(
    shared_gateway: Gateway,
) -> None:
    states = await _writes_to_outcome(shared_gateway, "count_runs", {})
    assert states == ["started", "done"]


async def test_an_outcome_recorded_by_a_worker_that_died_is_published_with_its_start(
    shared_gateway: Gateway,
) -> None:
    """The one record of an inline tool comes before its events: a worker that died
    between the two leaves a `done` record and nothing published. The redelivered
    message replays the outcome and its ExecutionStarted too, under the ids the dead
    worker would have used (so a copy that did get stored is dropped as a duplicate)."""
    async with await shared_gateway.client() as client:
        first = await client.call("echo", {"payload": "x"}, user="u-bob", session="s-9")
    assert first.ok
    events = events_of(await shared_gateway.events(), first.call_id)
    genuine = next(e for e in events if isinstance(e, CallAuthorized))
    terminal = next(e for e in events if isinstance(e, ExecutionSucceeded))
    principal = genuine.call.principal
    key = subjects.call_key(principal.tenant, principal.agent, first.call_id)
    nc = await shared_gateway.connect()
    try:
        js = nc.jetstream()
        kv = await js.key_value(subjects.OUTCOMES_BUCKET)
        # The message the worker "died" on: the next one stored in the events stream.
        sequence = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq + 1
        message_id = f"seq:{sequence}"
        recorded = msgspec.structs.replace(
            terminal, event_id=derive_event_id(message_id, "outcome")
        )
        await kv.put(
            key,
            msgspec.msgpack.encode(
                OutcomeRecord(
                    "done",
                    genuine.authorization.arguments_sha256,
                    1,
                    "executor@gone",
                    encode_event(recorded),
                    started_at=STARTED_AT,
                )
            ),
        )
        ack = await js.publish(
            subjects.subject_of(genuine),
            encode_event(msgspec.structs.replace(genuine, event_id=new_call_id())),
            stream=subjects.EVENTS_STREAM,
        )
        assert ack.seq == sequence  # nothing else was stored meanwhile

        async def both_published() -> bool:
            ids = {e.event_id for e in events_of(await shared_gateway.events(), first.call_id)}
            return derive_event_id(message_id, "outcome") in ids

        deadline = asyncio.get_running_loop().time() + 30
        while not await both_published():
            assert asyncio.get_running_loop().time() < deadline, "the outcome was not replayed"
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
    events = events_of(await shared_gateway.events(), first.call_id)
    started = [e for e in events if isinstance(e, ExecutionStarted)]
    assert [e.event_id for e in started][-1] == derive_event_id(message_id, "started/1")
    assert started[-1].worker == "executor@gone"
    # The time recorded with the outcome: a replay is the very event the worker would
    # have published (were it stored and then replayed past the duplicate window, the
    # audit would otherwise hold two events under one id that differ in their time).
    assert started[-1].occurred_at == STARTED_AT
