"""The MCP front door, with the official SDK's client against a whole gateway (`toolgate up`
as separate processes, locked bus): what an MCP-speaking agent sees, and the attacks.

Attacks: no, bad, forged or revoked tokens; one agent reading another's tools, results or
session; a tool hidden from the agent; a retry that would run a tool twice; two clients
whose JSON-RPC ids collide; a request from a foreign Origin or Host.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx2
import mcp_types as types
import msgspec
import nats
import pytest
import yaml
from mcp.shared.exceptions import MCPError
from nats.errors import Error as NatsError
from nats.js.errors import NotFoundError

from tests.harness import Gateway, flushed, make_test_registry
from tests.mcp_support import (
    INSPECTOR_DIR,
    InspectorMissing,
    agent_token,
    inspector,
    install_inspector,
    mcp_client,
    structured,
    toolgate,
    wait_for_front_door,
)
from tests.tools.faulty import runs_of
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.contracts.registry import load_registry
from toolgate.runtime.creds import connect_options
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.services.mcp_front.app import WATCH_AFTER_S
from toolgate.stack.nats_auth import revoke_agent

pytestmark = pytest.mark.system

CALL_ID = "toolgate/call_id"
LEGACY_VERSION = "2025-11-25"
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {
        "protocolVersion": LEGACY_VERSION,
        "capabilities": {},
        "clientInfo": {"name": "attacker", "version": "0"},
    },
}
ACCEPT = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A gateway with the test tools and one tool only agent `writer` may call."""
    base = tmp_path_factory.mktemp("mcp-door")
    registry = make_test_registry(base / "registry")
    hidden = yaml.safe_load((registry / "count_runs.yaml").read_text())
    hidden.update(name="writer_only", allowed_agents=["writer"])
    (registry / "writer_only.yaml").write_text(yaml.safe_dump(hidden))
    gateway = Gateway(with_mcp=True, data_dir=base / "data", registry_dir=registry).start()
    asyncio.run(wait_for_front_door(gateway))
    yield gateway
    gateway.stop()


def meta(call_id: str) -> dict[str, Any]:
    return {CALL_ID: call_id}


async def post(url: str, body: Any, headers: dict[str, str]) -> httpx2.Response:
    async with httpx2.AsyncClient() as http:
        return await http.post(url, json=body, headers={**ACCEPT, **headers})


# ---------------------------------------------------------------- who is calling


async def test_no_bad_forged_or_revoked_token_gets_401_with_www_authenticate(
    door: Gateway,
) -> None:
    url = door.stack.mcp_url
    assert url is not None
    token = await agent_token(door, "acme", "temp")
    forged = token.rsplit(".", 1)[0] + ".not-the-secret"
    for headers in (
        {},
        {"Authorization": "Bearer nonsense"},
        {"Authorization": f"Bearer {forged}"},
        {"Authorization": f"Basic {token}"},
    ):
        answer = await post(url, INITIALIZE, headers)
        assert answer.status_code == 401, headers
        challenge = answer.headers["www-authenticate"]
        assert challenge.startswith("Bearer ") and 'error="invalid_token"' in challenge
        assert "resource_metadata=" in challenge
    metadata_url = challenge.split('resource_metadata="', 1)[1].rstrip('"')
    async with httpx2.AsyncClient() as http:
        metadata = (await http.get(metadata_url)).json()
    assert metadata["resource"] == url
    # The real token works, until the agent is revoked: then it is 401 at once.
    assert (await post(url, INITIALIZE, {"Authorization": f"Bearer {token}"})).status_code == 200
    revoke_agent(door.data_dir, "acme", "temp")
    answer = await post(url, INITIALIZE, {"Authorization": f"Bearer {token}"})
    assert answer.status_code == 401


async def test_tools_list_is_exactly_what_the_agent_may_call(door: Gateway) -> None:
    registry = load_registry(door.registry_dir)
    async with mcp_client(
        door.stack.mcp_url or "", await agent_token(door, "acme", "researcher")
    ) as c:
        listed = {tool.name: tool for tool in (await c.list_tools()).tools}
    assert sorted(listed) == [spec.name for spec in registry.visible_to("researcher")]
    assert "writer_only" not in listed
    search = registry.get("search_sources")
    assert search is not None
    tool = listed["search_sources"]
    assert tool.description == search.description
    assert tool.input_schema == search.input_schema
    assert tool.output_schema == search.output_schema
    assert tool.annotations is not None and tool.annotations.read_only_hint is True
    evidence = listed["save_evidence"].annotations
    assert evidence is not None
    assert evidence.read_only_hint is False and evidence.destructive_hint is True
    async with mcp_client(door.stack.mcp_url or "", await agent_token(door, "acme", "writer")) as c:
        assert "writer_only" in {tool.name for tool in (await c.list_tools()).tools}


