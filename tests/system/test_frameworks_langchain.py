"""LangChain 1.x agents whose tool calls go through a real gateway (every service a process).

A scripted chat model (LangChain's own fake) drives `create_agent`; the tools
are the gateway's (`GatewayToolkit`), or the agent's own behind
`GatewayToolMiddleware`. What each test proves is read from the gateway's
events or the test tool's run log, not only from the text the agent got.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.harness import Gateway, count_types, events_of
from tests.tools.faulty import runs_of
from toolgate.client.frameworks.session import GatewaySession, SessionError
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.registry import load_registry

# The frameworks are imported by the tests that use them, not at collection: every
# xdist worker collects every test file, and these imports cost seconds of CPU each.
if TYPE_CHECKING:
    from langchain_core.messages import ToolMessage


pytestmark = pytest.mark.system

DEADLINE_S = 120.0

SEARCH = {"query": "OpenAI Agents SDK state management", "source_type": "official", "limit": 3}


async def open_session(gateway: Gateway, agent: str = "researcher") -> GatewaySession:
    return await GatewaySession.connect(
        gateway.url,
        await gateway.agent_creds("acme", agent),
        user="u-alice",
        session="s-1",
        task_id="task_c04",
        registry=load_registry(gateway.registry_dir),
        timeout=DEADLINE_S,  # a deadline on a shared, busy machine, not a measure
    )


@pytest.fixture
async def session(shared_gateway: Gateway) -> AsyncIterator[GatewaySession]:
    async with await open_session(shared_gateway) as made:
        yield made


def tool_messages(state: dict[str, Any]) -> list[ToolMessage]:
    from langchain_core.messages import ToolMessage

    return [m for m in state["messages"] if isinstance(m, ToolMessage)]


def call_id_of(message: ToolMessage) -> str:
    return str(message.artifact["result"]["call_id"])


async def ran(gateway: Gateway, call_id: str) -> int:
    """How many times the gateway started the call (events, deduplicated by id)."""
    return count_types(events_of(await gateway.events(), call_id))["ExecutionStarted"]


async def test_toolkit_lists_the_tools_this_agent_may_call_with_their_contracts(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from toolgate.client.frameworks.langchain import GatewayToolkit

    tools = {t.name: t for t in GatewayToolkit(session=session).get_tools()}
    registry = load_registry(shared_gateway.registry_dir)
    assert set(tools) == {spec.name for spec in registry.visible_to("researcher")}
    assert "save_evidence" in tools
    search = registry.get("search_sources")
    assert search is not None
    assert tools["search_sources"].args_schema == search.input_schema
    assert tools["search_sources"].description == search.description.strip()
    async with await open_session(shared_gateway, "browser-bot") as bot:
        listed = {t.name for t in GatewayToolkit(session=bot).get_tools()}
    assert "save_evidence" not in listed and "search_sources" in listed


async def test_seed_search_fetch_save_through_a_langchain_agent(
    shared_gateway: Gateway, session: GatewaySession, document_server: str
) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    url = f"{document_server}/sessions"
    model = ScriptedChat(
        responses=[
            calls(tool_call("search_sources", SEARCH, "call_1")),
            calls(tool_call("fetch_document", {"url": url}, "call_2")),
            calls(
                tool_call(
                    "save_evidence",
                    {
                        "task_id": "task_c04",
                        "claim": "Sessions store conversation state.",
                        "source_url": url,
                    },
                    "call_3",
                )
            ),
            AIMessage(content="saved"),
        ]
    )
    agent = create_agent(model, tools=GatewayToolkit(session=session).get_tools())
    state = await agent.ainvoke({"messages": [HumanMessage("research sessions")]})
    assert "save_evidence" in model.bound
    search, fetch, save = tool_messages(state)
    assert [m.status for m in (search, fetch, save)] == ["success"] * 3
    assert '"source_type":"official"' in str(search.content)
    assert "A session stores conversation state." in str(fetch.content)
    assert '"stored":true' in str(save.content)
    assert state["messages"][-1].content == "saved"
    for message in (search, fetch, save):
        assert message.artifact["result"]["status"] == "ok"
        assert await ran(shared_gateway, call_id_of(message)) == 1


def test_limit_50_comes_back_as_an_error_the_model_reads_and_corrects(
    shared_gateway: Gateway,
) -> None:
    """Synchronous agent.invoke, on a session with a loop thread of its own."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    session = GatewaySession.connect_in_background(
        shared_gateway.url,
        asyncio.run(shared_gateway.agent_creds("acme", "researcher")),
        user="u-alice",
        session="s-1",
        registry=load_registry(shared_gateway.registry_dir),
        timeout=DEADLINE_S,
    )
    try:
        model = ScriptedChat(
            responses=[
                calls(tool_call("search_sources", {**SEARCH, "limit": 50}, "call_big")),
                calls(tool_call("search_sources", SEARCH, "call_fixed")),
                AIMessage(content="found"),
            ]
        )
        agent = create_agent(model, tools=GatewayToolkit(session=session).get_tools())
        state = agent.invoke({"messages": [HumanMessage("search")]})
    finally:
        session.close()
    rejected, fixed = tool_messages(state)
    assert rejected.status == "error"
    assert "ERROR invalid_arguments (SCHEMA_VALIDATION_FAILED)" in str(rejected.content)
    assert "- /limit: 50 is greater than the maximum of 10" in str(rejected.content)
    assert "Correct the call" in str(rejected.content)
    # The model was shown the error before it made its corrected call.
    shown = model.seen[1]
    assert any(isinstance(m, ToolMessage) and m.status == "error" for m in shown)
    assert fixed.status == "success"
    assert asyncio.run(ran(shared_gateway, call_id_of(rejected))) == 0
    assert asyncio.run(ran(shared_gateway, call_id_of(fixed))) == 1


