"""The MCP front door across its own processes: SEP-2663 tasks for calls that wait for a
human (answered by any front door, or a restarted one: the task is the call, kept in
JetStream), and `toolgate up` keeping the front door's port for its data dir."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.harness import Gateway, make_test_registry
from tests.mcp_support import agent_token, wait_for_front_door
from tests.tools.faulty import runs_of
from toolgate.contracts.authorization import arguments_sha256
from toolgate.runtime.creds import connect_options
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.stack.processes import free_port
from toolgate.stack.supervisor import MCP_PORT_FILE, ServiceProcess, StackError, serve_command

pytestmark = pytest.mark.system

MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
LONG_READ = httpx2.Timeout(30.0, read=600.0)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("mcp-tasks")
    gateway = Gateway(
        with_mcp=True, data_dir=base / "data", registry_dir=make_test_registry(base / "reg")
    )
    gateway.start()
    asyncio.run(wait_for_front_door(gateway))
    yield gateway
    gateway.stop()


class Door:
    """Another front door process on the same gateway (`toolgate serve mcp`)."""

    def __init__(self, gateway: Gateway, port: int, name: str) -> None:
        self.url = f"http://127.0.0.1:{port}/mcp"
        self.process = ServiceProcess(
            name,
            serve_command(
                "mcp",
                gateway.url,
                gateway.data_dir,
                [gateway.registry_dir],
                ["--port", str(port)],
                creds=gateway.stack.creds_of("mcp_front"),
                builtin_tools=False,
            ),
            gateway.data_dir / "logs" / f"{name}.log",
        )

    async def start(self) -> Door:
        self.process.start()
        async with httpx2.AsyncClient() as http:
            for _ in range(600):
                try:
                    if (await http.post(self.url, json={})).status_code == 401:
                        return self
                except httpx2.TransportError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"front door {self.url} never answered")

    def stop(self) -> None:
        self.process.stop()


def request(method: str, params: dict[str, Any], *, tasks: bool = True) -> dict[str, Any]:
    """A 2026-07-28 request (no session), declaring the tasks extension or not."""
    capabilities: dict[str, Any] = {"extensions": {TASKS: {}}} if tasks else {}
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": method,
        "params": {
            **params,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": MODERN,
                "io.modelcontextprotocol/clientInfo": {"name": "tasks-test", "version": "1"},
                "io.modelcontextprotocol/clientCapabilities": capabilities,
                **params.get("_meta", {}),
            },
        },
    }


async def rpc(url: str, token: str, body: dict[str, Any]) -> dict[str, Any]:
    """One JSON-RPC exchange; its `result` or `error` object."""
    name = body["params"].get("name") or body["params"].get("taskId", "")
    headers = {
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {token}",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": body["method"],
        "Mcp-Name": name,
    }
    async with httpx2.AsyncClient(timeout=LONG_READ) as http:
        answer = await http.post(url, json=body, headers=headers)
    assert answer.status_code in (200, 400), answer.text
    if answer.headers["content-type"].startswith("text/event-stream"):
        data = [line[5:] for line in answer.text.splitlines() if line.startswith("data:")]
        import json

        message: dict[str, Any] = json.loads(data[-1])
    else:
        message = answer.json()
    return message


async def approve(gateway: Gateway, call_id: str, arguments: dict[str, Any], vote: str) -> None:
    token = add_approver(gateway.data_dir, f"ann-{uuid.uuid4().hex[:6]}", ["acme"])
    async with await ApprovalsClient.connect(
        gateway.url, token=token, **connect_options(gateway.stack.creds_of("inbox"))
    ) as approvals:
        await approvals.vote(
            f"acme.researcher.{call_id}",
            vote,
            arguments_sha256=arguments_sha256(arguments),
            reason="checked",
        )


async def test_a_call_waiting_for_a_human_is_a_task_any_front_door_answers(
    gateway: Gateway,
) -> None:
    token = await agent_token(gateway, "acme", "researcher")
    first = gateway.stack.mcp_url or ""
    arguments = {"amount": 31}
    call_id = f"task-{uuid.uuid4().hex[:8]}"
    created = await rpc(
        first,
        token,
        request(
            "tools/call",
            {
                "name": "approved_action",
                "arguments": arguments,
                "_meta": {"toolgate/call_id": call_id},
            },
        ),
    )
    assert "result" in created, created
    task = created["result"]
    assert task["resultType"] == "task", created
    assert task["status"] == "working" and "human approval" in task["statusMessage"]
    task_id = task["taskId"]
    assert call_id in task_id and task["pollIntervalMs"] > 0

    # Another front door, started after the task was made, knows it.
    port = free_port()
    other = await Door(gateway, port, "mcp-other").start()
    try:
        got = await rpc(other.url, token, request("tasks/get", {"taskId": task_id}))
        assert got["result"]["status"] == "working", got
        # It waits for a human: the agent cannot withdraw it, and is told so.
        cancel = await rpc(other.url, token, request("tasks/cancel", {"taskId": task_id}))
        assert "cannot be withdrawn" in cancel["error"]["message"], cancel
        # Another agent does not see it.
        stranger = await agent_token(gateway, "acme", "writer")
        hidden = await rpc(other.url, stranger, request("tasks/get", {"taskId": task_id}))
        assert "unknown task" in hidden["error"]["message"], hidden
        await approve(gateway, call_id, arguments, "approve")
    finally:
        other.stop()
    # That front door restarted (the same port): the result is the task's.
    again = await Door(gateway, port, "mcp-again").start()
    try:
        for _ in range(600):
            got = await rpc(again.url, token, request("tasks/get", {"taskId": task_id}))
            if got["result"]["status"] != "working":
                break
            await asyncio.sleep(0.1)
        done = got["result"]
        result = await rpc(again.url, token, request("tasks/result", {"taskId": task_id}))
    finally:
        again.stop()
    assert done["status"] == "completed", done
    assert done["result"]["isError"] is False
    assert done["result"]["structuredContent"] == {"call_id": call_id}
    assert result["result"]["structuredContent"] == {"call_id": call_id}
    assert runs_of(gateway.data_dir, "approved_action").count(call_id) == 1


async def test_a_client_without_the_extension_waits_as_before(gateway: Gateway) -> None:
    """No task for a client that did not declare the extension, nor for a quick call."""
    token = await agent_token(gateway, "acme", "researcher")
    url = gateway.stack.mcp_url or ""
    quick = await rpc(
        url, token, request("tools/call", {"name": "echo", "arguments": {"payload": 1}})
    )
    assert quick["result"]["resultType"] == "complete"
    assert quick["result"]["structuredContent"] == {"payload": 1}
    arguments = {"amount": 32}
    call_id = f"plain-{uuid.uuid4().hex[:8]}"
    waiting = asyncio.ensure_future(
        rpc(
            url,
            token,
            request(
                "tools/call",
                {
                    "name": "approved_action",
                    "arguments": arguments,
                    "_meta": {"toolgate/call_id": call_id},
                },
                tasks=False,
            ),
        )
    )
    for _ in range(600):
        if (gateway.data_dir / "logs").exists() and await pending(gateway, call_id):
            break
        await asyncio.sleep(0.1)
    await approve(gateway, call_id, arguments, "deny")
    answer = await asyncio.wait_for(waiting, 600)
    assert answer["result"]["resultType"] == "complete"
    assert answer["result"]["isError"] is True


async def pending(gateway: Gateway, call_id: str) -> bool:
    token = add_approver(gateway.data_dir, f"look-{uuid.uuid4().hex[:6]}", ["acme"])
    async with await ApprovalsClient.connect(
        gateway.url, token=token, **connect_options(gateway.stack.creds_of("inbox"))
    ) as approvals:
        return any(view.call_id == call_id for view in await approvals.pending())


# ---------------------------------------------------------------- the port, kept


def test_toolgate_up_keeps_the_front_doors_port_for_its_data_dir(tmp_path: Path) -> None:
    registry = make_test_registry(tmp_path / "reg")
    data = tmp_path / "data"
    first = Gateway(with_mcp=True, data_dir=data, registry_dir=registry).start()
    try:
        url = first.stack.mcp_url
    finally:
        first.stop()
    assert url is not None
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    assert (data / MCP_PORT_FILE).read_text().strip() == str(port)
    again = Gateway(with_mcp=True, data_dir=data, registry_dir=registry).start()
    try:
        assert again.stack.mcp_url == url
    finally:
        again.stop()
    # Taken by something else meanwhile: `toolgate up` says so, and what to do.
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        with pytest.raises(StackError) as taken:
            Gateway(with_mcp=True, data_dir=data, registry_dir=registry).start()
    assert f"port {port}" in str(taken.value) and "--mcp-port" in str(taken.value)
    assert MCP_PORT_FILE in str(taken.value)