# ---------------------------------------------------------------- tools/call


async def test_each_status_is_mapped_faithfully(door: Gateway) -> None:
    url = door.stack.mcp_url or ""
    async with mcp_client(url, await agent_token(door, "acme", "researcher")) as c:
        ok = await c.call_tool("echo", {"payload": "hello"})
        assert ok.is_error is False
        assert structured(ok) == {"payload": "hello"}
        assert isinstance(ok.content[0], types.TextContent)
        assert json.loads(ok.content[0].text) == {"payload": "hello"}
        assert ok.meta is not None and ok.meta["toolgate/status"] == "ok"

        async def failed(tool: str, arguments: dict[str, Any], **kw: Any) -> dict[str, Any]:
            result = await c.call_tool(tool, arguments, **kw)
            assert result.is_error is True, result
            body = structured(result)
            assert isinstance(result.content[0], types.TextContent)
            assert json.loads(result.content[0].text) == body
            return body

        bad = await failed(
            "search_sources", {"query": "agents sessions", "source_type": "any", "limit": 50}
        )
        assert bad["status"] == "invalid_arguments"
        assert bad["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
        assert bad["error"]["retryable"] is False
        assert [d["path"] for d in bad["error"]["details"]] == ["/limit"]

        denied = await failed(
            "save_evidence",
            {"task_id": "task_other", "claim": "c", "source_url": "https://docs.nats.io/x"},
            meta={"toolgate/task_id": "task_mine"},
        )
        assert denied["status"] == "denied"
        assert denied["error"]["code"] == "TASK_SCOPE_VIOLATION"

        slow = await failed("slow_backend", {"sleep_s": 5})
        assert slow["status"] == "timeout" and slow["error"]["code"] == "TOOL_TIMEOUT"

        refused = await failed("fetch_document", {"url": "https://not-allowed.example/x"})
        assert refused["status"] == "execution_error"

        broken = await failed("broken_output", {})
        assert broken["status"] == "invalid_tool_result"
        assert broken["error"]["code"] == "OUTPUT_SCHEMA_VIOLATION"
        assert "internal detail" not in json.dumps(broken)

        with pytest.raises(MCPError) as unknown:
            await c.call_tool("no_such_tool", {})
        assert unknown.value.code == types.INVALID_PARAMS

        with pytest.raises(MCPError) as bad_id:
            await c.call_tool("echo", {"payload": "x"}, meta=meta("not a subject token!"))
        assert bad_id.value.code == types.INVALID_PARAMS


async def test_a_tool_hidden_from_the_agent_is_neither_listed_nor_callable(door: Gateway) -> None:
    async with mcp_client(
        door.stack.mcp_url or "", await agent_token(door, "acme", "researcher")
    ) as c:
        with pytest.raises(MCPError) as hidden:
            await c.call_tool("writer_only", {}, meta=meta("hidden-1"))
    assert hidden.value.code == types.INVALID_PARAMS
    assert "Unknown tool" in hidden.value.message
    assert runs_of(door.data_dir, "writer_only") == []


async def test_a_retry_with_the_same_meta_call_id_returns_the_recorded_result(
    door: Gateway,
) -> None:
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    call_id = f"retry-{uuid.uuid4().hex[:8]}"
    async with mcp_client(url, token) as c:
        first = await c.call_tool("count_runs", {}, meta=meta(call_id))
    # Another connection (as after a crash of the agent), the same call_id.
    async with mcp_client(url, token, mode="legacy") as c:
        again = await c.call_tool("count_runs", {}, meta=meta(call_id))
    assert first.is_error is False and again.is_error is False
    assert structured(first) == structured(again) == {"call_id": call_id}
    assert again.meta is not None and again.meta[CALL_ID] == call_id
    assert runs_of(door.data_dir).count(call_id) == 1


async def test_the_clients_trace_context_goes_with_the_call_when_no_span_is_recorded(
    door: Gateway,
) -> None:
    """This door exports no traces, so it skips the SDK's per-request span: the trace
    context the client sent in `_meta` still goes with the call, as the call's own."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    call_id = f"traced-{uuid.uuid4().hex[:8]}"
    traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    async with mcp_client(url, token) as c:
        result = await c.call_tool(
            "echo", {"payload": "traced"}, meta={**meta(call_id), "traceparent": traceparent}
        )
    assert result.is_error is False
    nc = await door.connect()
    try:
        stored = await nc.jetstream().get_last_msg(
            subjects.CALLS_STREAM, subjects.calls_subject("acme", "researcher")
        )
    finally:
        await nc.close()
    call = msgspec.json.decode(stored.data, type=ToolCall)
    assert call.call_id == call_id
    assert call.context.get("traceparent") == traceparent


async def test_two_clients_with_the_same_jsonrpc_ids_get_calls_of_their_own(
    door: Gateway,
) -> None:
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    seen: list[str] = []
    for _ in range(2):
        # A fresh SDK client numbers its requests from the start: the ids collide.
        async with mcp_client(url, token, mode="legacy") as c:
            result = await c.call_tool("count_runs", {})
        assert result.meta is not None
        seen.append(result.meta[CALL_ID])
        assert structured(result) == {"call_id": seen[-1]}
    assert seen[0] != seen[1]
    runs = runs_of(door.data_dir)
    assert runs.count(seen[0]) == 1 and runs.count(seen[1]) == 1


async def test_agent_a_cannot_read_agent_b_results_or_use_its_session(door: Gateway) -> None:
    url = door.stack.mcp_url or ""
    alice = await agent_token(door, "acme", "researcher")
    walt = await agent_token(door, "acme", "writer")
    shared = f"shared-{uuid.uuid4().hex[:8]}"
    async with mcp_client(url, walt) as c:
        secret = await c.call_tool("echo", {"payload": "walt's secret"}, meta=meta(shared))
    assert structured(secret) == {"payload": "walt's secret"}
    # The same call_id from another agent is that agent's own, new call.
    async with mcp_client(url, alice) as c:
        mine = await c.call_tool("echo", {"payload": "alice's"}, meta=meta(shared))
    assert structured(mine) == {"payload": "alice's"}
    # A session opened with Walt's token is not Alice's to use.
    opened = await post(url, INITIALIZE, {"Authorization": f"Bearer {walt}"})
    assert opened.status_code == 200
    session = opened.headers["mcp-session-id"]
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}
    hijack = await post(
        url,
        listing,
        {
            "Authorization": f"Bearer {alice}",
            "Mcp-Session-Id": session,
            "Mcp-Protocol-Version": LEGACY_VERSION,
        },
    )
    assert hijack.status_code == 404


async def test_a_foreign_origin_or_host_is_refused(door: Gateway) -> None:
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    auth = {"Authorization": f"Bearer {token}"}
    assert (
        await post(url, INITIALIZE, {**auth, "Origin": "https://evil.example"})
    ).status_code == 403
    assert (await post(url, INITIALIZE, {**auth, "Host": "evil.example"})).status_code == 421
    local = await post(url, INITIALIZE, {**auth, "Origin": "http://127.0.0.1:3000"})
    assert local.status_code == 200


# ---------------------------------------------------------------- waiting for a human


async def test_a_call_waiting_for_a_human_reports_progress_and_honours_cancellation(
    door: Gateway,
) -> None:
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    approver_token = add_approver(door.data_dir, f"carol-{uuid.uuid4().hex[:6]}", ["acme"])
    call_id = f"wait-{uuid.uuid4().hex[:8]}"
    arguments = {"amount": 7}
    progress: list[tuple[float, str | None]] = []
    told = asyncio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))
        told.set()

    async with mcp_client(url, token, mode="legacy") as c:
        # Cancelled while it waits: the client stops waiting, the call stays with the humans.
        with anyio.move_on_after(600) as scope:
            async with anyio.create_task_group() as group:

                async def first_try() -> None:
                    await c.call_tool(
                        "approved_action",
                        arguments,
                        meta=meta(call_id),
                        progress_callback=on_progress,
                    )

                group.start_soon(first_try)
                await told.wait()
                group.cancel_scope.cancel()
        assert not scope.cancelled_caught
        assert progress and "human" in (progress[0][1] or "")
        assert call_id not in runs_of(door.data_dir, "approved_action")
        # The same session goes on serving.
        assert (await c.call_tool("echo", {"payload": 1})).is_error is False

        # A retry waits again (and is told again), the approver approves, the result comes.
        told.clear()
        retry = asyncio.ensure_future(
            c.call_tool(
                "approved_action", arguments, meta=meta(call_id), progress_callback=on_progress
            )
        )
        await asyncio.wait_for(told.wait(), 600)
        async with await ApprovalsClient.connect(
            door.url, token=approver_token, **connect_options(door.stack.creds_of("inbox"))
        ) as approvals:
            outcome = await approvals.vote(
                f"acme.researcher.{call_id}",
                "approve",
                arguments_sha256=arguments_sha256(arguments),
                reason="checked",
            )
        assert outcome is not None
        result = await asyncio.wait_for(retry, 600)
    assert result.is_error is False, result
    assert structured(result) == {"call_id": call_id}
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1


MODERN_VERSION = "2026-07-28"


def modern_call(tool: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    """A 2026-07-28 tools/call as the SDK's client writes it, without a progress token."""
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {
            "name": tool,
            "arguments": arguments,
            "_meta": {
                "io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
                "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
                "io.modelcontextprotocol/clientCapabilities": {},
                CALL_ID: call_id,
            },
        },
    }


