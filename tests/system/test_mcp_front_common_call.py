"""The front door's common call path against the SDK's pipeline, over HTTP, on one whole
gateway: two doors on the same bus, one with the common path (as `toolgate up` runs it)
and one that sends every request through the SDK (`common_path=False`), get the same
requests. Their answers are the same bytes (status, headers, body), call_ids aside; the
first answered exactly the common ones itself, and left everything else to the SDK.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import pytest
import uvicorn
import yaml

from tests.harness import Gateway, make_test_registry
from tests.mcp_support import agent_token, mcp_client, wait_for_front_door
from toolgate.runtime.settings import GatewaySettings
from toolgate.services.mcp_front.app import (
    FrontDoor,
    FrontDoorOptions,
    build_app,
    front_door_config,
    public_url,
)
from toolgate.stack.supervisor import free_port

pytestmark = pytest.mark.system

VERSION = "2026-07-28"
CALL_ID = "toolgate/call_id"
# Headers that differ between two servers by nature.
UNCOMPARED = {"date", "server"}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """The test tools, one only `writer` may call, and an echo whose schema routes an
    argument to an `Mcp-Param-Region` header."""
    base = tmp_path_factory.mktemp("mcp-common")
    registry = make_test_registry(base / "registry")
    hidden = yaml.safe_load((registry / "count_runs.yaml").read_text())
    hidden.update(name="writer_only", allowed_agents=["writer"])
    (registry / "writer_only.yaml").write_text(yaml.safe_dump(hidden))
    routed = yaml.safe_load((registry / "echo.yaml").read_text())
    routed.update(name="echo_routed")
    routed["input_schema"]["properties"]["region"] = {"type": "string", "x-mcp-header": "Region"}
    (registry / "echo_routed.yaml").write_text(yaml.safe_dump(routed))
    gateway = Gateway(with_mcp=True, data_dir=base / "data", registry_dir=registry).start()
    asyncio.run(wait_for_front_door(gateway))
    yield gateway
    gateway.stop()


@contextlib.asynccontextmanager
async def door(gateway: Gateway, *, common_path: bool) -> AsyncIterator[tuple[str, FrontDoor]]:
    """A front door in this process on the gateway's bus, as `toolgate serve mcp` runs it."""
    options = FrontDoorOptions(port=free_port(), common_path=common_path)
    settings = GatewaySettings(
        nats_url=gateway.url,
        nats_creds=gateway.stack.creds_of("mcp_front"),
        data_dir=gateway.data_dir,
        registry_dirs=(gateway.registry_dir,),
        builtin_tools=False,
    )
    app = build_app(settings, options, public_url(options))
    server = uvicorn.Server(front_door_config(app, options))
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(600):
            if server.started or serving.done():
                break
            await asyncio.sleep(0.05)
        assert server.started, "the in-process front door did not start"
        yield public_url(options), app.state.front_door
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 30)


def call(
    tool: str,
    arguments: Any = None,
    *,
    call_id: str | None = None,
    request_id: Any = 1,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    envelope: dict[str, Any] = {
        "io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {},
        **(meta or {}),
    }
    if call_id is not None:
        envelope[CALL_ID] = call_id
    params: dict[str, Any] = {"name": tool, "_meta": envelope}
    if arguments is not None:
        params["arguments"] = arguments
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params}


def headers(token: str, tool: str, **changes: str) -> list[tuple[str, str]]:
    found = {
        "authorization": f"Bearer {token}",
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
        "mcp-protocol-version": VERSION,
        "mcp-method": "tools/call",
        "mcp-name": tool,
    }
    found.update({key.replace("_", "-"): value for key, value in changes.items()})
    return list(found.items())


def normalized(answer: httpx2.Response, run: bytes) -> tuple[int, list[Any], bytes]:
    """Status, headers and body, with the call_ids (the client's, one per door, or a
    minted one) made one, and the door's own port (in a 401's metadata URL)."""
    body = re.sub(rb"cc-%s-(\w+)-[cs]" % run, rb"cc-\1", answer.content)
    with contextlib.suppress(ValueError, KeyError, TypeError):
        minted = json.loads(body)["result"]["_meta"][CALL_ID]
        if minted.startswith("call_"):
            body = body.replace(minted.encode(), b"<minted call_id>")
    port = f":{answer.url.port}/"
    kept = [
        (k, v.replace(port, ":<port>/"))
        for k, v in answer.headers.multi_items()
        if k.lower() not in UNCOMPARED
    ]
    return answer.status_code, kept, body


