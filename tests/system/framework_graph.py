"""A LangGraph agent whose tool node is the gateway's, built the same way in every process.

`python -m tests.system.framework_graph resume ...` is the "fresh process" of
the resume test: it connects as the agent, opens the checkpoint file, rebuilds
the graph and resumes the thread, then prints the thread's messages as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage, ToolMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from tests.system.framework_fakes import StateChat
from toolgate.client.frameworks.langgraph import GatewayToolNode, SQLiteCheckpointer
from toolgate.client.frameworks.session import GatewaySession
from toolgate.contracts.registry import load_registry

APPROVED = {"tool": "approved_action", "args": {"amount": 7}, "call_id": "call_refund"}


def build(
    session: GatewaySession, checkpointer: SQLiteCheckpointer, model: BaseChatModel, **node: Any
) -> Any:
    def agent(state: MessagesState) -> dict[str, list[BaseMessage]]:
        return {"messages": [model.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", GatewayToolNode(session, **node))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=checkpointer)


def as_json(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    return [
        {
            "type": m.type,
            "content": m.content,
            "status": getattr(m, "status", None),
            "artifact": m.artifact if isinstance(m, ToolMessage) else None,
        }
        for m in messages
    ]


async def resume(args: argparse.Namespace) -> None:
    session = await GatewaySession.connect(
        args.nats_url,
        args.creds,
        user=args.user,
        session="s-1",
        registry=load_registry(args.registry),
    )
    checkpointer = SQLiteCheckpointer(args.checkpoint)
    try:
        graph = build(session, checkpointer, StateChat(**APPROVED), resume_wait=60)
        config = {"configurable": {"thread_id": args.thread}}
        state = await graph.ainvoke(Command(resume=json.loads(args.resume_value)), config)
        print(
            json.dumps(
                {
                    "messages": as_json(state["messages"]),
                    "interrupts": [i.value for i in state.get("__interrupt__", [])],
                }
            )
        )
    finally:
        checkpointer.close()
        await session.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("action", choices=["resume"])
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--creds", type=Path, required=True)
    parser.add_argument("--registry", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--thread", required=True)
    parser.add_argument("--user", default="u-alice")
    parser.add_argument("--resume-value", default='"approved"')
    asyncio.run(resume(parser.parse_args()))


if __name__ == "__main__":
    main()