def modern_headers(token: str, tool: str) -> dict[str, str]:
    return {
        **ACCEPT,
        "Authorization": f"Bearer {token}",
        "MCP-Protocol-Version": MODERN_VERSION,
        "Mcp-Method": "tools/call",
        "Mcp-Name": tool,
    }


async def test_a_call_without_a_progress_token_is_one_json_answer(door: Gateway) -> None:
    """Served by the SDK's JSON-response manager: it answers a client that accepts only
    JSON. A call that asks for progress needs a stream, so that client is refused."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    call_id = f"one-{uuid.uuid4().hex[:8]}"
    json_only = {**modern_headers(token, "echo"), "Accept": "application/json"}
    async with httpx2.AsyncClient() as http:
        answer = await http.post(
            url, json=modern_call("echo", {"payload": 3}, call_id), headers=json_only
        )
        asks_progress = modern_call("echo", {"payload": 4}, f"{call_id}-p")
        asks_progress["params"]["_meta"]["progressToken"] = 1
        refused = await http.post(url, json=asks_progress, headers=json_only)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert int(answer.headers["content-length"]) == len(answer.content)
    result = answer.json()["result"]
    assert result["isError"] is False
    assert result["structuredContent"] == {"payload": 3}
    assert result["_meta"][CALL_ID] == call_id
    assert refused.status_code == 406


def single_body_call(
    http: httpx2.AsyncClient,
    url: str,
    token: str,
    tool: str,
    arguments: dict[str, Any],
    call_id: str,
) -> asyncio.Future[httpx2.Response]:
    """A 2026-07-28 tools/call without a progress token, in flight."""
    return asyncio.ensure_future(
        http.post(
            url, json=modern_call(tool, arguments, call_id), headers=modern_headers(token, tool)
        )
    )


@contextlib.asynccontextmanager
async def approver_of_acme(door: Gateway) -> AsyncIterator[ApprovalsClient]:
    token = add_approver(door.data_dir, f"appr-{uuid.uuid4().hex[:6]}", ["acme"])
    async with await ApprovalsClient.connect(
        door.url, token=token, **connect_options(door.stack.creds_of("inbox"))
    ) as approvals:
        yield approvals


async def approve_when_pending(
    approvals: ApprovalsClient, call_id: str, arguments: dict[str, Any], *, then: float = 0.0
) -> None:
    """Once the call waits for an approval, wait `then` more seconds, and approve it."""
    for _ in range(600):
        if any(view.call_id == call_id for view in await approvals.pending()):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError(f"{call_id} never waited for an approval")
    await asyncio.sleep(then)
    await approvals.vote(
        f"acme.researcher.{call_id}",
        "approve",
        arguments_sha256=arguments_sha256(arguments),
        reason="checked",
    )


async def leave(request: asyncio.Future[httpx2.Response]) -> None:
    """The client goes away: its connection is closed."""
    assert not request.done()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def door_says(door: Gateway, text: str) -> None:
    log = door.data_dir / "logs" / "mcp.log"
    for _ in range(300):
        if text in log.read_text():
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the front door never said {text!r}: {log.read_text()[-2000:]}")


LONG_READ = httpx2.Timeout(30.0, read=600.0)


async def test_a_client_answered_in_one_body_waits_through_an_approval(door: Gateway) -> None:
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    call_id = f"stay-{uuid.uuid4().hex[:8]}"
    arguments = {"amount": 12}
    async with httpx2.AsyncClient(timeout=LONG_READ) as http, approver_of_acme(door) as approvals:
        request = single_body_call(http, url, token, "approved_action", arguments, call_id)
        # Approved well after the door started watching the connection: still there.
        await approve_when_pending(approvals, call_id, arguments, then=3 * WATCH_AFTER_S)
        answer = await asyncio.wait_for(request, 600)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    result = answer.json()["result"]
    assert result["isError"] is False, result
    assert result["structuredContent"] == {"call_id": call_id}
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1


async def test_a_client_answered_in_one_body_that_goes_away_ends_the_wait_not_the_call(
    door: Gateway,
) -> None:
    """No progress token: no stream to close, so the front door watches the connection
    itself while the call waits; the call stays with the approvers."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    call_id = f"gone-{uuid.uuid4().hex[:8]}"
    arguments = {"amount": 11}
    said = f"went away while call {call_id} was in flight"
    async with httpx2.AsyncClient(timeout=LONG_READ) as http, approver_of_acme(door) as approvals:
        request = single_body_call(http, url, token, "approved_action", arguments, call_id)
        approval = asyncio.ensure_future(
            approve_when_pending(approvals, call_id, arguments, then=3600)
        )
        await asyncio.sleep(3 * WATCH_AFTER_S)  # watched, and not taken for gone
        assert said not in (door.data_dir / "logs" / "mcp.log").read_text()
        await leave(request)
        await door_says(door, said)
        assert call_id not in runs_of(door.data_dir, "approved_action")
        approval.cancel()
        await approve_when_pending(approvals, call_id, arguments)
    # The call went on without its client: a retry with its call_id collects the result.
    async with mcp_client(url, token) as c:
        result = await c.call_tool("approved_action", arguments, meta=meta(call_id))
    assert result.is_error is False, result
    assert structured(result) == {"call_id": call_id}
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1


