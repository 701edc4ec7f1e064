"""What the MCP front door shows and answers, without I/O: the tool listing from the
registry, the call_id of a tools/call, and a ToolResult as an MCP CallToolResult."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

import mcp_types as types
import msgspec
from mcp.shared.inbound import X_MCP_HEADER_KEY
from mcp_types.methods import serialize_server_result
from mcp_types.version import HANDSHAKE_PROTOCOL_VERSIONS, MODERN_PROTOCOL_VERSIONS
from pydantic import TypeAdapter, ValidationError

from toolgate.contracts.calls import PendingNotice, ToolResult, is_valid_call_id
from toolgate.contracts.registry import Registry, ToolSpec
from toolgate.contracts.registry_bundle import ListedTool, listed_tool
from toolgate.contracts.registry_bundle import passes_content as registry_passes_content

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


def declares_mcp_headers(schema: Any) -> bool:
    """Whether a tool's input schema has an `x-mcp-header` key anywhere: only then can
    a call's Mcp-Param-* headers be checked against it (SEP-2243)."""
    if isinstance(schema, dict):
        return X_MCP_HEADER_KEY in schema or any(
            declares_mcp_headers(value) for value in schema.values()
        )
    if isinstance(schema, list):
        return any(declares_mcp_headers(value) for value in schema)
    return False


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


def may_carry_trace(meta: Mapping[str, Any], fields: Iterable[str]) -> bool:
    """Whether a request's `_meta` has any key the trace propagator reads (its `fields`):
    without one, there is no trace context to extract."""
    return any(key in meta for key in fields)


class BadMeta(ValueError):
    """A `_meta` value the front door cannot use: an invalid-params protocol error."""


def annotations_of(spec: ToolSpec | ListedTool) -> types.ToolAnnotations:
    """MCP's hints, from the registry: what the tool does, never what it claims."""
    listed = spec if isinstance(spec, ListedTool) else listed_tool(spec)
    return types.ToolAnnotations(
        read_only_hint=listed.read_only,
        # MCP's default assumption for a tool that writes: it may destroy.
        destructive_hint=not listed.read_only,
        idempotent_hint=listed.idempotent or listed.read_only,
        open_world_hint=listed.open_world,
    )


def passes_content(spec: ToolSpec | ListedTool) -> bool:
    """Whether the tool's result is an upstream's MCP content, passed through as it came
    (contracts/registry_bundle.py `passes_content`)."""
    if isinstance(spec, ListedTool):
        return spec.content_passthrough
    return registry_passes_content(spec)


def tool_of(spec: ToolSpec | ListedTool) -> types.Tool:
    # MCP wants an object schema for outputSchema; a tool that returns anything else
    # lists none (its result still comes as text and is checked by the attacher). An
    # upstream's content passes through as content, so it lists none either (a listed
    # outputSchema would oblige every result to carry structuredContent).
    output = spec.output_schema if spec.output_schema.get("type") == "object" else None
    if passes_content(spec):
        output = None
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


_content_blocks: TypeAdapter[list[types.ContentBlock]] = TypeAdapter(list[types.ContentBlock])


def upstream_content(data: Any) -> list[types.ContentBlock] | None:
    """An upstream's content blocks (`{"content": [...]}`) as MCP content, or None if
    they are not valid MCP content blocks (then they go as JSON text, like any data)."""
    if not isinstance(data, dict) or list(data) != ["content"]:
        return None
    try:
        return _content_blocks.validate_python(data["content"])
    except ValidationError:
        return None


def error_body(result: ToolResult) -> dict[str, Any]:
    """What a model reads of a result that is not `ok`: its status and its error."""
    return {
        "call_id": result.call_id,
        "status": result.status,
        "error": msgspec.to_builtins(result.error),
    }


def result_meta(result: ToolResult) -> dict[str, Any]:
    """What a tools/call answer's `_meta` says of the call: its id, status, provenance."""
    meta: dict[str, Any] = {CALL_ID_META_KEY: result.call_id, STATUS_META_KEY: result.status}
    if not isinstance(result.provenance, msgspec.UnsetType):
        meta[PROVENANCE_META_KEY] = msgspec.to_builtins(result.provenance)
    return meta