async def test_both_paths_answer_the_same_bytes_and_only_the_common_requests_skip_the_sdk(
    gateway: Gateway,
) -> None:
    token = await agent_token(gateway, "acme", "researcher")
    run = uuid.uuid4().hex[:6].encode()
    # (what, body, headers, whether the common path takes it); `{id:x}`: call_id x, one
    # per door
    requests: list[tuple[str, Any, list[tuple[str, str]], bool]] = [
        (
            "an echo, unicode, no call_id",
            call("echo", {"payload": {"text": "hé ✓ \u2028 </b>", "yes": True, "n": [1, 2.5]}}),
            headers(token, "echo"),
            True,
        ),
        (
            "a call_id of the client's",
            call("echo", {"payload": 1}, call_id="{id:a}"),
            headers(token, "echo"),
            True,
        ),
        (
            "the same call_id again",
            call("echo", {"payload": 1}, call_id="{id:a}"),
            headers(token, "echo"),
            True,
        ),
        (
            "arguments the schema refuses",
            call("search_sources", {"query": "q", "source_type": "any", "limit": 500}),
            headers(token, "search_sources"),
            True,
        ),
        ("an unknown tool", call("no_such_tool", {}), headers(token, "no_such_tool"), True),
        (
            "a tool hidden from this agent",
            call("writer_only", {}),
            headers(token, "writer_only"),
            True,
        ),
        ("a bad call_id", call("echo", {}, call_id="not a call id"), headers(token, "echo"), True),
        (
            "a string request id",
            call("echo", {"payload": 2}, request_id="r-✓"),
            headers(token, "echo"),
            True,
        ),
        (
            "a tool routing an argument to a header, absent",
            call("echo_routed", {"payload": 3}),
            headers(token, "echo_routed"),
            False,
        ),
        (
            "a tool routing an argument to a header, without it",
            call("echo_routed", {"payload": 3, "region": "eu"}),
            headers(token, "echo_routed"),
            False,
        ),
        (
            "a progress token",
            call("echo", {"payload": 4}, meta={"progressToken": "p1"}),
            headers(token, "echo"),
            False,
        ),
        (
            "a log level",
            call("echo", {"payload": 5}, meta={"io.modelcontextprotocol/logLevel": "info"}),
            headers(token, "echo"),
            False,
        ),
        ("another Mcp-Name", call("echo", {}), headers(token, "search_sources"), False),
        (
            "a foreign origin",
            call("echo", {}),
            headers(token, "echo", origin="https://evil.example"),
            False,
        ),
        ("a foreign host", call("echo", {}), headers(token, "echo", host="evil.example"), False),
        ("SSE only", call("echo", {}), headers(token, "echo", accept="text/event-stream"), False),
        ("a text body", call("echo", {}), headers(token, "echo", content_type="text/plain"), False),
        ("not JSON", b"{not json", headers(token, "echo"), False),
        (
            "a notification",
            {"jsonrpc": "2.0", "method": "notifications/x", "params": {}},
            headers(token, "echo"),
            False,
        ),
        (
            "no token",
            call("echo", {}),
            [h for h in headers(token, "echo") if h[0] != "authorization"],
            False,
        ),
    ]
    # The routed tool is checked only once the door has this agent's listing.
    warm_up = call("echo", {"payload": 0})
    async with (
        door(gateway, common_path=True) as (common_url, common_door),
        door(gateway, common_path=False) as (sdk_url, sdk_door),
        httpx2.AsyncClient(timeout=60) as http,
    ):
        for url in (common_url, sdk_url):
            await http.post(url, json=warm_up, headers=headers(token, "echo"))
        taken = common_door.common_served
        for what, body, sent, common in requests:
            answers = []
            for url, side in ((common_url, "c"), (sdk_url, "s")):
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                raw = re.sub(rb"\{id:(\w+)\}", rb"cc-%s-\1-%s" % (run, side.encode()), raw)
                answers.append(await http.post(url, content=raw, headers=sent))
            assert normalized(answers[0], run) == normalized(answers[1], run), what
            assert common_door.common_served == taken + common, what
            taken = common_door.common_served
            if what.startswith("an echo"):  # the common path's own answer, as a client reads it
                result = answers[0].json()["result"]
                assert result["isError"] is False, result
                assert result["structuredContent"] == {
                    "payload": {"text": "hé ✓ \u2028 </b>", "yes": True, "n": [1, 2.5]}
                }
        assert sdk_door.common_served == 0
        # The SDK's own client (the 2026-07-28 era, its default) is answered by the common path.
        async with mcp_client(common_url, token) as client:
            taken = common_door.common_served
            result = await client.call_tool("echo", {"payload": "sdk"})
        assert result.is_error is False and result.structured_content == {"payload": "sdk"}
        assert common_door.common_served == taken + 1