async def test_a_client_that_leaves_a_slow_call_ends_the_wait_not_the_call(
    door: Gateway,
) -> None:
    """Not only a human's wait: any call that takes more than a second is watched."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    call_id = f"slow-{uuid.uuid4().hex[:8]}"
    arguments = {"sleep_s": 4 * WATCH_AFTER_S}
    async with httpx2.AsyncClient(timeout=LONG_READ) as http:
        request = single_body_call(http, url, token, "count_runs", arguments, call_id)
        await asyncio.sleep(2 * WATCH_AFTER_S)
        await leave(request)
    await door_says(door, f"went away while call {call_id} was in flight")
    # The tool ran once, and its result is the retry's answer.
    async with mcp_client(url, token) as c:
        result = await c.call_tool("count_runs", arguments, meta=meta(call_id))
    assert result.is_error is False, result
    assert runs_of(door.data_dir, "count_runs").count(call_id) == 1


def test_toolgate_up_prints_the_front_door(door: Gateway) -> None:
    recorded = json.loads((door.data_dir / "context.json").read_text())
    assert recorded["mcp_url"] == door.stack.mcp_url
    assert Path(recorded["creds"]["mcp_front"]).name == "mcp_front.creds"


async def test_the_front_door_identity_reaches_nothing_but_the_agents_subjects(
    door: Gateway,
) -> None:
    """What a compromised front door could do with its creds: publish calls as an agent and
    read results. No event, no bucket, no stream of toolgate's, no reply injected into one."""
    problems: list[Exception] = []

    async def remember(exc: Exception) -> None:
        problems.append(exc)

    front = await nats.connect(
        door.url, error_cb=remember, **connect_options(door.stack.creds_of("mcp_front"))
    )
    try:
        await front.publish(subjects.event_subject("CallAuthorized", "echo"), b"{}")
        await flushed(front)
        js = front.jetstream()
        with pytest.raises(NatsError):
            await js.publish(subjects.event_subject("CallAuthorized", "echo"), b"{}", timeout=1)
        with pytest.raises(NatsError):
            await js.key_value(subjects.OUTCOMES_BUCKET)
        # An agent that holds no front-door token: the front door cannot act for it.
        await door.agent_creds("acme", "no-token")
        with pytest.raises(NatsError):
            await js.publish(subjects.calls_subject("acme", "no-token"), b"{}", timeout=1)
        # A call of its agent, with the reply subject aimed at toolgate's events stream.
        call_id = f"inject-{uuid.uuid4().hex[:8]}"
        call = ToolCall(
            call_id=call_id,
            tool="echo",
            arguments={"payload": "x"},
            principal=Principal(tenant="acme", user="u", agent="researcher", session="s"),
        )
        results = await front.subscribe(subjects.results_subject("acme", "researcher", call_id))
        await front.publish(
            subjects.calls_subject("acme", "researcher"),
            msgspec.json.encode(call),
            reply=subjects.event_subject("ArgumentsValidated", "echo"),
        )
        result = msgspec.json.decode((await results.next_msg(timeout=60)).data, type=ToolResult)
        assert result.status == "ok"
    finally:
        await front.close()
    assert any("permissions violation" in str(p).lower() for p in problems), problems
    stored = [e for e in await door.events() if e.call_id == call_id]
    assert stored  # the call went through the pipeline as that agent's
    admin = await door.connect()
    try:
        info = await admin.jsm().stream_info(subjects.EVENTS_STREAM)
        for seq in range(
            max(info.state.first_seq, info.state.last_seq - 200), info.state.last_seq + 1
        ):
            try:
                msg = await admin.jsm().get_msg(subjects.EVENTS_STREAM, seq)
            except NotFoundError:
                continue
            assert not (msg.data or b"").startswith(b'{"stream"'), msg.data
    finally:
        await admin.close()


