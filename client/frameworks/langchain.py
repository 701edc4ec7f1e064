"""LangChain 1.x: gateway-backed tools, and a tool-call middleware for agents' own tools.

`GatewayToolkit(session=session).get_tools()` lists the tools this agent may call (its
creds say which agent it is; the registry's `allowed_agents` say which tools),
each with the registry's description and input schema. Running one publishes
a `ToolCall` and turns the `ToolResult` into the `ToolMessage`: the data as
content when ok; an error message (status "error") the model can read and
correct otherwise. When a human must decide first, a tool run by a LangGraph
graph with a checkpointer (`create_agent(..., checkpointer=...)`, LangGraph's
`create_react_agent`, a `ToolNode`) pauses the graph with the same interrupt
as `GatewayToolNode`, and a resume picks up the gateway's final result; with
no checkpointer (nothing could resume it) or `pause_for_approval=False`, the
tool message is an error (status "error", `ERROR approval_pending`) naming the
call_id, never a success: the tool has not run. Invoked with bare arguments
(no tool call), such a call raises `ApprovalPending`. Nothing runs in the
agent's process: the schema is the
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
from langchain_core.tools import BaseTool, BaseToolkit, ToolException
from langgraph.types import Command
from pydantic import ConfigDict

from toolgate.contracts.calls import ToolResult
from toolgate.contracts.registry import ToolSpec

from .core import ApprovalRequest, not_run, observe
from .session import GatewaySession
from .tool_calls import DEFAULT_RESUME_WAIT_S, ModelToolCall, can_pause, pause_for
from .tool_messages import thread_of

__all__ = ["ApprovalPending", "GatewayTool", "GatewayToolMiddleware", "GatewayToolkit"]


class ApprovalPending(ToolException):
    """A bare invocation met a call that waits for a human: the tool has not run.

    `request` is the approval request (its call_id names the call: a human may
    still approve it in toolgate, and its result is then stored under that id).
    """

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__(not_run(request).text)
        self.request = request


class GatewayTool(BaseTool):
    """One registry tool; calling it asks the gateway (nothing runs here)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    session: Any  # GatewaySession (Any: pydantic need not know the class)
    # Pause a checkpointed graph for a human (else: an error message, never a success).
    pause_for_approval: bool = True
    resume_wait: float = DEFAULT_RESUME_WAIT_S

    @classmethod
    def of(cls, spec: ToolSpec, session: GatewaySession, **options: Any) -> GatewayTool:
        return cls(
            name=spec.name,
            description=spec.description.strip(),
            args_schema=spec.input_schema,  # a JSON Schema: passed through, checked by the gateway
            session=session,
            **options,
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

    def _call(
        self, arguments: dict[str, Any], tool_call_id: str | None, config: RunnableConfig
    ) -> ModelToolCall:
        raw = {"name": self.name, "args": arguments, "id": tool_call_id}
        return ModelToolCall(raw, self.session, thread_of(config))

    def _pauses(self, tool_call_id: str | None, config: RunnableConfig) -> bool:
        # A pause needs a resumable graph, and a tool call id that keeps the call_id.
        return self.pause_for_approval and tool_call_id is not None and can_pause(config)

    def _answer(self, call: ModelToolCall, tool_call_id: str | None) -> Any:
        if tool_call_id is not None:
            return call.message()  # an error message for a call still waiting
        if call.waiting:  # invoked with bare arguments: no message to flag as an error
            raise ApprovalPending(call.request())
        assert isinstance(call.outcome, ToolResult)
        return observe(call.outcome, self.name).text  # text, like any tool

    async def _arun(
        self, arguments: dict[str, Any], tool_call_id: str | None, config: RunnableConfig
    ) -> Any:
        call = self._call(arguments, tool_call_id, config)
        call.outcome = await call.decide()
        while self._pauses(tool_call_id, config) and pause_for([call]):
            call.outcome = await call.final(self.resume_wait)
        return self._answer(call, tool_call_id)

    def _run(
        self, arguments: dict[str, Any], tool_call_id: str | None, config: RunnableConfig
    ) -> Any:
        # interrupt() must run here, in the graph's thread; the gateway steps on the session's loop.
        call = self._call(arguments, tool_call_id, config)
        call.outcome = self.session.run_sync(call.decide())
        while self._pauses(tool_call_id, config) and pause_for([call]):
            call.outcome = self.session.run_sync(call.final(self.resume_wait))
        return self._answer(call, tool_call_id)


class GatewayToolkit(BaseToolkit):
    """The tools this agent may call, as LangChain tools backed by the gateway."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    session: Any  # GatewaySession
    # Pause a checkpointed graph for a human (else: an error message, never a success).
    pause_for_approval: bool = True
    resume_wait: float = DEFAULT_RESUME_WAIT_S

    def get_tools(self) -> list[BaseTool]:
        options = {"pause_for_approval": self.pause_for_approval, "resume_wait": self.resume_wait}
        return [GatewayTool.of(spec, self.session, **options) for spec in self.session.tools()]


class GatewayToolMiddleware(AgentMiddleware):
    """Send every tool call of a `create_agent` agent through the gateway; run none locally.

    A call waiting for a human pauses the agent with LangGraph's interrupt when
    the agent has a checkpointer, exactly as `GatewayToolNode` does, and a resume
    (`Command(resume=...)`) picks up the gateway's final result. With no
    checkpointer, or `pause_for_approval=False`, it is an error tool message naming
    the call_id (never a success: the tool has not run).
    """

    def __init__(
        self,
        session: GatewaySession,
        *,
        pause_for_approval: bool = True,
        resume_wait: float = DEFAULT_RESUME_WAIT_S,
    ) -> None:
        super().__init__()
        self.session = session
        self.pause_for_approval = pause_for_approval
        self.resume_wait = resume_wait

    def _call(self, request: ToolCallRequest) -> ModelToolCall:
        config = getattr(request.runtime, "config", None)
        return ModelToolCall(dict(request.tool_call), self.session, thread_of(config))

    def _pauses(self, request: ToolCallRequest) -> bool:
        return self.pause_for_approval and can_pause(getattr(request.runtime, "config", None))

    async def awrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], Awaitable[ToolMessage | Command[Any]]],
    ) -> ToolMessage | Command[Any]:
        call = self._call(request)  # handler (the local tool) is never called
        call.outcome = await call.decide()
        while self._pauses(request) and pause_for([call]):
            call.outcome = await call.final(self.resume_wait)
        return call.message()

    def wrap_tool_call(
        self,
        request: ToolCallRequest,
        handler: Callable[[ToolCallRequest], ToolMessage | Command[Any]],
    ) -> ToolMessage | Command[Any]:
        call = self._call(request)  # interrupt() runs here, in the graph's thread
        call.outcome = self.session.run_sync(call.decide())
        while self._pauses(request) and pause_for([call]):
            call.outcome = self.session.run_sync(call.final(self.resume_wait))
        return call.message()
