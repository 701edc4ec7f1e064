"""A LangGraph agent whose tool node is the gateway's, built the same way in every process.

`python -m tests.system.framework_graph resume ...` is the "fresh process" of
the resume test: it connects as the agent, opens the checkpoint file, rebuilds
the graph and resumes the thread, then prints the thread's messages as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import BaseMessage, ToolMessage
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from tests.harness import Gateway
from tests.system.framework_fakes import StateChat
from toolgate.client.frameworks.langgraph import GatewayToolNode, SQLiteCheckpointer
from toolgate.client.frameworks.session import GatewaySession
from toolgate.contracts.registry import load_registry
from toolgate.stack import nats_auth

CLI_DEADLINE_S = 120  # a command that hangs fails its test instead of the session
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


def cli(args: list[str], gateway: Gateway) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli", *args],
        cwd=gateway.data_dir.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=CLI_DEADLINE_S,
    )


def approve_in_cli(gateway: Gateway, call_key: str) -> None:
    """What a human does: become an approver of acme, then approve the call as shown."""
    name = f"carol-{uuid.uuid4().hex[:6]}"
    made = cli(
        [
            "approvals",
            "add-approver",
            name,
            "--tenant",
            "acme",
            "--data-dir",
            str(gateway.data_dir),
        ],
        gateway,
    )
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    approved = cli(
        [
            "approvals",
            "approve",
            call_key,
            "--reason",
            "refund checked",
            "--token",
            token,
            "--nats-url",
            gateway.url,
            "--creds",
            str(nats_auth.approver_creds_path(gateway.data_dir, name)),
        ],
        gateway,
    )
    assert approved.returncode == 0, approved.stdout + approved.stderr


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