async def test_a_human_no_is_approval_denied_as_is_error(door: Gateway) -> None:
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    approver_token = add_approver(door.data_dir, f"dave-{uuid.uuid4().hex[:6]}", ["acme"])
    call_id = f"no-{uuid.uuid4().hex[:8]}"
    arguments = {"amount": 9}
    told = asyncio.Event()

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        told.set()

    async with mcp_client(url, token) as c:
        waiting = asyncio.ensure_future(
            c.call_tool(
                "approved_action", arguments, meta=meta(call_id), progress_callback=on_progress
            )
        )
        await asyncio.wait_for(told.wait(), 600)
        async with await ApprovalsClient.connect(
            door.url, token=approver_token, **connect_options(door.stack.creds_of("inbox"))
        ) as approvals:
            await approvals.vote(
                f"acme.researcher.{call_id}",
                "deny",
                arguments_sha256=arguments_sha256(arguments),
                reason="not today",
            )
        result = await asyncio.wait_for(waiting, 600)
    assert result.is_error is True
    assert structured(result)["status"] == "approval_denied"
    assert structured(result)["error"]["code"] == "APPROVAL_DENIED"
    assert call_id not in runs_of(door.data_dir, "approved_action")


def test_agents_token_prints_a_token_once_and_refuses_an_unknown_agent(door: Gateway) -> None:
    asyncio.run(door.agent_creds("acme", "cli-agent"))
    where = ["--data-dir", str(door.data_dir), "--nats-url", door.url]
    done = toolgate("agents", "token", "acme", "cli-agent", *where)
    assert done.returncode == 0, done.stderr
    token = done.stdout.strip()
    assert token.startswith("tgmcp.acme.cli-agent.")
    assert "shown once" in done.stderr and "active now" in done.stderr
    stored = (door.data_dir / "auth" / "agents" / "acme.cli-agent.mcp-token").read_text()
    assert token not in stored
    ghost = toolgate("agents", "token", "acme", "ghost", *where)
    assert ghost.returncode == 2 and "agents add acme ghost" in ghost.stderr


