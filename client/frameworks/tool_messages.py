"""LangChain `ToolMessage`s from the core's observations (needs langchain-core only).

Shared by the LangChain tools and middleware and by the LangGraph tool node, so
the `[langgraph]` extra works without the `langchain` package.
"""

from __future__ import annotations

from typing import Any

import msgspec
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig

from toolgate.contracts.calls import ToolResult

from .core import ApprovalRequest, Observation


def thread_of(config: RunnableConfig | None) -> str | None:
    """The conversation a tool call belongs to (LangGraph's thread_id), when there is one."""
    configurable = (config or {}).get("configurable") or {}
    thread = configurable.get("thread_id")
    return str(thread) if thread is not None else None


def artifact_of(outcome: ToolResult | ApprovalRequest) -> dict[str, Any]:
    """What rides along the message for the platform (not shown to the model)."""
    if isinstance(outcome, ApprovalRequest):
        return {"approval": outcome.as_dict()}
    return {"result": msgspec.to_builtins(outcome)}


def tool_message(
    seen: Observation, outcome: ToolResult | ApprovalRequest, tool_call_id: str, name: str
) -> ToolMessage:
    return ToolMessage(
        content=seen.text,
        tool_call_id=tool_call_id,
        name=name,
        status="error" if seen.is_error else "success",
        artifact=artifact_of(outcome),
    )
