"""The common request of the MCP front door, recognized and answered without the SDK's
request pipeline; no I/O.

Most of what reaches the door is one shape: a 2026-07-28 `tools/call` POST, answered in
one JSON body (no progress token), whose tool declares no `x-mcp-header`. For it the
SDK's pipeline (its request, envelope and params models, a connection and session per
request, the result validated twice and dumped three times) costs about a third of the
door's CPU per call. `recognize` takes a request only when every check the SDK makes
before the handler would pass (`handle_modern_request`: method, Content-Type, Host,
Origin, Accept, the JSON-RPC envelope, the routing headers and the `_meta` envelope,
the params' models) and hands it back in the handler's terms; anything else, malformed
or merely unusual, is None and goes to the SDK, which answers (and refuses) as ever.
`answer_body` and `error_body` write what the SDK would write for the handler's
result or exception, byte for byte (tests/unit/test_mcp_front_common_call.py holds
them to the SDK's own serializer; tests/integration/test_mcp_front_common_call.py to
the SDK's whole answer).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import mcp_types as types
from mcp.server.runner import modern_error_data
from mcp.shared.inbound import (
    ERROR_CODE_HTTP_STATUS,
    MCP_METHOD_HEADER,
    MCP_NAME_HEADER,
    MCP_PARAM_HEADER_PREFIX,
    MCP_PROTOCOL_VERSION_HEADER,
    decode_header_value,
)
from mcp_types import (
    CLIENT_CAPABILITIES_META_KEY,
    CLIENT_INFO_META_KEY,
    CORE_RESULT_TYPES,
    PROTOCOL_VERSION_META_KEY,
    SERVER_INFO_META_KEY,
)
from mcp_types import methods as sdk_methods
from mcp_types.jsonrpc import JSONRPCError
from pydantic import ValidationError

from toolgate.services.mcp_front import logic

# The one protocol version this path speaks (its answers are written for its wire).
VERSION: Final = "2026-07-28"
METHOD: Final = "tools/call"
CONTENT_TYPE_JSON: Final = "application/json"
_PARAM_PREFIX: Final = MCP_PARAM_HEADER_PREFIX.lower().encode("latin-1")
_ROUTING: Final = frozenset(
    name.encode("latin-1")
    for name in (MCP_PROTOCOL_VERSION_HEADER, MCP_METHOD_HEADER, MCP_NAME_HEADER)
)
# The request headers the checks read (the first of each, as Starlette's Headers.get).
_READ: Final = frozenset(
    {b"content-type", b"host", b"origin", b"accept", *_ROUTING},
)
_ENVELOPE_KEYS: Final = frozenset({"jsonrpc", "id", "method", "params"})
_PARAM_KEYS: Final = frozenset({"name", "arguments", "_meta"})
# `_meta` keys this path takes: the envelope, ours (`toolgate/...`) and a trace context.
# Any other (a log level, a progress token, a key some model of the SDK's types) goes to
# the SDK.
_ENVELOPE_META: Final = frozenset(
    {PROTOCOL_VERSION_META_KEY, CLIENT_CAPABILITIES_META_KEY, CLIENT_INFO_META_KEY}
)
_TRACE_META: Final = frozenset({"traceparent", "tracestate", "baggage"})
OURS_META_PREFIX: Final = "toolgate/"
# Envelopes (client info and capabilities) already checked with the SDK's models.
ENVELOPES_MAX: Final = 1024


@dataclass(frozen=True)
class CommonCall:
    """A tools/call as the door's handler takes it, from a request the SDK would serve."""

    request_id: int | str
    name: str
    arguments: dict[str, Any]
    meta: dict[str, Any]
    client_capabilities: dict[str, Any]


def _takes_meta_key(key: str) -> bool:
    return key in _ENVELOPE_META or key in _TRACE_META or key.startswith(OURS_META_PREFIX)


def _matches(value: str, allowed: Iterable[str]) -> bool:
    """The SDK's Host/Origin rule: an exact entry, or `base:*` for any port of base."""
    for entry in allowed:
        if value == entry or (entry.endswith(":*") and value.startswith(entry[:-1])):
            return True
    return False