def call_result(
    result: ToolResult, spec: ToolSpec | ListedTool | None = None
) -> types.CallToolResult:
    """A ToolResult as MCP answers it.

    `ok`: the data as structured content and the same JSON as text; for a tool whose
    result is an upstream's MCP content (`passes_content`), those blocks as they came
    (text, images, resource links), not wrapped again. Every other status is `isError`
    with the status and the error as JSON text, so a model can correct itself, and no
    structured content: what a client validates against the tool's listed
    outputSchema (the MCP Inspector does) is only ever a successful result."""
    meta = result_meta(result)
    if result.ok:
        blocks = upstream_content(result.data) if spec and passes_content(spec) else None
        if blocks is not None:
            return types.CallToolResult(content=blocks, is_error=False, _meta=meta)
        text = json.dumps(result.data, ensure_ascii=False)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)],
            structured_content=result.data if isinstance(result.data, dict) else None,
            is_error=False,
            _meta=meta,
        )
    body = error_body(result)
    return types.CallToolResult(
        content=[types.TextContent(type="text", text=json.dumps(body, ensure_ascii=False))],
        is_error=True,
        _meta=meta,
    )


# The protocol version whose wire `call_answer` writes (the SDK's surface for it).
ANSWER_VERSION: Final = "2026-07-28"


def call_answer(result: ToolResult, spec: ToolSpec | ListedTool | None = None) -> dict[str, Any]:
    """`call_result` as the SDK puts it on the 2026-07-28 wire (its result surface:
    keys in the surface's order, none left null), without the server's identity stamp:
    what the door's common path answers without building and re-validating the models.
    An upstream's content blocks, passed through as they came, are shaped by the SDK's
    own serializer (their many kinds are its to write)."""
    meta = result_meta(result)
    if result.ok:
        blocks = upstream_content(result.data) if spec and passes_content(spec) else None
        if blocks is not None:
            return wire_form(types.CallToolResult(content=blocks, is_error=False, _meta=meta))
        answer: dict[str, Any] = {
            "_meta": meta,
            "content": [{"text": json.dumps(result.data, ensure_ascii=False), "type": "text"}],
            "isError": False,
            "resultType": "complete",
        }
        if isinstance(result.data, dict):
            answer["structuredContent"] = result.data
        return answer
    text = json.dumps(error_body(result), ensure_ascii=False)
    return {
        "_meta": meta,
        "content": [{"text": text, "type": "text"}],
        "isError": True,
        "resultType": "complete",
    }


def wire_form(result: types.CallToolResult) -> dict[str, Any]:
    """A CallToolResult as the SDK shapes it for the 2026-07-28 wire (its own dump and
    serializer), without the server's identity stamp."""
    dumped = result.model_dump(by_alias=True, mode="json", exclude_none=True)
    return serialize_server_result("tools/call", ANSWER_VERSION, dumped)


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
        is_error=True,
        _meta={CALL_ID_META_KEY: call_id, STATUS_META_KEY: "pending"},
    )


# ---------------------------------------------------------------- retries without a call_id

# How long a result the front door could not deliver (its client went away, or gave up
# and said so) waits for the next identical call: that call gets it instead of running
# the tool again. Ten minutes: long past an agent's retry with backoff, short enough
# that a deliberate repeat later is a new call.
RETRY_WINDOW_S: Final = 600.0
# An identical call while the first has been in flight this long (or waits for a human)
# joins it; sooner, it is a call of its own (an agent may ask the same thing twice at once).
JOIN_AFTER_S: Final = 1.0


