"""Scripted chat models for the framework tests: the frameworks' own test tools, no network.

`ScriptedChat` is LangChain's FakeMessagesListChatModel (answers in order)
that accepts `bind_tools` (create_agent binds the agent's tools) and remembers
what it was bound to and what it was shown. `StateChat` answers from the
conversation instead of a counter, so a graph rebuilt in a fresh process picks
up where the conversation is: a tool call first, then, once a tool message is
there, a final answer quoting it.
"""

from __future__ import annotations

from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult


def tool_call(name: str, args: dict[str, Any], call_id: str) -> dict[str, Any]:
    return {"name": name, "args": args, "id": call_id, "type": "tool_call"}


def calls(*tool_calls: dict[str, Any]) -> AIMessage:
    return AIMessage(content="", tool_calls=list(tool_calls))


class ScriptedChat(FakeMessagesListChatModel):
    bound: list[str] = []
    seen: list[list[BaseMessage]] = []

    def bind_tools(self, tools: Any, **kwargs: Any) -> ScriptedChat:
        self.bound = [getattr(t, "name", None) or t["name"] for t in tools]
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        self.seen = [*self.seen, list(messages)]
        return super()._generate(messages, *args, **kwargs)


class StateChat(BaseChatModel):
    """Calls `tool` with `args` (id `call_id`) until a tool message answers it."""

    tool: str
    args: dict[str, Any]
    call_id: str

    @property
    def _llm_type(self) -> str:
        return "state-chat"

    def bind_tools(self, tools: Any, **kwargs: Any) -> StateChat:
        return self

    def _generate(self, messages: list[BaseMessage], *args: Any, **kwargs: Any) -> ChatResult:
        answers = [m for m in messages if isinstance(m, ToolMessage)]
        if answers:
            reply = AIMessage(content=f"done: {answers[-1].content}")
        else:
            reply = calls(tool_call(self.tool, self.args, self.call_id))
        return ChatResult(generations=[ChatGeneration(message=reply)])
