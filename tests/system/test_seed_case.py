"""The seed article's case, end to end, every service its own process."""

from __future__ import annotations

import asyncio

import pytest

from tests.harness import Gateway, count_types, events_of
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts.calls import Principal

pytestmark = pytest.mark.system

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")


async def test_search_fetch_save_evidence_succeed(
    shared_gateway: Gateway, document_server: str
) -> None:
    async with await shared_gateway.client() as client:
        found = await client.call(
            "search_sources",
            {"query": "OpenAI Agents SDK state management", "source_type": "official", "limit": 3},
            principal=ALICE,
            task_id="task_c04",
        )
        assert found.ok and found.status == "ok", found
        assert 1 <= len(found.data["items"]) <= 3
        assert all(item["source_type"] == "official" for item in found.data["items"])

        fetched = await client.call(
            "fetch_document",
            {"url": f"{document_server}/sessions"},
            principal=ALICE,
            task_id="task_c04",
        )
        assert fetched.ok, fetched
        assert fetched.data["title"] == "Agents SDK sessions"
        assert "A session stores conversation state." in fetched.data["text"]
        assert "evil()" not in fetched.data["text"]

        saved = await client.call(
            "save_evidence",
            {
                "task_id": "task_c04",
                "claim": "Sessions store conversation state.",
                "source_url": f"{document_server}/sessions",
            },
            principal=ALICE,
            task_id="task_c04",
        )
        assert saved.ok, saved
        assert saved.data["stored"] is True and saved.data["duplicate"] is False


async def test_limit_over_maximum_is_invalid_arguments_and_never_runs(
    shared_gateway: Gateway,
) -> None:
    call_id = new_call_id()
    async with await shared_gateway.client() as client:
        result = await client.call(
            "search_sources",
            {"query": "OpenAI Agents SDK state management", "source_type": "official", "limit": 50},
            principal=ALICE,
            task_id="task_c04",
            call_id=call_id,
        )
    assert result.status == "invalid_arguments" and not result.ok
    assert result.error is not None and result.error.code == "SCHEMA_VALIDATION_FAILED"
    assert result.error.retryable is False
    assert [(d.path, d.message) for d in result.error.details] == [
        ("/limit", "50 is greater than the maximum of 10")
    ]
    types = count_types(events_of(await shared_gateway.events(), call_id))
    assert types["ArgumentsRejected"] == 1
    assert types["ExecutionStarted"] == 0 and types["CallAuthorized"] == 0


async def test_backend_that_times_out_is_a_retryable_timeout(shared_gateway: Gateway) -> None:
    async with await shared_gateway.client() as client:
        result = await client.call("slow_backend", {"sleep_s": 5}, principal=ALICE)
    assert result.status == "timeout" and not result.ok
    assert result.error is not None and result.error.code == "TOOL_TIMEOUT"
    assert result.error.retryable is True


async def test_search_with_no_match_is_ok_with_empty_items(shared_gateway: Gateway) -> None:
    async with await shared_gateway.client() as client:
        result = await client.call(
            "search_sources",
            {"query": "zzqxv nonexistent quokka", "source_type": "any", "limit": 5},
            principal=ALICE,
        )
    assert result.ok and result.status == "ok"
    assert result.data == {"items": []}
    assert result.error is None


async def test_output_breaking_its_schema_is_withheld(shared_gateway: Gateway) -> None:
    async with await shared_gateway.client() as client:
        result = await client.call("broken_output", {}, principal=ALICE)
    assert result.status == "invalid_tool_result" and not result.ok
    assert result.data is None  # the malformed data never reaches the agent
    assert result.error is not None and result.error.code == "OUTPUT_SCHEMA_VIOLATION"
    assert "/items" in [d.path for d in result.error.details]


async def test_unknown_tool_is_unknown_tool(shared_gateway: Gateway) -> None:
    async with await shared_gateway.client() as client:
        result = await client.call("do_research", {"topic": "anything"}, principal=ALICE)
    assert result.status == "unknown_tool"
    assert result.error is not None and result.error.code == "TOOL_NOT_FOUND"


async def test_save_evidence_into_another_task_is_denied(shared_gateway: Gateway) -> None:
    call_id = new_call_id()
    async with await shared_gateway.client() as client:
        result = await client.call(
            "save_evidence",
            {"task_id": "task_someone_else", "claim": "x", "source_url": "https://example.org"},
            principal=ALICE,
            task_id="task_c04",
            call_id=call_id,
        )
    assert result.status == "denied"
    assert result.error is not None and result.error.code == "TASK_SCOPE_VIOLATION"
    types = count_types(events_of(await shared_gateway.events(), call_id))
    assert types["CallDenied"] == 1 and types["ExecutionStarted"] == 0