def call_key(
    tenant: str,
    agent: str,
    tool: str,
    arguments: dict[str, Any],
    user: str,
    session: str,
    task_id: str | None,
) -> str:
    """What makes two calls without a client call_id the same call: who asks what."""
    canonical = json.dumps(
        [tenant, agent, tool, arguments, user, session, task_id],
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class _Entry:
    call_id: str
    started: float
    in_flight: int = 1
    for_human: bool = False
    # When the last handler waiting for it ended without handing the result to a client.
    undelivered_at: float | None = None


class Retries:
    """The calls without a client call_id this front door serves, by `call_key`.

    A call with the key of one still in flight (for `join_after_s`, or waiting for
    a human) joins it: the same call_id, so one call, one approval card, one run. A
    call whose every handler ended without delivering its result (the client went
    away, or was told it is still pending) stays here for `window_s`: the next call
    with its key gets that call_id, so it reads the stored result (or joins the wait)
    instead of running the tool again. A result delivered ends the entry: a later
    identical call is a new call. Kept per front door process (a retry through
    another replica is a new call there)."""

    def __init__(self, window_s: float = RETRY_WINDOW_S, join_after_s: float = JOIN_AFTER_S):
        self.window_s = window_s
        self.join_after_s = join_after_s
        self.entries: dict[str, _Entry] = {}

    def claim(self, key: str, now: float, mint: Callable[[], str]) -> tuple[str, bool]:
        """The call_id for a call with this key, and whether it is a new one (fresh)."""
        self._expire(now)
        entry = self.entries.get(key)
        if entry is not None and (
            entry.undelivered_at is not None
            or entry.for_human
            or now - entry.started >= self.join_after_s
        ):
            entry.in_flight += 1
            entry.undelivered_at = None
            return entry.call_id, False
        call_id = mint()
        self.entries[key] = _Entry(call_id, now)
        return call_id, True

    def waits_for_human(self, key: str, call_id: str) -> None:
        entry = self.entries.get(key)
        if entry is not None and entry.call_id == call_id:
            entry.for_human = True

    def ended(self, key: str, call_id: str, now: float, *, delivered: bool) -> None:
        """One handler of the call is done: it handed the result over, or not."""
        entry = self.entries.get(key)
        if entry is None or entry.call_id != call_id:
            return
        if delivered:
            del self.entries[key]
            return
        entry.in_flight -= 1
        if entry.in_flight <= 0:
            entry.undelivered_at = now

    def _expire(self, now: float) -> None:
        stale = [
            key
            for key, entry in self.entries.items()
            if entry.undelivered_at is not None and now - entry.undelivered_at > self.window_s
        ]
        for key in stale:
            del self.entries[key]


# ---------------------------------------------------------------- tasks (SEP-2663)

TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
# How often a client should ask `tasks/get` about a call waiting for a human.
TASK_POLL_INTERVAL_MS: Final = 5000


def wants_tasks(protocol_version: str | None, capabilities: Any) -> bool:
    """Whether this request's client takes a task for an answer: it declared the tasks
    extension, on a protocol version whose results may say `resultType: "task"`."""
    if protocol_version not in MODERN_PROTOCOL_VERSIONS:
        return False
    # The SDK's ClientCapabilities, or the raw `_meta` object (the common path's).
    if isinstance(capabilities, dict):
        extensions = capabilities.get("extensions")
    else:
        extensions = getattr(capabilities, "extensions", None)
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


def task_id_of(tool: str, call_id: str) -> str:
    """The task is the call: its id names the tool and the call_id (neither has a dot)."""
    return f"{tool}.{call_id}"


def call_of_task(task_id: Any) -> tuple[str, str]:
    """(tool, call_id) of a task id; BadMeta if it is not one this front door gave."""
    tool, _, call_id = task_id.partition(".") if isinstance(task_id, str) else ("", "", "")
    if not tool or not is_valid_call_id(call_id):
        raise BadMeta(f"unknown task {str(task_id)[:140]!r}")
    return tool, call_id


def task_body(
    task_id: str,
    status: str,
    *,
    created_at: str,
    updated_at: str,
    ttl_s: int | None,
    message: str | None = None,
    result: types.CallToolResult | None = None,
) -> dict[str, Any]:
    """A task as SEP-2663 writes it (flat): its state, and the result once it has one."""
    # Durations in milliseconds (`ttlMs`, `pollIntervalMs`), as the SDKs' tasks
    # extensions read them (the TypeScript ext-tasks the MCP Inspector uses).
    body: dict[str, Any] = {
        "taskId": task_id,
        "status": status,
        "createdAt": created_at,
        "lastUpdatedAt": updated_at,
        "ttlMs": None if ttl_s is None else ttl_s * 1000,
    }
    if status in ("working", "input_required"):
        body["pollIntervalMs"] = TASK_POLL_INTERVAL_MS
    if message:
        body["statusMessage"] = message
    if result is not None:
        body["result"] = result.model_dump(mode="json", by_alias=True, exclude_none=True)
    return body


def created_task(task_id: str, status: str, **state: Any) -> dict[str, Any]:
    """The answer to a tools/call that became a task (SEP-2663's CreateTaskResult)."""
    return {"resultType": "task", **task_body(task_id, status, **state)}


def waiting_message(notice: PendingNotice) -> str:
    expires = f" (until {notice.expires_at})" if notice.expires_at else ""
    return f"waiting for a human approval: {notice.message}{expires}"


def iso_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