async def test_a_token_whose_grant_the_server_never_got_is_a_clear_protocol_error(
    door: Gateway,
) -> None:
    """Minted offline (the server was not told): the front door's account imports nothing
    of this agent, so the bus refuses the call; the client hears so, nothing runs."""
    from toolgate.services.mcp_front.tokens import mint_token

    await door.agent_creds("acme", "offline")
    token = mint_token(door.data_dir, "acme", "offline")
    async with mcp_client(door.stack.mcp_url or "", token) as c:
        with pytest.raises(MCPError) as refused:
            await c.call_tool("count_runs", {}, meta=meta("offline-1"))
    assert refused.value.code == types.INTERNAL_ERROR
    assert "did not take call offline-1" in refused.value.message
    assert "offline-1" not in runs_of(door.data_dir)


# ---------------------------------------------------------------- retries without a call_id


async def cards_for(approvals: ApprovalsClient, arguments: dict[str, Any]) -> list[str]:
    """The call_ids of the pending approval cards of approved_action with these arguments."""
    return [
        view.call_id
        for view in await approvals.pending()
        if view.call.tool == "approved_action" and view.call.arguments == arguments
    ]


async def one_card(approvals: ApprovalsClient, arguments: dict[str, Any]) -> str:
    for _ in range(600):
        cards = await cards_for(approvals, arguments)
        if cards:
            assert len(cards) == 1, cards
            return cards[0]
        await asyncio.sleep(0.1)
    raise AssertionError(f"no approval card for {arguments}")


