"""What the MCP front door shows and answers, without I/O: the tool listing from the
registry, the call_id of a tools/call, and a ToolResult as an MCP CallToolResult."""

from __future__ import annotations

import json
from typing import Any, Final

import mcp_types as types
import msgspec
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS

from toolgate.contracts.calls import ToolResult, is_valid_call_id
from toolgate.contracts.registry import Registry, ToolSpec

# A client names its own call_id in the request's `_meta` to make a retry safe:
# the same call_id returns the recorded result instead of running the tool again.
CALL_ID_META_KEY: Final = "toolgate/call_id"
# On every answer: the call_id the call ran under, and its toolgate status.
STATUS_META_KEY: Final = "toolgate/status"
# On the answer of an upstream (MCP) tool: where its content came from (untrusted).
PROVENANCE_META_KEY: Final = "toolgate/provenance"
# A platform may state the end user and session of a call (else the agent's own names).
USER_META_KEY: Final = "toolgate/user"
SESSION_META_KEY: Final = "toolgate/session"
TASK_META_KEY: Final = "toolgate/task_id"


def traceparent_of_span(span_context: Any) -> str | None:
    """The W3C `traceparent` of an OpenTelemetry span context, if it is a valid one.

    Inside a tools/call handler the current span is the SDK's server span, child
    of the trace context the client sent in `_meta` (an instrumented SDK client
    sends it on its own). Without a tracer set up it is that remote context
    itself, so the client's trace still reaches the call."""
    if span_context is None or not span_context.is_valid:
        return None
    flags = int(span_context.trace_flags) & 0xFF
    return f"00-{span_context.trace_id:032x}-{span_context.span_id:016x}-{flags:02x}"


class BadMeta(ValueError):
    """A `_meta` value the front door cannot use: an invalid-params protocol error."""


def annotations_of(spec: ToolSpec) -> types.ToolAnnotations:
    """MCP's hints, from the registry: what the tool does, never what it claims."""
    return types.ToolAnnotations(
        read_only_hint=spec.read_only,
        # MCP's default assumption for a tool that writes: it may destroy.
        destructive_hint=not spec.read_only,
        idempotent_hint=spec.idempotent or spec.read_only,
        open_world_hint=spec.mcp is not None
        or spec.http is not None
        or spec.action_class in ("send", "publish"),
    )


def tool_of(spec: ToolSpec) -> types.Tool:
    # MCP wants an object schema for outputSchema; a tool that returns anything else
    # lists none (its result still comes as text and is checked by the attacher).
    output = spec.output_schema if spec.output_schema.get("type") == "object" else None
    return types.Tool(
        name=spec.name,
        description=spec.description,
        input_schema=spec.input_schema,
        output_schema=output,
        annotations=annotations_of(spec),
    )


def listing_for(registry: Registry, agent: str) -> list[types.Tool]:
    """Exactly the tools this agent may call (`Registry.visible_to`)."""
    return [tool_of(spec) for spec in registry.visible_to(agent)]


def requested_call_id(meta: dict[str, Any] | None) -> str | None:
    """The call_id the client named in `_meta`, or None; BadMeta if it is not a valid one."""
    if not meta or CALL_ID_META_KEY not in meta:
        return None
    value = meta[CALL_ID_META_KEY]
    if not is_valid_call_id(value):
        raise BadMeta(
            f"_meta {CALL_ID_META_KEY} must be a string of letters, digits, '-' and '_' "
            "(1 to 128 characters)"
        )
    return str(value)


def meta_text(meta: dict[str, Any] | None, key: str, default: str | None) -> str | None:
    if not meta or key not in meta:
        return default
    value = meta[key]
    if not isinstance(value, str) or not value or len(value) > 256:
        raise BadMeta(f"_meta {key} must be a non-empty string of at most 256 characters")
    return value


def handshake_era(protocol_version: str | None) -> bool:
    """Whether a request with this `MCP-Protocol-Version` header belongs to the
    handshake era (sessions, `initialize`): the SDK's own rule, so both agree."""
    return protocol_version is None or protocol_version in HANDSHAKE_PROTOCOL_VERSIONS


# In a request's body, the sign that its client wants to hear while it waits.
_PROGRESS_TOKEN: Final = b"progressToken"


def wants_stream(body: bytes) -> bool:
    """Whether a 2026-07-28 request goes to the streaming session manager: it carries a
    progress token. Searched as bytes, not parsed: `progressToken` anywhere (in the
    arguments, say) picks the stream, which costs only speed; a key spelled with a JSON
    escape is missed, and that client gets one JSON body without progress."""
    return _PROGRESS_TOKEN in body


def call_result(result: ToolResult) -> types.CallToolResult:
    """A ToolResult as MCP answers it: `ok` as structured content (and the same JSON as
    text); every other status `isError` with the status and the error, so a model can
    correct itself."""
    meta: dict[str, Any] = {CALL_ID_META_KEY: result.call_id, STATUS_META_KEY: result.status}
    if not isinstance(result.provenance, msgspec.UnsetType):
        meta[PROVENANCE_META_KEY] = msgspec.to_builtins(result.provenance)
    if result.ok:
        text = json.dumps(result.data, ensure_ascii=False)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=result.data if isinstance(result.data, dict) else None,
            is_error=False,
            _meta=meta,
        )
    body = {
        "call_id": result.call_id,
        "status": result.status,
        "error": msgspec.to_builtins(result.error),
    }
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(body, ensure_ascii=False))],
        structured_content=body,
        is_error=True,
        _meta=meta,
    )


def still_waiting(call_id: str, waited_s: float) -> types.CallToolResult:
    """No result within the front door's wait: the call goes on; a retry with the same
    `_meta` call_id collects its result."""
    body = {
        "call_id": call_id,
        "status": "pending",
        "error": {
            "code": "RESULT_NOT_READY",
            "message": f"no result within {waited_s:g}s; the call goes on. Call again with "
            f'_meta {{"{CALL_ID_META_KEY}": "{call_id}"}} to get its result without running '
            "it twice",
            "retryable": True,
            "details": [],
        },
    }
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(body))],
        structured_content=body,
        is_error=True,
        _meta={CALL_ID_META_KEY: call_id, STATUS_META_KEY: "pending"},
    )
