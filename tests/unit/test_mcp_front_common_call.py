"""The front door's common call path (services/mcp_front/common_call.py) held to the SDK
itself: the SDK's JSON-response session manager, in memory, with the door's own server
(its tools/call handler replaced by one that answers what a test gives it) is the oracle.

- every answer the door's handler can give (results of each shape, a task, "still
  pending", protocol errors) is written by the common path byte for byte as the SDK
  writes it;
- a request the common path takes is one the SDK would hand to the handler, with the
  same name, arguments, `_meta` and capabilities; anything it cannot vouch for (what the
  SDK refuses, and what it merely treats otherwise) is left to the SDK.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import mcp_types as types
import pytest
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from mcp.shared.exceptions import MCPError
from mcp_types.jsonrpc import INTERNAL_ERROR, INVALID_PARAMS
from opentelemetry.sdk.trace import TracerProvider

from toolgate.contracts.calls import (
    ErrorDetail,
    Provenance,
    ToolError,
    ToolResult,
    failure,
    success,
)
from toolgate.contracts.registry import Registry, ToolSpec
from toolgate.services.mcp_front import app, common_call, logic
from toolgate.services.mcp_front.app import FrontDoor, FrontDoorOptions, security_settings

VERSION = "2026-07-28"
URL = "/mcp"
UPSTREAM = {
    "name": "up_plain",
    "description": "Answers in plain text.",
    "input_schema": {"type": "object"},
    "output_schema": {
        "type": "object",
        "properties": {"content": {"type": "array", "items": {"type": "object"}}},
        "required": ["content"],
        "additionalProperties": False,
    },
    "mcp": {"url": "http://u/mcp", "tool": "plain", "definition_sha256": "0" * 64},
    "read_only": True,
    "timeout_s": 10,
    "risk": "low",
    "allowed_agents": ["*"],
}
BLOCKS = [
    {"type": "text", "text": "it is 12:00"},
    {"type": "image", "data": "aGk=", "mimeType": "image/png"},
    {"type": "resource_link", "uri": "file:///x", "name": "x"},
]

Handler = Callable[[Any, types.CallToolRequestParams], Awaitable[Any]]


class Oracle:
    """The SDK's own answer to one HTTP request: the door's server behind the SDK's
    JSON-response session manager, the tools/call handler answering `handler`."""

    def __init__(self) -> None:
        self.door = FrontDoor(Registry({}), FrontDoorOptions())
        self.server = app.build_server(self.door)
        self.security = security_settings(FrontDoorOptions())
        self.seen: list[tuple[Any, types.CallToolRequestParams]] = []

    async def answer(
        self, handler: Handler, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> tuple[int, bytes]:
        async def recording(ctx: Any, params: types.CallToolRequestParams) -> Any:
            self.seen.append((ctx, params))
            return await handler(ctx, params)

        self.server.add_request_handler("tools/call", types.CallToolRequestParams, recording)
        manager = StreamableHTTPSessionManager(
            app=self.server, json_response=True, security_settings=self.security
        )
        sent: list[dict[str, Any]] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async with manager.run():
            await manager.handle_request(scope(headers), receive, send)
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, b"".join(
            m.get("body", b"") for m in sent if m["type"] == "http.response.body"
        )


def scope(headers: list[tuple[bytes, bytes]], method: str = "POST") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": URL,
        "raw_path": URL.encode(),
        "query_string": b"",
        "headers": headers,
        "server": ("127.0.0.1", 8000),
        "client": ("127.0.0.1", 50000),
        "scheme": "http",
        "http_version": "1.1",
    }


def request(
    name: str = "echo",
    arguments: Any = None,
    *,
    request_id: Any = 7,
    meta: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A 2026-07-28 tools/call as the SDK's client writes it."""
    envelope = {
        "io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientInfo": {"name": "test", "version": "1"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    params: dict[str, Any] = {"name": name, "_meta": {**envelope, **(meta or {})}}
    if arguments is not None:
        params["arguments"] = arguments
    return {"jsonrpc": "2.0", "id": request_id, "method": "tools/call", "params": params, **extra}


def headers_for(name: str = "echo", **changes: str | None) -> list[tuple[bytes, bytes]]:
    """The headers the SDK's client sends (changes: a header replaced, or None: dropped)."""
    found = {
        "host": "127.0.0.1:8000",
        "accept": "application/json, text/event-stream",
        "content-type": "application/json",
        "mcp-protocol-version": VERSION,
        "mcp-method": "tools/call",
        "mcp-name": name,
        "authorization": "Bearer t",
    }
    for key, value in changes.items():
        key = key.replace("_", "-")
        if value is None:
            found.pop(key, None)
        else:
            found[key] = value
    return [(k.encode(), v.encode("latin-1")) for k, v in found.items()]


def encoded(body: Any) -> bytes:
    return json.dumps(body).encode() if not isinstance(body, bytes) else body


# ---------------------------------------------------------------- answers


def results() -> list[tuple[str, ToolResult, ToolSpec | None]]:
    upstream = ToolSpec.model_validate(UPSTREAM)
    error = ToolError(
        "SCHEMA_VALIDATION_FAILED",
        "bad <args> ✓",
        retryable=False,
        details=[ErrorDetail("/limit", 'too "large"\n')],
    )
    return [
        (
            "ok, an object with nulls, unicode, big and small numbers",
            success(
                "c1",
                {
                    "payload": "hé ✓ \u2028 \x00 \ud83d\ude00 </script>",
                    "none": None,
                    "list": [1, 2.5, None, True, {"x": None}, [], {}],
                    "big": 2**70,
                    "neg": -(2**63),
                    "tiny": 5e-324,
                    "huge": 1.7976931348623157e308,
                },
            ),
            None,
        ),
        ("ok, an empty object", success("c2", {}), None),
        ("ok, a list", success("c3", [1, {"a": None}, "b"]), None),
        ("ok, a string", success("c4", "just text"), None),
        ("ok, null", success("c5", None), None),
        ("ok, a number", success("c6", 3.25), None),
        ("an error with details", failure("c7", "invalid_arguments", error), None),
        ("denied", failure("c8", "denied", ToolError("TASK_SCOPE_VIOLATION", "no")), None),
        (
            "an HTTP tool's result, with provenance",
            ToolResult(
                call_id="c9",
                ok=True,
                status="ok",
                data={"rows": [1, 2]},
                provenance=Provenance("http", "https://api.example", "GET /rows"),
            ),
            None,
        ),
        (
            "an upstream's content blocks",
            ToolResult(
                call_id="c10",
                ok=True,
                status="ok",
                data={"content": BLOCKS},
                provenance=Provenance("mcp", "http://127.0.0.1:1/mcp", "lookup"),
            ),
            upstream,
        ),
        (
            "an upstream's result that is no content",
            success("c11", {"content": [{"type": "x"}]}),
            upstream,
        ),
        ("an upstream's error", failure("c12", "execution_error", ToolError("X", "y")), upstream),
        # None reach the door (results come decoded from JSON), but the path still writes
        # them as the SDK's dumps do.
        ("numbers JSON cannot say", success("c13", {"x": float("inf"), "y": [float("nan")]}), None),
    ]


@pytest.mark.parametrize("request_id", [7, "req-ü ✓", 2**62])
@pytest.mark.parametrize(
    ("label", "result", "spec"), results(), ids=lambda v: v if isinstance(v, str) else ""
)
async def test_a_result_is_written_as_the_sdk_writes_it(
    label: str, result: ToolResult, spec: ToolSpec | None, request_id: Any
) -> None:
    oracle = Oracle()

    async def handler(ctx: Any, params: Any) -> Any:
        return logic.call_result(result, spec)

    status, expected = await oracle.answer(
        handler, headers_for(), encoded(request(request_id=request_id))
    )
    assert status == 200
    ours = common_call.answer_bytes(
        request_id, logic.call_answer(result, spec), oracle.server.server_info_stamp
    )
    assert ours == expected, label


@pytest.mark.parametrize(
    ("label", "answer"),
    [
        ("still pending", logic.still_waiting("c20", 900.0)),
        (
            "a task",
            logic.created_task(
                "echo.c21",
                "working",
                created_at="2026-01-01T00:00:00Z",
                updated_at="2026-01-01T00:00:01Z",
                ttl_s=600,
                message="waiting for a human approval: ✓",
            ),
        ),
    ],
)
async def test_a_model_or_a_task_is_written_as_the_sdk_writes_it(label: str, answer: Any) -> None:
    oracle = Oracle()

    async def handler(ctx: Any, params: Any) -> Any:
        return answer

    status, expected = await oracle.answer(handler, headers_for(), encoded(request()))
    assert status == 200
    assert common_call.answer_bytes(7, answer, oracle.server.server_info_stamp) == expected, label


@pytest.mark.parametrize(
    "exc",
    [
        MCPError(INVALID_PARAMS, "Unknown tool: nope ✓"),
        MCPError(INTERNAL_ERROR, "the gateway's bus did not take call c1 (TimeoutError)"),
        RuntimeError("a bug's detail that must not reach the client"),
    ],
    ids=["invalid params", "internal error", "a bug"],
)
async def test_a_protocol_error_is_written_as_the_sdk_writes_it(exc: Exception) -> None:
    oracle = Oracle()

    async def handler(ctx: Any, params: Any) -> Any:
        raise exc

    expected = await oracle.answer(handler, headers_for(), encoded(request(request_id="r1")))
    assert common_call.error_body("r1", exc) == expected
    assert b"must not reach" not in expected[1]


# ---------------------------------------------------------------- which requests


def common_variants() -> list[tuple[str, list[tuple[bytes, bytes]], Any]]:
    """Requests the common path takes."""
    return [
        ("the SDK client's call", headers_for(), request("echo", {"payload": 3})),
        ("no arguments", headers_for(), request("echo")),
        (
            "null arguments",
            headers_for(),
            request() | {"params": request()["params"] | {"arguments": None}},
        ),
        ("a string id", headers_for(), request(request_id="abc")),
        (
            "our own _meta and a trace",
            headers_for(),
            request(
                meta={
                    "toolgate/call_id": "c-1",
                    "toolgate/user": "u",
                    "traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01",
                }
            ),
        ),
        (
            "a bad call_id of ours (ours to refuse)",
            headers_for(),
            request(meta={"toolgate/call_id": "a b"}),
        ),
        (
            "no client info",
            headers_for(),
            request()
            | {
                "params": {
                    "name": "echo",
                    "_meta": {
                        "io.modelcontextprotocol/protocolVersion": VERSION,
                        "io.modelcontextprotocol/clientCapabilities": {},
                    },
                }
            },
        ),
        (
            "capabilities with extensions",
            headers_for(),
            request(
                meta={
                    "io.modelcontextprotocol/clientCapabilities": {
                        "extensions": {logic.TASKS_EXTENSION: {}},
                        "sampling": {},
                    }
                }
            ),
        ),
        ("JSON only accepted", headers_for(accept="application/json"), request()),
        ("any type accepted", headers_for(accept="*/*"), request()),
        (
            "a charset on the type",
            headers_for(content_type="application/json; charset=utf-8"),
            request(),
        ),
        ("a loopback origin", headers_for(origin="http://localhost:5173"), request()),
        ("a name in base64", headers_for("é", mcp_name="=?base64?w6k=?="), request("é")),
    ]


def sdk_variants() -> list[tuple[str, list[tuple[bytes, bytes]], Any]]:
    """Requests left to the SDK: what it refuses, and what it treats otherwise."""
    base = request()
    params = base["params"]
    return [
        ("a progress token", headers_for(), request(meta={"progressToken": 1})),
        ("a log level", headers_for(), request(meta={"io.modelcontextprotocol/logLevel": "debug"})),
        ("another _meta key", headers_for(), request(meta={"io.example/x": 1})),
        ("another params key", headers_for(), base | {"params": params | {"requestState": "s"}}),
        ("a task param", headers_for(), base | {"params": params | {"task": {"ttl": 1}}}),
        ("another envelope key", headers_for(), base | {"extra": 1}),
        ("a float id", headers_for(), request(request_id=1.0)),
        ("a bool id", headers_for(), request(request_id=True)),
        ("a null id", headers_for(), request(request_id=None)),
        ("no id: a notification", headers_for(), {k: v for k, v in base.items() if k != "id"}),
        ("JSON-RPC 1.0", headers_for(), base | {"jsonrpc": "1.0"}),
        ("another method", headers_for(mcp_method="tools/list"), base | {"method": "tools/list"}),
        ("arguments a list", headers_for(), request("echo", [1])),
        ("a name not a string", headers_for(mcp_name="1"), request(1)),
        ("params a list", headers_for(), base | {"params": [1]}),
        ("a batch", headers_for(), [base]),
        ("not JSON", headers_for(), b"{not json"),
        (
            "an unsupported version",
            headers_for(mcp_protocol_version="2099-01-01"),
            request(meta={"io.modelcontextprotocol/protocolVersion": "2099-01-01"}),
        ),
        (
            "the header's version not the body's",
            headers_for(mcp_protocol_version="2099-01-01"),
            request(),
        ),
        ("no Mcp-Method", headers_for(mcp_method=None), request()),
        ("another Mcp-Name", headers_for(mcp_name="search_sources"), request()),
        ("no Mcp-Name", headers_for(mcp_name=None), request()),
        ("an Mcp-Param header", headers_for() + [(b"mcp-param-region", b"eu")], request()),
        ("Mcp-Name twice", headers_for() + [(b"mcp-name", b"echo")], request()),
        (
            "no capabilities",
            headers_for(),
            base
            | {
                "params": {
                    "name": "echo",
                    "_meta": {"io.modelcontextprotocol/protocolVersion": VERSION},
                }
            },
        ),
        (
            "capabilities not an object",
            headers_for(),
            request(meta={"io.modelcontextprotocol/clientCapabilities": [1]}),
        ),
        (
            "client info without a version",
            headers_for(),
            request(meta={"io.modelcontextprotocol/clientInfo": {"name": "x"}}),
        ),
        (
            "client info of the wrong type",
            headers_for(),
            request(meta={"io.modelcontextprotocol/clientInfo": {"name": 1, "version": "1"}}),
        ),
        (
            "extensions not an object",
            headers_for(),
            request(meta={"io.modelcontextprotocol/clientCapabilities": {"extensions": [1]}}),
        ),
        ("_meta not an object", headers_for(), base | {"params": params | {"_meta": 1}}),
        ("SSE only accepted", headers_for(accept="text/event-stream"), request()),
        ("no Accept", headers_for(accept=None), request()),
        ("a text body", headers_for(content_type="text/plain"), request()),
        ("no Content-Type", headers_for(content_type=None), request()),
        ("a foreign origin", headers_for(origin="https://evil.example"), request()),
        ("a foreign host", headers_for(host="evil.example"), request()),
        ("a host without a port", headers_for(host="127.0.0.1"), request()),
        ("no host", headers_for(host=None), request()),
    ]


async def sdk_handler_saw(
    headers: list[tuple[bytes, bytes]], body: bytes
) -> tuple[Any, types.CallToolRequestParams] | None:
    oracle = Oracle()

    async def handler(ctx: Any, params: Any) -> Any:
        return types.CallToolResult(content=[])

    await oracle.answer(handler, headers, body)
    return oracle.seen[0] if oracle.seen else None


def recognize(headers: list[tuple[bytes, bytes]], body: bytes) -> common_call.CommonCall | None:
    security = security_settings(FrontDoorOptions())
    calls = common_call.CommonCalls(security.allowed_hosts, security.allowed_origins)
    return calls.recognize(scope(headers), body)


@pytest.mark.parametrize(
    ("label", "headers", "body"), common_variants(), ids=lambda v: v if isinstance(v, str) else ""
)
async def test_a_common_request_is_taken_as_the_sdk_would_give_it_to_the_handler(
    label: str, headers: list[tuple[bytes, bytes]], body: Any
) -> None:
    call = recognize(headers, encoded(body))
    assert call is not None, label
    seen = await sdk_handler_saw(headers, encoded(body))
    assert seen is not None, label
    ctx, params = seen
    assert call.request_id == ctx.request_id
    assert call.name == params.name
    assert call.arguments == dict(params.arguments or {})
    assert call.meta == dict(params.meta or {})
    capabilities = ctx.session.client_capabilities
    assert logic.wants_tasks(VERSION, call.client_capabilities) == logic.wants_tasks(
        ctx.protocol_version, capabilities
    )


@pytest.mark.parametrize(
    ("label", "headers", "body"), sdk_variants(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_anything_else_is_left_to_the_sdk(
    label: str, headers: list[tuple[bytes, bytes]], body: Any
) -> None:
    assert recognize(headers, encoded(body)) is None, label


def test_only_a_post_is_taken() -> None:
    security = security_settings(FrontDoorOptions())
    calls = common_call.CommonCalls(security.allowed_hosts, security.allowed_origins)
    body = encoded(request())
    assert calls.recognize(scope(headers_for()), body) is not None
    assert calls.recognize(scope(headers_for(), method="GET"), body) is None


def test_a_door_bound_elsewhere_takes_its_own_host_and_allowed_origins() -> None:
    options = FrontDoorOptions(host="10.0.0.5", allowed_origins=("https://app.example",))
    security = security_settings(options)
    calls = common_call.CommonCalls(security.allowed_hosts, security.allowed_origins)
    body = encoded(request())
    assert calls.recognize(scope(headers_for(host="10.0.0.5:8000")), body) is not None
    assert calls.recognize(scope(headers_for(origin="https://app.example")), body) is not None
    assert calls.recognize(scope(headers_for(host="10.0.0.6:8000")), body) is None


def door_path() -> app.CommonCallPath:
    door = FrontDoor(Registry({}), FrontDoorOptions())
    security = security_settings(FrontDoorOptions())
    calls = common_call.CommonCalls(security.allowed_hosts, security.allowed_origins)
    return app.CommonCallPath(door, calls, {"name": "toolgate", "version": "1"})


def authenticated(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken

    found = scope(headers)
    found["user"] = AuthenticatedUser(
        AccessToken(token="t", client_id="acme.researcher", scopes=[], subject="acme.researcher")
    )
    return found


def test_the_door_leaves_a_request_to_the_sdk_while_spans_are_recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = door_path()
    body = encoded(request())
    assert path.recognize(authenticated(headers_for()), body) is not None
    monkeypatch.setattr(app, "get_tracer_provider", TracerProvider)  # one is set: spans
    assert path.recognize(authenticated(headers_for()), body) is None


def test_the_door_leaves_a_tool_with_mcp_param_headers_and_the_unauthenticated_to_the_sdk() -> None:
    path = door_path()
    body = encoded(request("routed"))
    assert path.recognize(authenticated(headers_for("routed")), body) is not None
    path.door.header_tools[("acme", "researcher")] = frozenset({"routed"})
    assert path.recognize(authenticated(headers_for("routed")), body) is None
    assert path.recognize(scope(headers_for()), encoded(request())) is None


# ---------------------------------------------------------------- the credential, per request


async def test_an_operators_token_is_one_access_token_while_it_stays_valid(tmp_path: Any) -> None:
    """Built once (a model per request was a cost of its own); the store still decides,
    on every request, whether the token is valid now: revoked, it is refused at once."""
    from toolgate.services.mcp_front.tokens import TokenStore, mint_token

    record = tmp_path / "auth" / "agents" / "acme.researcher.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"tenant": "acme", "agent": "researcher", "user": "U1"}))
    token = mint_token(tmp_path, "acme", "researcher")
    tokens = app.AgentTokens(TokenStore(tmp_path))
    first = await tokens.verify_token(token)
    assert first is not None and first.client_id == "acme.researcher"
    assert await tokens.verify_token(token) is first
    assert await tokens.verify_token(token + "x") is None
    record.write_text(
        json.dumps({"tenant": "acme", "agent": "researcher", "user": "U1", "revoked_at": "now"})
    )
    assert await tokens.verify_token(token) is None


def test_a_trace_context_is_extracted_only_from_a_meta_that_can_carry_one() -> None:
    from opentelemetry.propagate import get_global_textmap

    fields = get_global_textmap().fields
    assert logic.may_carry_trace({"traceparent": "00-1-2-01"}, fields)
    assert logic.may_carry_trace({"baggage": "k=v"}, fields)
    assert not logic.may_carry_trace({"toolgate/call_id": "c1"}, fields)
    assert not logic.may_carry_trace({}, fields)