async def test_a_client_that_times_out_and_retries_a_call_needing_approval_runs_it_once(
    door: Gateway,
) -> None:
    """The Agents SDK's default: a 5 s session timeout, then the model calls again, with
    no toolgate/call_id. The retry joins the waiting call: one card, one run, one result."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    arguments = {"amount": 1000 + uuid.uuid4().int % 100000}
    async with mcp_client(url, token) as c, approver_of_acme(door) as approvals:
        with pytest.raises(Exception):  # the client's own timeout  # noqa: B017
            await c.call_tool("approved_action", arguments, read_timeout_seconds=2)
        call_id = await one_card(approvals, arguments)
        retry = asyncio.ensure_future(c.call_tool("approved_action", arguments))
        await door_says_joined_or_waits(approvals, arguments, call_id)
        await approvals.vote(
            f"acme.researcher.{call_id}",
            "approve",
            arguments_sha256=arguments_sha256(arguments),
            reason="checked",
        )
        result = await asyncio.wait_for(retry, 600)
    assert result.is_error is False, result
    assert result.meta is not None and result.meta[CALL_ID] == call_id
    assert structured(result) == {"call_id": call_id}
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1
    # Delivered: the same call again later is a new call.
    async with mcp_client(url, token) as c, approver_of_acme(door) as approvals:
        later = asyncio.ensure_future(c.call_tool("approved_action", arguments))
        new_id = await one_card(approvals, arguments)
        assert new_id != call_id
        await approvals.vote(
            f"acme.researcher.{new_id}",
            "deny",
            arguments_sha256=arguments_sha256(arguments),
            reason="once is enough",
        )
        assert (await asyncio.wait_for(later, 600)).is_error is True


async def door_says_joined_or_waits(
    approvals: ApprovalsClient, arguments: dict[str, Any], call_id: str
) -> None:
    """Give the retry time to reach the door; there is still one card, the first's."""
    await asyncio.sleep(2 * WATCH_AFTER_S)
    assert await cards_for(approvals, arguments) == [call_id]