def accepts_json(accept: str) -> bool:
    """Whether an Accept header takes `application/json` (the SDK's reading, wildcards too)."""
    types_ = [part.strip().split(";")[0].strip().lower() for part in accept.split(",")]
    return any(t in ("*/*", "application/*", CONTENT_TYPE_JSON) for t in types_)


class CommonCalls:
    """Recognizes the common request (`recognize`): what the SDK's transport security
    allows (`allowed_hosts`, `allowed_origins`: the door's TransportSecuritySettings,
    DNS rebinding protection on) and an envelope memory of what the SDK's models took."""

    def __init__(self, allowed_hosts: list[str], allowed_origins: list[str]) -> None:
        self.allowed_hosts = list(allowed_hosts)
        self.allowed_origins = list(allowed_origins)
        self._envelopes: dict[str, bool] = {}

    def recognize(self, scope: Mapping[str, Any], body: bytes) -> CommonCall | None:
        """The request as a CommonCall, or None: the SDK serves it."""
        if scope.get("method") != "POST":
            return None
        headers = self._headers(scope["headers"])
        if headers is None or not self._allowed(headers):
            return None
        try:
            decoded = json.loads(body)
        except (ValueError, RecursionError):
            return None
        if not isinstance(decoded, dict) or decoded.keys() - _ENVELOPE_KEYS:
            return None
        request_id = decoded.get("id")
        # The SDK's RequestId: a strict int (never a bool) or a string.
        if type(request_id) is not int and type(request_id) is not str:
            return None
        params = decoded.get("params")
        if (
            decoded.get("jsonrpc") != "2.0"
            or decoded.get("method") != METHOD
            or not isinstance(params, dict)
            or params.keys() - _PARAM_KEYS
        ):
            return None
        name, arguments, meta = params.get("name"), params.get("arguments"), params.get("_meta")
        if (
            type(name) is not str
            or not (arguments is None or type(arguments) is dict)
            or type(meta) is not dict
            or meta.get(PROTOCOL_VERSION_META_KEY) != VERSION
            or CLIENT_CAPABILITIES_META_KEY not in meta
            or not all(_takes_meta_key(key) for key in meta)
            or headers.get(MCP_PROTOCOL_VERSION_HEADER) != VERSION
            or headers.get(MCP_METHOD_HEADER) != METHOD
            or decode_header_value(headers.get(MCP_NAME_HEADER)) != name
        ):
            return None
        capabilities = meta[CLIENT_CAPABILITIES_META_KEY]
        if type(capabilities) is not dict or not self._envelope_valid(
            capabilities, meta.get(CLIENT_INFO_META_KEY)
        ):
            return None
        return CommonCall(request_id, name, arguments or {}, meta, capabilities)

    def _headers(self, raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str] | None:
        """The first value of each header the checks read; None if a routing header
        comes twice or an `Mcp-Param-*` header comes at all (the SDK checks those)."""
        found: dict[str, str] = {}
        for name, value in raw:
            if name in _READ:
                key = name.decode("latin-1")
                if key in found:
                    if name in _ROUTING:
                        return None
                    continue
                found[key] = value.decode("latin-1")
            elif name.startswith(_PARAM_PREFIX):
                return None
        return found

    def _allowed(self, headers: dict[str, str]) -> bool:
        """Content-Type, Host, Origin and Accept as the SDK's modern entry checks them."""
        content_type = headers.get("content-type")
        host = headers.get("host")
        origin = headers.get("origin")
        return (
            content_type is not None
            and content_type.lower().startswith(CONTENT_TYPE_JSON)
            and bool(host)
            and _matches(host or "", self.allowed_hosts)
            and (not origin or _matches(origin, self.allowed_origins))
            and accepts_json(headers.get("accept", ""))
        )

    def _envelope_valid(self, capabilities: dict[str, Any], client_info: Any) -> bool:
        """Whether the SDK's models take this client info and these capabilities (asked
        once per distinct envelope: a client sends the same one with every request)."""
        key = json.dumps([capabilities, client_info], sort_keys=True)
        known = self._envelopes.get(key)
        if known is None:
            known = self._envelopes[key] = sdk_takes_envelope(capabilities, client_info)
            if len(self._envelopes) > ENVELOPES_MAX:
                self._envelopes.clear()
        return known