async def test_agent_not_allowed_for_tool_is_denied(shared_gateway: Gateway) -> None:
    # The agent is who the bus says it is: browser-bot logs in as itself.
    async with await shared_gateway.client("acme", "browser-bot") as client:
        result = await client.call(
            "save_evidence",
            {"task_id": "task_c04", "claim": "x", "source_url": "https://example.org"},
            user="u-alice",
            session="s-1",
            task_id="task_c04",
        )
    assert result.status == "denied"
    assert result.error is not None and result.error.code == "TOOL_NOT_ALLOWED"


async def test_a_payload_naming_another_agent_is_denied_and_never_runs(
    shared_gateway: Gateway,
) -> None:
    """browser-bot cannot borrow researcher's rights by writing researcher into the payload."""
    call_id = new_call_id()
    async with await shared_gateway.client("acme", "browser-bot") as client:
        result = await client.call(
            "save_evidence",
            {"task_id": "task_c04", "claim": "x", "source_url": "https://example.org"},
            principal=ALICE,
            task_id="task_c04",
            call_id=call_id,
        )
        assert await client.result(call_id) == result  # stored for the sender
    assert result.status == "denied"
    assert result.error is not None and result.error.code == "PRINCIPAL_MISMATCH"
    events = events_of(await shared_gateway.events(), call_id)
    assert count_types(events)["ArgumentsRejected"] == 1
    assert not {"CallAuthorized", "ExecutionStarted"} & set(count_types(events))
    # Every event of the call names the sender, never the principal it claimed.
    assert {(e.principal.tenant, e.principal.agent) for e in events if e.principal} == {
        ("acme", "browser-bot")
    }
    async with await shared_gateway.client("acme", "researcher") as researcher:
        assert await researcher.result(call_id) is None  # nothing landed in ALICE's results


async def test_every_step_is_an_event_keyed_by_call_id(shared_gateway: Gateway) -> None:
    call_id = new_call_id()
    async with await shared_gateway.client() as client:
        await client.call("echo", {"payload": [1, 2]}, principal=ALICE, call_id=call_id)
    # The result is published before its ResultAttached event: wait for the event.
    for _ in range(100):
        events = events_of(await shared_gateway.events(), call_id)
        if any(type(e).__name__ == "ResultAttached" for e in events):
            break
        await asyncio.sleep(0.1)
    assert [type(e).__name__ for e in events] == [
        "ArgumentsValidated",
        "CallAuthorized",
        "ExecutionStarted",
        "ExecutionSucceeded",
        "ResultAttached",
    ]
    assert len({e.event_id for e in events}) == len(events)
    assert all(e.principal == ALICE and e.tool == "echo" for e in events)


async def test_call_many_matches_each_result_to_its_call(shared_gateway: Gateway) -> None:
    from toolgate.contracts.calls import ToolCall

    calls = [
        ToolCall(call_id=new_call_id(), tool="echo", arguments={"payload": i}, principal=ALICE)
        for i in range(5)
    ]
    calls.append(ToolCall(call_id=new_call_id(), tool="nope", arguments={}, principal=ALICE))
    async with await shared_gateway.client() as client:
        results = await client.call_many(calls)
    assert [r.call_id for r in results] == [c.call_id for c in calls]
    assert [r.data for r in results[:5]] == [{"payload": i} for i in range(5)]
    assert results[5].status == "unknown_tool"


async def test_result_can_be_fetched_again_after_reconnect(shared_gateway: Gateway) -> None:
    call_id = new_call_id()
    async with await shared_gateway.client() as client:
        first = await client.call("echo", {"payload": "x"}, principal=ALICE, call_id=call_id)
    async with await shared_gateway.client() as reconnected:
        assert await reconnected.result(call_id) == first
        assert await reconnected.result("call_never_made") is None


async def test_platform_trace_context_is_carried_on_every_event(shared_gateway: Gateway) -> None:
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    call_id = new_call_id()
    async with await shared_gateway.client() as client:
        await client.call(
            "echo", {}, principal=ALICE, call_id=call_id, context={"traceparent": traceparent}
        )
    events = events_of(await shared_gateway.events(), call_id)
    assert events and all(e.traceparent == traceparent for e in events)