async def test_a_result_the_door_could_not_deliver_goes_to_the_next_identical_call(
    door: Gateway,
) -> None:
    """The client timed out, the approver approved before it came back: its retry (no
    call_id) gets that result instead of a second run."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    arguments = {"amount": 1000 + uuid.uuid4().int % 100000}
    async with mcp_client(url, token) as c, approver_of_acme(door) as approvals:
        with pytest.raises(Exception):  # the client's own timeout  # noqa: B017
            await c.call_tool("approved_action", arguments, read_timeout_seconds=2)
        call_id = await one_card(approvals, arguments)
        await approvals.vote(
            f"acme.researcher.{call_id}",
            "approve",
            arguments_sha256=arguments_sha256(arguments),
            reason="checked",
        )
        for _ in range(600):
            if call_id in runs_of(door.data_dir, "approved_action"):
                break
            await asyncio.sleep(0.1)
        again = await c.call_tool("approved_action", arguments)
    assert again.is_error is False, again
    assert structured(again) == {"call_id": call_id}
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1


# ---------------------------------------------------------------- the MCP Inspector's CLI


@pytest.fixture(scope="module")
def inspector_cli() -> list[str]:
    """The Inspector's CLI, installed from the npm registry on first use (not skipped:
    a machine that cannot install it fails here, saying why)."""
    try:
        return install_inspector()
    except InspectorMissing as exc:
        pytest.fail(str(exc))


def inspector_json(done: Any, exit_code: int = 0) -> Any:
    """What the Inspector's CLI printed: the result (exit 0), or a tool's error result (exit
    5, `tool_is_error`: shown as it came, not refused as invalid)."""
    assert done.returncode == exit_code, (done.returncode, done.stdout[-2000:], done.stderr)
    if exit_code == 5:
        assert json.loads(done.stderr)["error"]["code"] == "tool_is_error", done.stderr
    return json.loads(done.stdout)


def test_the_mcp_inspector_lists_calls_and_shows_errors(
    door: Gateway, inspector_cli: list[str]
) -> None:
    url = door.stack.mcp_url or ""
    token = asyncio.run(agent_token(door, "acme", "researcher"))
    listed = inspector_json(inspector(inspector_cli, url, token, "--method", "tools/list"))
    names = {tool["name"] for tool in listed["tools"]}
    assert {"echo", "search_sources", "save_evidence"} <= names and "writer_only" not in names

    ok = inspector_json(
        inspector(
            inspector_cli,
            url,
            token,
            "--method",
            "tools/call",
            "--tool-name",
            "search_sources",
            "--tool-arg",
            "query=agents sessions",
            "source_type=any",
            "limit=3",
        )
    )
    assert ok.get("isError") is not True, ok
    assert isinstance(ok["structuredContent"], dict)

    # An error result of a tool that lists an outputSchema: shown, not a validation error.
    bad = inspector(
        inspector_cli,
        url,
        token,
        "--method",
        "tools/call",
        "--tool-name",
        "search_sources",
        "--tool-arg",
        "query=agents sessions",
        "source_type=any",
        "limit=50",
    )
    error = inspector_json(bad, exit_code=5)
    assert error["isError"] is True, error
    body = json.loads(error["content"][0]["text"])
    assert body["status"] == "invalid_arguments"
    assert [d["path"] for d in body["error"]["details"]] == ["/limit"]
    assert "structuredContent" not in error

    denied = inspector_json(
        inspector(
            inspector_cli,
            url,
            token,
            "--method",
            "tools/call",
            "--tool-name",
            "save_evidence",
            "--tool-arg",
            "task_id=task_other",
            "claim=c",
            "source_url=https://docs.nats.io/x",
            "--tool-metadata",
            "toolgate/task_id=task_mine",
        ),
        exit_code=5,
    )
    assert denied["isError"] is True, denied
    assert json.loads(denied["content"][0]["text"])["error"]["code"] == "TASK_SCOPE_VIOLATION"


async def test_the_mcp_inspector_waits_for_an_approval_as_a_task(
    door: Gateway, inspector_cli: list[str]
) -> None:
    """The Inspector speaks SEP-2663: it gets a task for a call that waits for a human,
    polls tasks/get, and prints the result once an approver approved."""
    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    amount = 1000 + uuid.uuid4().int % 100000
    arguments = {"amount": amount}
    command = [*inspector_cli, url, "--transport", "http"]
    command += ["--header", f"Authorization: Bearer {token}", "--method", "tools/call"]
    command += ["--tool-name", "approved_action", "--tool-arg", f"amount={amount}"]
    command += ["--protocol-era", "modern"]  # tasks are a 2026-07-28 extension
    process = await asyncio.create_subprocess_exec(
        *command,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "MCP_CATALOG_PATH": str(INSPECTOR_DIR / "catalog.json")},
    )
    async with approver_of_acme(door) as approvals:
        call_id = await one_card(approvals, arguments)
        # Answered with a task, not a request held open.
        await door_says(door, f"call {call_id} waits for a human: task approved_action.{call_id}")
        await approvals.vote(
            f"acme.researcher.{call_id}",
            "approve",
            arguments_sha256=arguments_sha256(arguments),
            reason="checked",
        )
    out, err = await asyncio.wait_for(process.communicate(), 600)
    assert process.returncode == 0, (out.decode()[-2000:], err.decode()[-2000:])
    result = json.loads(out)
    assert result["structuredContent"] == {"call_id": call_id}, result
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1
    log = (door.data_dir / "logs" / "mcp.log").read_text()
    assert "Traceback" not in log[-5000:]


async def test_the_agents_sdk_that_times_out_after_5_s_and_calls_again_runs_the_tool_once(
    door: Gateway,
) -> None:
    """The OpenAI Agents SDK's MCP server with its default 5 s session timeout."""
    from agents.mcp import MCPServerStreamableHttp

    url = door.stack.mcp_url or ""
    token = await agent_token(door, "acme", "researcher")
    arguments = {"amount": 1000 + uuid.uuid4().int % 100000}
    params = {"url": url, "headers": {"Authorization": f"Bearer {token}"}}
    async with MCPServerStreamableHttp(name="toolgate", params=params) as server:  # type: ignore[arg-type]
        assert server.client_session_timeout_seconds == 5
        with pytest.raises(Exception):  # its session timeout  # noqa: B017
            await server.call_tool("approved_action", arguments)
        async with approver_of_acme(door) as approvals:
            call_id = await one_card(approvals, arguments)
            again = asyncio.ensure_future(server.call_tool("approved_action", arguments))
            await door_says_joined_or_waits(approvals, arguments, call_id)
            await approvals.vote(
                f"acme.researcher.{call_id}",
                "approve",
                arguments_sha256=arguments_sha256(arguments),
                reason="checked",
            )
            for _ in range(20):
                try:
                    result = await again
                    break
                except Exception:  # timed out again (a slow machine): the model calls again
                    again = asyncio.ensure_future(server.call_tool("approved_action", arguments))
            else:
                raise AssertionError("no result after 20 calls")
    assert result.is_error is False, result
    assert structured(result) == {"call_id": call_id}
    assert runs_of(door.data_dir, "approved_action").count(call_id) == 1
