"""OpenAI Agents SDK agents whose function tools are the gateway's, on a real gateway.

The SDK's own `agents.testing.ScriptedModel` plays the model (no network,
tracing off). Statuses reach the SDK through its hooks: a tool output
guardrail (errors rejected with the gateway's text, or a tripwire), and
`needs_approval` (a call waiting for a human interrupts the run; it resumes
from the serialized run state once a human approved it in the CLI).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest

from tests.harness import Gateway, count_types, events_of
from tests.tools.faulty import runs_of
from toolgate.client.frameworks.session import GatewaySession
from toolgate.contracts.registry import Registry, load_registry

# The SDK (and our adapter of it) is imported by the tests, not at collection: every xdist
# worker collects every test file.
if TYPE_CHECKING:
    from agents import RunConfig

    from toolgate.client.frameworks.openai_agents import GatewayOutput

pytestmark = pytest.mark.system

DEADLINE_S = 120.0

SEARCH = {"query": "OpenAI Agents SDK state management", "source_type": "official", "limit": 3}


def offline() -> RunConfig:
    from agents import RunConfig

    return RunConfig(tracing_disabled=True)


async def open_session(gateway: Gateway, **options: Any) -> GatewaySession:
    return await GatewaySession.connect(
        gateway.url,
        await gateway.agent_creds("acme", "researcher"),
        user="u-alice",
        session="s-1",
        task_id="task_c04",
        timeout=DEADLINE_S,  # a deadline on a shared, busy machine, not a measure
        **{"registry": load_registry(gateway.registry_dir), **options},
    )


@pytest.fixture
async def session(shared_gateway: Gateway) -> AsyncIterator[GatewaySession]:
    async with await open_session(shared_gateway) as made:
        yield made


def outputs(items: list[Any]) -> list[GatewayOutput]:
    from agents.items import ToolCallOutputItem

    return [i.output for i in items if isinstance(i, ToolCallOutputItem)]


async def ran(gateway: Gateway, call_id: str) -> int:
    return count_types(events_of(await gateway.events(), call_id))["ExecutionStarted"]


async def test_seed_search_fetch_save_as_function_tools(
    shared_gateway: Gateway, session: GatewaySession, document_server: str
) -> None:
    from agents import Agent, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call

    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    url = f"{document_server}/sessions"
    save = {"task_id": "task_c04", "claim": "Sessions store state.", "source_url": url}
    model = ScriptedModel(
        [
            [function_call("search_sources", SEARCH, call_id="fc_1")],
            [function_call("fetch_document", {"url": url}, call_id="fc_2")],
            [function_call("save_evidence", save, call_id="fc_3")],
            [assistant_message("saved")],
        ]
    )
    tools = gateway_function_tools(session)
    assert {t.name for t in tools} == {
        s.name for s in load_registry(shared_gateway.registry_dir).visible_to("researcher")
    }
    agent = Agent(name="researcher", model=model, tools=tools)
    result = await Runner.run(agent, "research sessions", run_config=offline())
    assert result.final_output == "saved"
    search, fetch, saved = outputs(result.new_items)
    assert all(o.observation.status == "ok" for o in (search, fetch, saved))
    assert "A session stores conversation state." in str(fetch)
    assert json.loads(str(saved))["stored"] is True
    for output in (search, fetch, saved):
        assert await ran(shared_gateway, output.observation.call_id) == 1
    assert all(r.output.behavior["type"] == "allow" for r in result.tool_output_guardrail_results)


async def test_limit_50_is_rejected_content_the_model_reads(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from agents import Agent, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call

    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    model = ScriptedModel(
        [
            [function_call("search_sources", {**SEARCH, "limit": 50}, call_id="fc_big")],
            [function_call("search_sources", SEARCH, call_id="fc_ok")],
            [assistant_message("found")],
        ]
    )
    agent = Agent(name="researcher", model=model, tools=gateway_function_tools(session))
    result = await Runner.run(agent, "search", run_config=offline())
    rejected, allowed = result.tool_output_guardrail_results
    assert rejected.output.behavior["type"] == "reject_content"
    assert rejected.output.output_info["status"] == "invalid_arguments"
    assert rejected.output.output_info["remedy"] == "correct"
    assert allowed.output.behavior["type"] == "allow"
    # What the model was sent on its second turn: the gateway's error, pointer and all.
    second_turn = json.dumps(model.calls[1].input, default=str)
    assert "/limit: 50 is greater than the maximum of 10" in second_turn
    assert await ran(shared_gateway, rejected.output.output_info["call_id"]) == 0


async def test_a_denied_call_can_halt_the_run(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from agents import Agent, Runner, ToolOutputGuardrailTripwireTriggered
    from agents.testing import ScriptedModel, assistant_message, function_call

    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    other_task = {"task_id": "task_else", "claim": "x", "source_url": "https://a.org"}
    model = ScriptedModel(
        [[function_call("save_evidence", other_task, call_id="fc_x")], [assistant_message("x")]]
    )
    tools = gateway_function_tools(session, halt_on={"denied"})
    agent = Agent(name="researcher", model=model, tools=tools)
    with pytest.raises(ToolOutputGuardrailTripwireTriggered) as tripped:
        await Runner.run(agent, "save", run_config=offline())
    info = tripped.value.output.output_info
    assert info["status"] == "denied" and info["remedy"] == "final"
    assert await ran(shared_gateway, info["call_id"]) == 0


async def test_a_call_needing_a_human_interrupts_the_run_until_approved_in_the_cli(
    shared_gateway: Gateway,
) -> None:
    from agents import Agent, Runner
    from agents.run_state import RunState
    from agents.testing import ScriptedModel, assistant_message, function_call

    from tests.system.framework_graph import approve_in_cli
    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    conversation = "conv-approval-1"
    async with await open_session(shared_gateway, namespace=conversation) as first:
        model = ScriptedModel([[function_call("approved_action", {"amount": 11}, call_id="fc_a")]])
        agent = Agent(name="researcher", model=model, tools=gateway_function_tools(first))
        paused = await Runner.run(agent, "act", run_config=offline())
        (item,) = paused.interruptions
        assert item.name == "approved_action"
        saved = paused.to_state().to_json()
    call_id = first.call_id_for("fc_a", "approved_action", {"amount": 11})
    assert call_id not in runs_of(shared_gateway.data_dir, "approved_action")

    approve_in_cli(shared_gateway, f"acme.researcher.{call_id}")

    # Later, another session of the same conversation resumes the stored run state.
    async with await open_session(shared_gateway, namespace=conversation) as later:
        model = ScriptedModel([[assistant_message("refunded")]])
        agent = Agent(name="researcher", model=model, tools=gateway_function_tools(later))
        state = await RunState.from_json(agent, saved)
        (item,) = state.get_interruptions()
        state.approve(item)
        result = await Runner.run(agent, state, run_config=offline())
    assert result.final_output == "refunded"
    (done,) = outputs(result.new_items)
    assert done.observation.status == "ok" and done.observation.call_id == call_id
    assert runs_of(shared_gateway.data_dir, "approved_action").count(call_id) == 1
    assert await ran(shared_gateway, call_id) == 1


def test_run_sync_on_its_own_loop_reaches_the_gateway_through_a_background_session(
    shared_gateway: Gateway,
) -> None:
    """Runner.run_sync runs the agent on a loop of its own; the session's connection lives on
    another (its background thread): each gateway step is handed over, awaited, answered."""
    from agents import Agent, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call

    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    session = GatewaySession.connect_in_background(
        shared_gateway.url,
        asyncio.run(shared_gateway.agent_creds("acme", "researcher")),
        user="u-alice",
        session="s-1",
        registry=load_registry(shared_gateway.registry_dir),
        timeout=DEADLINE_S,
    )
    try:
        model = ScriptedModel(
            [[function_call("search_sources", SEARCH, call_id="fc_s")], [assistant_message("ok")]]
        )
        agent = Agent(name="researcher", model=model, tools=gateway_function_tools(session))
        result = Runner.run_sync(agent, "search", run_config=offline())
    finally:
        session.close()
    (found,) = outputs(result.new_items)
    assert found.observation.status == "ok" and json.loads(str(found))["items"]


async def test_the_platforms_own_input_guardrail_stops_a_call_before_the_gateway_sees_it(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    """needs_approval runs before the SDK's tool input guardrails: a tool that does not
    need a human is published only when invoked, so a guardrail that refuses it first
    leaves nothing at the gateway."""
    from agents import Agent, Runner
    from agents.testing import ScriptedModel, assistant_message, function_call
    from agents.tool_guardrails import (
        ToolGuardrailFunctionOutput,
        ToolInputGuardrailData,
        tool_input_guardrail,
    )

    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    @tool_input_guardrail
    def no_limit_over_2(data: ToolInputGuardrailData) -> ToolGuardrailFunctionOutput:
        if json.loads(data.context.tool_arguments).get("limit", 0) > 2:
            return ToolGuardrailFunctionOutput.reject_content("the platform allows limit <= 2")
        return ToolGuardrailFunctionOutput.allow()

    tools = gateway_function_tools(session)
    for function_tool in tools:
        function_tool.tool_input_guardrails = [no_limit_over_2]
    model = ScriptedModel(
        [[function_call("search_sources", SEARCH, call_id="fc_g")], [assistant_message("x")]]
    )
    agent = Agent(name="researcher", model=model, tools=tools)
    result = await Runner.run(agent, "search", run_config=offline())
    assert result.tool_input_guardrail_results[0].output.behavior["type"] == "reject_content"
    assert "the platform allows limit <= 2" in json.dumps(model.calls[1].input, default=str)
    call_id = session.call_id_for("fc_g", "search_sources", SEARCH)
    assert not events_of(await shared_gateway.events(), call_id)  # never published


async def test_a_call_a_policy_sends_to_a_human_fails_the_tool_call_never_succeeds(
    shared_gateway: Gateway,
) -> None:
    """A tool the agent's listing does not flag (so no needs_approval pause) that the gateway
    still sends to a human, as a policy may: the tool call fails with approval_pending and
    its call_id, rejected by the output guardrail, or halting the run when asked to
    (DESIGN invariant 13). It was published once and has not run."""
    from agents import Agent, Runner, ToolOutputGuardrailTripwireTriggered
    from agents.testing import ScriptedModel, assistant_message, function_call

    from toolgate.client.frameworks.openai_agents import gateway_function_tools

    listed = load_registry(shared_gateway.registry_dir)
    spec = listed.get("approved_action")
    assert spec is not None
    quiet = spec.model_copy(update={"requires_approval": False, "risk": "low"})
    registry = Registry({**{n: listed.get(n) for n in listed.names()}, spec.name: quiet})
    async with await open_session(shared_gateway, registry=registry) as session:
        model = ScriptedModel(
            [
                [function_call("approved_action", {"amount": 12}, call_id="fc_p")],
                [assistant_message("tried")],
            ]
        )
        agent = Agent(name="researcher", model=model, tools=gateway_function_tools(session))
        result = await Runner.run(agent, "act", run_config=offline())
        assert not result.interruptions
        (rejected,) = result.tool_output_guardrail_results
        assert rejected.output.behavior["type"] == "reject_content"
        assert rejected.output.output_info["status"] == "approval_pending"
        call_id = rejected.output.output_info["call_id"]
        assert call_id == session.call_id_for("fc_p", "approved_action", {"amount": 12})
        # What the model read: the failure, not a success (the rejected content).
        (failed,) = outputs(result.new_items)
        assert str(failed).startswith("ERROR approval_pending (APPROVAL_REQUIRED)")
        assert f"call_id {call_id}" in json.dumps(model.calls[1].input, default=str)

        halting = gateway_function_tools(session, halt_on={"approval_pending"})
        model = ScriptedModel(
            [
                [function_call("approved_action", {"amount": 13}, call_id="fc_h")],
                [assistant_message("x")],
            ]
        )
        with pytest.raises(ToolOutputGuardrailTripwireTriggered) as tripped:
            await Runner.run(
                Agent(name="researcher", model=model, tools=halting), "act", run_config=offline()
            )
    halted = tripped.value.output.output_info["call_id"]
    assert tripped.value.output.output_info["status"] == "approval_pending"
    for pending in (call_id, halted):
        assert pending not in runs_of(shared_gateway.data_dir, "approved_action")
        assert await ran(shared_gateway, pending) == 0