async def test_a_denied_call_is_a_final_error_and_never_runs(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    other_task = {"task_id": "task_someone_else", "claim": "x", "source_url": "https://a.org"}
    model = ScriptedChat(
        responses=[calls(tool_call("save_evidence", other_task, "call_x")), AIMessage("no")]
    )
    agent = create_agent(model, tools=GatewayToolkit(session=session).get_tools())
    (denied,) = tool_messages(await agent.ainvoke({"messages": [HumanMessage("save")]}))
    assert denied.status == "error"
    assert "ERROR denied (TASK_SCOPE_VIOLATION)" in str(denied.content)
    assert "Do not call it again" in str(denied.content)
    assert await ran(shared_gateway, call_id_of(denied)) == 0


def assert_failed_loudly(message: ToolMessage, gateway: Gateway) -> str:
    """A call waiting for a human, in a run that did not pause: an error naming the call_id
    (DESIGN invariant 13), the tool not run. Returns the call_id."""
    assert "approval" in message.artifact, message.content
    request = message.artifact["approval"]
    call_id = str(request["call_id"])
    assert message.status == "error", message.content
    assert str(message.content).startswith(
        f"ERROR approval_pending (APPROVAL_REQUIRED) from tool approved_action, call_id {call_id}."
    )
    assert "The tool has not run" in str(message.content)
    assert f"toolgate result {call_id}" in str(message.content)
    assert request["expires_at"]
    assert call_id not in runs_of(gateway.data_dir, "approved_action")
    return call_id


async def test_a_call_needing_approval_without_a_checkpointer_is_an_error_with_its_call_id(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    """create_agent with no checkpointer cannot pause: the tool message is an error."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    model = ScriptedChat(
        responses=[calls(tool_call("approved_action", {"amount": 3}, "call_a")), AIMessage("ok")]
    )
    agent = create_agent(model, tools=GatewayToolkit(session=session).get_tools())
    (pending,) = tool_messages(await agent.ainvoke({"messages": [HumanMessage("act")]}))
    assert_failed_loudly(pending, shared_gateway)
    assert pending.artifact["approval"]["arguments_sha256"] == arguments_sha256({"amount": 3})
    # The model read the failure before its final answer.
    assert any(isinstance(m, ToolMessage) and m.status == "error" for m in model.seen[-1])


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # the finding's API
async def test_create_react_agent_with_the_toolkit_and_no_middleware_does_not_report_done(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    """The finding of issue 27: LangGraph's prebuilt create_react_agent, GatewayToolkit's
    tools, no middleware, no checkpointer. The tool message was status=success
    "WAITING FOR APPROVAL..." and the graph finished as if the call were done."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.prebuilt import create_react_agent

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    model = ScriptedChat(
        responses=[calls(tool_call("approved_action", {"amount": 4}, "call_r")), AIMessage("ok")]
    )
    graph = create_react_agent(model, GatewayToolkit(session=session).get_tools())
    state = await graph.ainvoke({"messages": [HumanMessage("act")]})
    (pending,) = tool_messages(state)
    assert_failed_loudly(pending, shared_gateway)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # the finding's API
def test_create_react_agent_driven_synchronously_does_not_report_done_either(
    shared_gateway: Gateway,
) -> None:
    """The same finding through graph.invoke (the tool's synchronous path)."""
    from langchain_core.messages import AIMessage, HumanMessage
    from langgraph.prebuilt import create_react_agent

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    session = GatewaySession.connect_in_background(
        shared_gateway.url,
        asyncio.run(shared_gateway.agent_creds("acme", "researcher")),
        user="u-alice",
        session="s-1",
        registry=load_registry(shared_gateway.registry_dir),
        timeout=DEADLINE_S,
    )
    try:
        model = ScriptedChat(
            responses=[calls(tool_call("approved_action", {"amount": 2}, "call_y")), AIMessage("x")]
        )
        graph = create_react_agent(model, GatewayToolkit(session=session).get_tools())
        (pending,) = tool_messages(graph.invoke({"messages": [HumanMessage("act")]}))
    finally:
        session.close()
    assert_failed_loudly(pending, shared_gateway)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # the finding's API
async def test_create_react_agent_with_the_toolkit_and_a_checkpointer_pauses_and_resumes(
    shared_gateway: Gateway, session: GatewaySession, tmp_path: Path
) -> None:
    """With a checkpointer the same agent pauses with the gateway's interrupt; after a
    human's approval a resume gets the result, and the tool ran once, in the gateway."""
    from langchain_core.messages import HumanMessage
    from langgraph.prebuilt import create_react_agent
    from langgraph.types import Command

    from tests.system.framework_fakes import StateChat
    from tests.system.framework_graph import approve_in_cli
    from toolgate.client.frameworks.langchain import GatewayToolkit
    from toolgate.client.frameworks.langgraph import APPROVAL_INTERRUPT, SQLiteCheckpointer

    checkpointer = SQLiteCheckpointer(tmp_path / "react.sqlite")
    graph = create_react_agent(
        StateChat(tool="approved_action", args={"amount": 5}, call_id="call_p"),
        GatewayToolkit(session=session).get_tools(),
        checkpointer=checkpointer,
    )
    config = {"configurable": {"thread_id": f"react-{uuid.uuid4().hex[:8]}"}}
    try:
        paused = await graph.ainvoke({"messages": [HumanMessage("act")]}, config)
        (interrupted,) = paused["__interrupt__"]
        assert interrupted.value["kind"] == APPROVAL_INTERRUPT
        (request,) = interrupted.value["requests"]
        assert request["arguments"] == {"amount": 5} and not tool_messages(paused)
        call_id = request["call_id"]
        assert call_id not in runs_of(shared_gateway.data_dir, "approved_action")
        approve_in_cli(shared_gateway, f"acme.researcher.{call_id}")
        state = await graph.ainvoke(Command(resume="approved"), config)
    finally:
        checkpointer.close()
    (done,) = tool_messages(state)
    assert done.status == "success"
    assert done.artifact["result"]["data"] == {"call_id": call_id}
    assert runs_of(shared_gateway.data_dir, "approved_action").count(call_id) == 1
    assert await ran(shared_gateway, call_id) == 1


async def test_a_bare_invocation_of_a_call_needing_approval_raises(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    """Invoked with bare arguments there is no message to flag as an error: it raises."""
    from toolgate.client.frameworks.langchain import ApprovalPending, GatewayToolkit

    (act,) = [t for t in GatewayToolkit(session=session).get_tools() if t.name == "approved_action"]
    with pytest.raises(ApprovalPending) as raised:
        await act.ainvoke({"amount": 6})
    call_id = raised.value.request.call_id
    assert f"call_id {call_id}" in str(raised.value) and "has not run" in str(raised.value)
    assert call_id not in runs_of(shared_gateway.data_dir, "approved_action")


async def test_the_middleware_without_a_checkpointer_fails_a_call_needing_approval(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolMiddleware

    local_runs: list[int] = []

    @tool
    def approved_action(amount: int) -> str:
        """The agent's own stand-in for the gateway's tool."""
        local_runs.append(amount)
        return "ran locally"

    model = ScriptedChat(
        responses=[calls(tool_call("approved_action", {"amount": 8}, "call_m")), AIMessage("x")]
    )
    agent = create_agent(
        model, tools=[approved_action], middleware=[GatewayToolMiddleware(session)]
    )
    (pending,) = tool_messages(await agent.ainvoke({"messages": [HumanMessage("act")]}))
    assert_failed_loudly(pending, shared_gateway)
    assert local_runs == []


# ------------------------------------------------------------------ the attacker's model


async def test_a_model_naming_a_tool_the_agent_may_not_call_gets_denied(
    shared_gateway: Gateway,
) -> None:
    """browser-bot's toolkit has no save_evidence; its own tool of that name, behind the
    middleware, is denied by the gateway and its body never runs."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolMiddleware

    local_runs: list[dict[str, Any]] = []

    @tool
    def save_evidence(task_id: str, claim: str, source_url: str) -> str:
        """Save evidence (the agent's own copy)."""
        local_runs.append({"task_id": task_id})
        return "saved locally"

    args = {"task_id": "task_c04", "claim": "x", "source_url": "https://a.org"}
    async with await open_session(shared_gateway, "browser-bot") as bot:
        model = ScriptedChat(
            responses=[calls(tool_call("save_evidence", args, "call_s")), AIMessage("x")]
        )
        agent = create_agent(model, tools=[save_evidence], middleware=[GatewayToolMiddleware(bot)])
        (denied,) = tool_messages(await agent.ainvoke({"messages": [HumanMessage("save")]}))
    assert denied.status == "error" and "ERROR denied (TOOL_NOT_ALLOWED)" in str(denied.content)
    assert local_runs == []
    assert await ran(shared_gateway, call_id_of(denied)) == 0


async def test_the_middleware_runs_no_tool_the_gateway_did_not_authorize(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolMiddleware

    local_runs: list[str] = []

    @tool
    def wipe_disk(path: str) -> str:
        """Delete everything under path."""
        local_runs.append(path)
        return "wiped"

    @tool
    def search_sources(query: str, source_type: str, limit: int) -> str:
        """Search (the agent's own implementation)."""
        local_runs.append(query)
        return "LOCAL RESULT"

    model = ScriptedChat(
        responses=[
            calls(
                tool_call("wipe_disk", {"path": "/"}, "call_w"),
                tool_call("search_sources", SEARCH, "call_s"),
            ),
            AIMessage("done"),
        ]
    )
    agent = create_agent(
        model, tools=[wipe_disk, search_sources], middleware=[GatewayToolMiddleware(session)]
    )
    wiped, searched = tool_messages(await agent.ainvoke({"messages": [HumanMessage("go")]}))
    assert local_runs == []  # neither local body ran
    assert wiped.status == "error" and "ERROR unknown_tool (TOOL_NOT_FOUND)" in str(wiped.content)
    assert searched.status == "success" and "LOCAL RESULT" not in str(searched.content)
    assert '"items"' in str(searched.content)  # the gateway's search_sources answered
    assert await ran(shared_gateway, call_id_of(searched)) == 1


async def test_a_model_reusing_a_call_id_gets_a_call_of_its_own_not_that_result(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    victim = await session.client.call(
        "count_runs", {}, user="u-bob", session="s-9", call_id="victim_call_1"
    )
    assert victim.ok
    model = ScriptedChat(
        responses=[calls(tool_call("count_runs", {}, "victim_call_1")), AIMessage("x")]
    )
    agent = create_agent(model, tools=GatewayToolkit(session=session).get_tools())
    (mine,) = tool_messages(await agent.ainvoke({"messages": [HumanMessage("count")]}))
    assert mine.status == "success"
    assert call_id_of(mine) != "victim_call_1"
    assert "victim_call_1" not in str(mine.content)
    runs = runs_of(shared_gateway.data_dir, "count_runs")
    assert runs.count("victim_call_1") == 1 and runs.count(call_id_of(mine)) == 1


async def test_the_same_model_call_id_for_two_users_is_two_calls(
    shared_gateway: Gateway, session: GatewaySession
) -> None:
    """One agent serving two end users: Bob's model and Alice's name the same tool call id,
    with the same arguments; each gets a run of their own, not the other's result."""
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolkit

    bob = session.for_user("u-bob", "s-bob")
    answers = []
    for who in (bob, session):
        model = ScriptedChat(
            responses=[calls(tool_call("count_runs", {"n": 1}, "call_same")), AIMessage("x")]
        )
        agent = create_agent(model, tools=GatewayToolkit(session=who).get_tools())
        (answer,) = tool_messages(await agent.ainvoke({"messages": [HumanMessage("count")]}))
        answers.append(call_id_of(answer))
    assert answers[0] != answers[1]
    runs = runs_of(shared_gateway.data_dir, "count_runs")
    assert runs.count(answers[0]) == 1 and runs.count(answers[1]) == 1
    events = await shared_gateway.events()
    users = {e.principal.user for e in events_of(events, answers[0]) if e.principal is not None}
    assert users == {"u-bob"}


def test_the_middleware_refuses_the_same_way_when_driven_synchronously(
    shared_gateway: Gateway,
) -> None:
    from langchain.agents import create_agent
    from langchain_core.messages import AIMessage, HumanMessage
    from langchain_core.tools import tool

    from tests.system.framework_fakes import ScriptedChat, calls, tool_call
    from toolgate.client.frameworks.langchain import GatewayToolMiddleware

    local_runs: list[str] = []

    @tool
    def wipe_disk(path: str) -> str:
        """Delete everything under path."""
        local_runs.append(path)
        return "wiped"

    session = GatewaySession.connect_in_background(
        shared_gateway.url,
        asyncio.run(shared_gateway.agent_creds("acme", "researcher")),
        user="u-alice",
        session="s-1",
        registry=load_registry(shared_gateway.registry_dir),
        timeout=DEADLINE_S,
    )
    try:
        model = ScriptedChat(
            responses=[calls(tool_call("wipe_disk", {"path": "/"}, "call_w")), AIMessage("x")]
        )
        agent = create_agent(model, tools=[wipe_disk], middleware=[GatewayToolMiddleware(session)])
        (refused,) = tool_messages(agent.invoke({"messages": [HumanMessage("go")]}))
    finally:
        session.close()
    assert local_runs == []
    assert refused.status == "error" and "ERROR unknown_tool (TOOL_NOT_FOUND)" in str(
        refused.content
    )


async def test_a_sync_tool_call_on_the_sessions_own_loop_is_a_precise_error(
    session: GatewaySession,
) -> None:
    """Waiting synchronously on the loop that must deliver the answer would hang: refused."""
    from toolgate.client.frameworks.langchain import GatewayToolkit

    (echo,) = [t for t in GatewayToolkit(session=session).get_tools() if t.name == "echo"]
    with pytest.raises(SessionError, match="use the async API"):
        echo.invoke({"name": "echo", "args": {"payload": 1}, "id": "c1", "type": "tool_call"})


async def test_a_session_on_creds_that_are_no_agents_is_refused(shared_gateway: Gateway) -> None:
    with pytest.raises(SessionError, match="an agent's creds file"):
        await GatewaySession.connect(
            shared_gateway.url,
            shared_gateway.stack.creds_of("admin"),
            user="u-alice",
            session="s-1",
            registry=load_registry(shared_gateway.registry_dir),
        )


async def test_with_pause_for_approval_a_langchain_agent_pauses_and_resumes(
    shared_gateway: Gateway, session: GatewaySession, tmp_path: Path
) -> None:
    """create_agent runs on LangGraph: the middleware can pause it like GatewayToolNode, and
    the agent's own stand-in for the tool never runs, before or after the approval."""
    from langchain.agents import create_agent
    from langchain_core.messages import HumanMessage
    from langchain_core.tools import tool
    from langgraph.types import Command

    from tests.system.framework_fakes import StateChat
    from tests.system.framework_graph import approve_in_cli
    from toolgate.client.frameworks.langchain import GatewayToolMiddleware
    from toolgate.client.frameworks.langgraph import SQLiteCheckpointer

    local_runs: list[int] = []

    @tool
    def approved_action(amount: int) -> str:
        """The agent's own stand-in for the gateway's tool."""
        local_runs.append(amount)
        return "ran locally"

    checkpointer = SQLiteCheckpointer(tmp_path / "agent.sqlite")
    agent = create_agent(
        StateChat(tool="approved_action", args={"amount": 9}, call_id="call_9"),
        tools=[approved_action],
        middleware=[GatewayToolMiddleware(session, pause_for_approval=True)],
        checkpointer=checkpointer,
    )
    config = {"configurable": {"thread_id": f"agent-{uuid.uuid4().hex[:8]}"}}
    try:
        paused = await agent.ainvoke({"messages": [HumanMessage("act")]}, config)
        (request,) = paused["__interrupt__"][0].value["requests"]
        assert request["arguments"] == {"amount": 9} and not tool_messages(paused)
        approve_in_cli(shared_gateway, f"acme.researcher.{request['call_id']}")
        state = await agent.ainvoke(Command(resume="approved"), config)
    finally:
        checkpointer.close()
    (done,) = tool_messages(state)
    assert done.status == "success"
    assert done.artifact["result"]["data"] == {"call_id": request["call_id"]}
    assert local_runs == []
    assert runs_of(shared_gateway.data_dir, "approved_action").count(request["call_id"]) == 1
