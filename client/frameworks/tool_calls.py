"""One model tool call on its way through the gateway, and the approval pause.

Shared by LangGraph's `GatewayToolNode`, LangChain's `GatewayToolMiddleware` and
`GatewayTool` (all run inside a LangGraph graph, where `interrupt` pauses the graph
and a resume runs the node again from the start). Needs langchain-core and langgraph.

A pause is only worth its name when the graph can be resumed: its state is in a
checkpointer. Without one (or when told not to pause), a call waiting for a human
is an error tool message (`core.not_run`), never a success (DESIGN invariant 13).
"""

from __future__ import annotations

from typing import Any

from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langgraph.config import get_config
from langgraph.constants import CONFIG_KEY_CHECKPOINTER
from langgraph.types import interrupt

from toolgate.contracts.calls import ErrorCode, PendingNotice, ToolError, ToolResult, failure

from .core import ApprovalRequest, approval_request, not_run, observe
from .session import GatewaySession, timed_out
from .tool_messages import tool_message

# The `kind` of the value a paused graph's interrupt carries.
APPROVAL_INTERRUPT = "toolgate_approvals"
# How long a resumed graph waits for a call's final result before pausing again.
DEFAULT_RESUME_WAIT_S = 30.0


class ModelToolCall:
    """A tool call of an AI message, its call_id, and where it stands at the gateway."""

    def __init__(self, raw: dict[str, Any], session: GatewaySession, namespace: str | None):
        self.session = session
        self.name = str(raw.get("name") or "")
        self.tool_call_id = str(raw.get("id") or "")
        args = raw.get("args")
        self.arguments: dict[str, Any] = args if isinstance(args, dict) else {}
        self.call_id = session.call_id_for(self.tool_call_id, self.name, self.arguments, namespace)
        self.outcome: ToolResult | PendingNotice | None = None
        # Arguments that are not an object never reach the gateway: the model is told.
        self.malformed = (
            None
            if isinstance(args, dict)
            else failure(
                self.call_id,
                "invalid_arguments",
                ToolError(
                    code=ErrorCode.MALFORMED_CALL,
                    message=f"arguments must be a JSON object, got {type(args).__name__}",
                ),
            )
        )

    @property
    def waiting(self) -> bool:
        return isinstance(self.outcome, PendingNotice)

    async def decide(self) -> ToolResult | PendingNotice:
        """Publish (or re-publish: answered from the record) until a result or a pending notice."""
        if self.malformed is not None:
            return self.malformed
        try:
            return await self.session.decide(self.call_id, self.name, self.arguments)
        except TimeoutError:
            return timed_out(self.call_id, self.session.timeout)

    async def final(self, wait: float) -> ToolResult | PendingNotice:
        """After a resume: the final result if it comes within `wait` s, else still waiting."""
        done = await self.session.final(self.call_id, self.name, self.arguments, wait)
        return done if done is not None else self.outcome or timed_out(self.call_id, 0)

    def request(self) -> ApprovalRequest:
        assert isinstance(self.outcome, PendingNotice)
        return approval_request(self.outcome, self.name, self.arguments)

    def message(self) -> ToolMessage:
        assert self.outcome is not None
        if isinstance(self.outcome, PendingNotice):  # the run did not pause: not a success
            request = self.request()
            return tool_message(not_run(request), request, self.tool_call_id, self.name)
        return tool_message(
            observe(self.outcome, self.name), self.outcome, self.tool_call_id, self.name
        )


def can_pause(config: RunnableConfig | None = None) -> bool:
    """Whether this code runs in a LangGraph graph that keeps its state in a checkpointer,
    so that an interrupt is a pause a resume can pick up (`config`: the node's, else
    the one LangGraph set for this task)."""
    if config is None:
        try:
            config = get_config()
        except RuntimeError:  # not run by LangGraph at all
            return False
    configurable = config.get("configurable") or {}
    return configurable.get(CONFIG_KEY_CHECKPOINTER) is not None


def pause_for(calls: list[ModelToolCall]) -> bool:
    """Interrupt the graph for the calls still waiting for a human; False when none waits.

    On a resume, `interrupt` returns the resume value: deliberately ignored (what
    happened is the gateway's to say, never the resumer's).
    """
    pending = [c for c in calls if c.waiting]
    if not pending:
        return False
    interrupt({"kind": APPROVAL_INTERRUPT, "requests": [c.request().as_dict() for c in pending]})
    return True
