"""How many records a call costs the executor (issue #26): a tool that may have effects
is recorded `started` before it runs and `done` after, and the call's start and end
are both stored, in that order. (Recording an inline, idempotent tool once was
measured on a branch and not merged: see docs/benchmarks/2026-12-03-round-trips.md.)
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from tests.harness import Gateway, count_types, events_of
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.services.executor.logic import OutcomeRecord

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")


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


async def test_a_tool_that_may_have_effects_is_recorded_started_before_it_runs(
    shared_gateway: Gateway,
) -> None:
    states = await _writes_to_outcome(shared_gateway, "count_runs", {})
    assert states == ["started", "done"]