def sdk_takes_envelope(capabilities: dict[str, Any], client_info: Any) -> bool:
    """Whether a tools/call with this envelope passes the SDK's params models: the
    2026-07-28 surface (its `_meta` object: capabilities, client info) and the typed
    params the handler is given."""
    meta: dict[str, Any] = {
        PROTOCOL_VERSION_META_KEY: VERSION,
        CLIENT_CAPABILITIES_META_KEY: capabilities,
    }
    if client_info is not None:
        meta[CLIENT_INFO_META_KEY] = client_info
    params = {"name": "t", "arguments": {}, "_meta": meta}
    try:
        sdk_methods.validate_client_request(METHOD, VERSION, params)
        types.CallToolRequestParams.model_validate(params, by_name=False)
    except (ValidationError, ValueError, KeyError):
        return False
    return True


def wire_result(result: dict[str, Any], server_info: dict[str, Any]) -> dict[str, Any]:
    """A handler's result in the SDK's wire form for this version, stamped with the
    server's identity (`ServerRunner._serialize`): a core result is already shaped
    (logic.call_answer); a task (`resultType: "task"`) is the extension's, as it is."""
    shaped = dict(result)
    if shaped.get("resultType") is None:
        shaped["resultType"] = "complete"
    meta = shaped.get("_meta")
    if meta is None:
        shaped["_meta"] = {SERVER_INFO_META_KEY: server_info}
    elif isinstance(meta, dict) and meta.get(SERVER_INFO_META_KEY) is None:
        shaped["_meta"] = {**meta, SERVER_INFO_META_KEY: server_info}
    return shaped


def answer_bytes(
    request_id: int | str,
    result: types.CallToolResult | dict[str, Any],
    server_info: dict[str, Any],
) -> bytes:
    """The whole JSON-RPC answer to a handler's result: its wire form (logic.call_answer;
    a model, "still pending" say, shaped by the SDK's serializer), stamped."""
    if isinstance(result, types.CallToolResult):
        result = logic.wire_form(result)
    body = answer_body(request_id, wire_result(result, server_info))
    if body is None:
        body = sdk_answer_body(request_id, result, server_info)
    return body


def answer_body(request_id: int | str, result: dict[str, Any]) -> bytes | None:
    """The JSON-RPC answer as the SDK writes it (`_write`); None when the result holds a
    number JSON cannot say (the SDK's own dump writes those: `sdk_answer_body`)."""
    body = {"jsonrpc": "2.0", "id": request_id, "result": result}
    try:
        return json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        return None


def sdk_answer_body(
    request_id: int | str, result: dict[str, Any], server_info: dict[str, Any]
) -> bytes:
    """The answer as the SDK's own dumps write it: a core result validated and dumped
    again, stamped, and the whole response dumped once more (`answer_body` can't)."""
    result_type = result.get("resultType")
    if not isinstance(result_type, str) or result_type in CORE_RESULT_TYPES:
        result = sdk_methods.serialize_server_result(METHOD, VERSION, result)
    shaped = wire_result(result, server_info)
    response = types.JSONRPCResponse(jsonrpc="2.0", id=request_id, result=shaped)
    dumped = response.model_dump(mode="json", by_alias=True, exclude_none=True)
    return json.dumps(dumped, separators=(",", ":")).encode()


def error_body(request_id: int | str, exc: Exception) -> tuple[int, bytes]:
    """(HTTP status, body) of the handler's exception, as the SDK answers it."""
    error = JSONRPCError(jsonrpc="2.0", id=request_id, error=modern_error_data(exc))
    status = ERROR_CODE_HTTP_STATUS.get(error.error.code, 200)
    dumped = error.model_dump(mode="json", by_alias=True, exclude_none=True)
    return status, json.dumps(dumped, separators=(",", ":")).encode()
