"""LangChain 1.x: gateway-backed tools, and a tool-call middleware for agents' own tools.

`GatewayToolkit(session=session).get_tools()` lists the tools this agent may call (its
creds say which agent it is; the registry's `allowed_agents` say which tools),
each with the registry's description and input schema. Running one publishes
a `ToolCall` and turns the `ToolResult` into the `ToolMessage`: the data as
content when ok; an error message (status "error") the model can read and
correct otherwise; "waiting for approval" with the call_id when a human must
decide first. Nothing runs in the agent's process: the schema is the
gateway's to check (so `limit: 50` comes back as `invalid_arguments` the model
reads, not as a local validation exception).

`GatewayToolMiddleware(session)` is for agents that bring their own tools
(`create_agent(model, tools=[...], middleware=[...])`): every tool call the
model makes goes to the gateway under the tool's name, and the gateway's
answer is the tool message. The agent's own tool function never runs: a tool
the gateway does not know or does not allow ends as an error message, and
one it allows runs as the registry's implementation, under policy.

    pip install 'toolgate[langchain]'
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware
from langchain.agents.middleware.types import ToolCallRequest
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import BaseTool, BaseToolkit
from langgraph.types import Command
from pydantic import ConfigDict

from toolgate.contracts.registry import ToolSpec

from .session import GatewaySession
from .tool_calls import DEFAULT_RESUME_WAIT_S, ModelToolCall, pause_for
from .tool_messages import thread_of, tool_message

__all__ = ["GatewayTool", "GatewayToolMiddleware", "GatewayToolkit"]


class GatewayTool(BaseTool):
    """One registry tool; calling it asks the gateway (nothing runs here)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    session: Any  # GatewaySession (Any: pydantic need not know the class)

    @classmethod
    def of(cls, spec: ToolSpec, session: GatewaySession) -> GatewayTool:
        return cls(
            name=spec.name,
            description=spec.description.strip(),
            args_schema=spec.input_schema,  # a JSON Schema: passed through, checked by the gateway
            session=session,
        )

    def _to_args_and_kwargs(
        self, tool_input: str | dict[str, Any], tool_call_id: str | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # The arguments go to the gateway whole, with the model's tool call id (BaseTool
        # would spread them as keyword arguments and drop the id).
        parsed = self._parse_input(tool_input, tool_call_id)
        if not isinstance(parsed, dict):
            raise ValueError(f"{self.name}: arguments must be a JSON object")
        return (), {"arguments": dict(parsed), "tool_call_id": tool_call_id}

    async def _arun(
        self, arguments: dict[str, Any], tool_call_id: str | None, config: RunnableConfig
    ) -> Any:
        seen, outcome = await self.session.observe(
            self.name, arguments, tool_call_id, thread_of(config)
        )
        if tool_call_id is None:  # invoked with bare arguments: text, like any tool
            return seen.text
        return tool_message(seen, outcome, tool_call_id, self.name)

    def _run(
        self, arguments: dict[str, Any], tool_call_id: str | None, config: RunnableConfig
    ) -> Any:
        return self.session.run_sync(self._arun(arguments, tool_call_id, config))


class GatewayToolkit(BaseToolkit):
    """The tools this agent may call, as LangChain tools backed by the gateway."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    session: Any  # GatewaySession

    def get_tools(self) -> list[BaseTool]:
        return [GatewayTool.of(spec, self.session) for spec in self.session.tools()]


class GatewayToolMiddleware(AgentMiddleware):
    """Send every tool call of a `create_agent` agent through the gateway; run none locally.

    A call waiting for a human is a "waiting for approval" message; with
    `pause_for_approval=True` (and a checkpointer on the agent) it pauses the agent
    with LangGraph's interrupt instead, exactly as `GatewayToolNode` does, and a
    resume (`Command(resume=...)`) picks up the gateway's final result.
    """

    def __init__(
        self,
        session: GatewaySession,
        *,
        pause_for_approval: bool = False,
        resume_wait: float = DEFAULT_RESUME_WAIT_S,
    ) -> None:
        super().__init__()
        self.session = session
        self.pause_for_approval = pause_for_approval
        self.resume_wait = resume_wait

    def _call(self, request: ToolCallRequest) -> ModelToolCall:
        config = getattr(request.runtime, "config", None)
        return ModelToolCall(dict(request.tool_call), self.session, thread_of(config))

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        call = self._call(request)  # handler (the local tool) is never called
        call.outcome = await call.decide()
        while self.pause_for_approval and pause_for([call]):
            call.outcome = await call.final(self.resume_wait)
        return call.message()

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        call = self._call(request)  # interrupt() runs here, in the graph's thread
        call.outcome = self.session.run_sync(call.decide())
        while self.pause_for_approval and pause_for([call]):
            call.outcome = self.session.run_sync(call.final(self.resume_wait))
        return call.message()
