"""Pure converters between LLM provider tool-call shapes and toolgate contracts.

No I/O happens here: each function takes what a provider SDK returned (a
pydantic model from the `openai` / `anthropic` packages, or a plain dict of
the same shape, e.g. from `.model_dump()` or raw JSON) and builds toolgate
`ToolCall`s, or takes a toolgate `ToolResult` and builds the message or
content block the provider expects back.

Supported shapes:

=====================  ==================================  =========================
provider               in (`from_*`)                       out (`to_*`)
=====================  ==================================  =========================
OpenAI Chat            `ChatCompletionMessage.tool_calls`  `{"role": "tool", ...}`
OpenAI Responses       `Response.output` `function_call`   `function_call_output`
Anthropic Messages     `Message.content` `tool_use`        `tool_result` block
=====================  ==================================  =========================

Design decisions
----------------

**Malformed calls never raise.** A model may emit arguments that are not
JSON, or JSON that is not an object (OpenAI documents this). Such a call
cannot become a `ToolCall` (whose `arguments` is a dict), yet the provider
requires an answer for every call id it issued. So each `from_*` function
returns a list of `ToolCall | ToolResult`, in the provider's order: a
well-formed call becomes a `ToolCall` to publish to the gateway; a malformed
one becomes an immediate `ToolResult(ok=False, status="invalid_arguments",
error.code="MALFORMED_CALL")` that the platform hands straight back to the
model through the matching `to_*` function, with no gateway round trip. The
model sees the error and can retry. Structurally broken *input* (not the
model's fault: a tool call without an id, a non-list where a list belongs)
raises `AdapterError` instead.

An empty (or all-whitespace) arguments string is read as `{}`: some
OpenAI-compatible servers send `""` for a call to a tool without parameters.
A dict in place of the JSON string is accepted as already parsed.

**Provider call ids.** A toolgate `call_id` names a NATS subject, so it must
match `^[A-Za-z0-9_-]{1,128}$`. OpenAI (`call_...`) and Anthropic
(`toolu_...`) ids already do and are used unchanged. Any other id is mapped
deterministically by `safe_call_id` to `"x" + sha256(id).hexdigest()[:32]`;
the original is kept in `ToolCall.context["provider_call_id"]`. Since a
`ToolResult` carries only `call_id`, the `to_*` functions take an optional
`provider_call_id`; get it from `provider_id_map(items)`, which maps every
toolgate call_id in a `from_*` result (calls *and* immediate rejections) back
to the provider's id::

    # The principal's tenant and agent are the gateway client's own identity
    # (wire contract v2: the bus says who is calling; the payload must agree).
    items = from_openai_chat(message, principal=gateway.principal(user, session))
    ids = provider_id_map(items)
    results = [i if isinstance(i, ToolResult) else await gateway.submit(i) for i in items]
    messages += [to_openai_chat(r, provider_call_id=ids[r.call_id]) for r in results]

**Observation content.** What the model reads back is the JSON encoding of
the whole `ToolResult`: `{"call_id", "ok", "status", "data", "error"}`.

**A call waiting for a human is never a success.** `GatewayClient.submit`
waits for the final result (or raises `ResultTimeout`, naming the call_id).
A platform that answers the model before a human decided (it was told with
`on_pending=`) may hand the `PendingNotice` to any `to_*` function: the
answer is an error (`"ok": false`, `"status": "approval_pending"`, code
`APPROVAL_REQUIRED`; Anthropic's `is_error: true`) saying the tool has not
run, never a success (DESIGN invariant 13). The call stays in the approvals
inbox: if a human approves it, it runs once and its result is stored under
its call_id (`GatewayClient.result`, `toolgate result CALL_ID`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any, Final

import msgspec

from toolgate.contracts.calls import (
    ErrorCode,
    ErrorDetail,
    PendingNotice,
    Principal,
    ToolCall,
    ToolError,
    ToolResult,
    failure,
    is_valid_call_id,
)

__all__ = [
    "PROVIDER_CALL_ID_KEY",
    "AdaptedCalls",
    "AdapterError",
    "InvalidToolCallArguments",
    "from_anthropic",
    "from_openai_chat",
    "from_openai_responses",
    "observation_json",
    "parse_arguments",
    "provider_id_map",
    "safe_call_id",
    "to_anthropic",
    "to_openai_chat",
    "to_openai_responses",
]

PROVIDER_CALL_ID_KEY: Final = "provider_call_id"
_HASH_HEX_CHARS: Final = 32


class AdapterError(ValueError):
    """The provider input is not a tool-call shape this adapter understands."""


class InvalidToolCallArguments(ValueError):
    """A model-authored tool call whose arguments are not a JSON object."""

    def __init__(self, call_id: str, message: str) -> None:
        super().__init__(f"{call_id}: {message}")
        self.call_id = call_id
        self.message = message


class AdaptedCalls(list[ToolCall | ToolResult]):
    """What every `from_*` returns: a plain list, plus `provider_ids`.

    `provider_ids` maps each entry's toolgate call_id to the provider's
    original id, including for immediate rejections (a `ToolResult` has no
    `context` to keep it in). Use `provider_id_map` rather than reading it
    directly: that also works on a filtered or rebuilt list of `ToolCall`s.
    """

    provider_ids: dict[str, str]

    def __init__(
        self,
        items: Iterable[ToolCall | ToolResult] = (),
        provider_ids: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(items)
        self.provider_ids = dict(provider_ids or {})


# ---------------------------------------------------------------------------
# call ids


def safe_call_id(provider_call_id: str) -> str:
    """The toolgate call_id for a provider's call id: itself if subject-safe, else a hash."""
    if is_valid_call_id(provider_call_id):
        return provider_call_id
    digest = hashlib.sha256(provider_call_id.encode("utf-8", "surrogatepass")).hexdigest()
    return "x" + digest[:_HASH_HEX_CHARS]


def provider_id_map(items: Iterable[ToolCall | ToolResult]) -> dict[str, str]:
    """Map each toolgate call_id in `items` to the provider's original call id.

    Reads `AdaptedCalls.provider_ids` when `items` is a `from_*` result, then
    `ToolCall.context["provider_call_id"]`; any other id maps to itself (it was
    already subject-safe, so the provider's id is the call_id).
    """
    mapping: dict[str, str] = dict(getattr(items, "provider_ids", {}))
    for item in items:
        if item.call_id in mapping:
            continue
        original = item.context.get(PROVIDER_CALL_ID_KEY) if isinstance(item, ToolCall) else None
        mapping[item.call_id] = original if isinstance(original, str) else item.call_id
    return mapping


# ---------------------------------------------------------------------------
# arguments


def parse_arguments(call_id: str, raw: object) -> dict[str, Any]:
    """Decode a provider's arguments into a dict, or raise `InvalidToolCallArguments`."""
    if isinstance(raw, Mapping):
        return dict(raw)
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidToolCallArguments(call_id, f"arguments are not UTF-8: {exc}") from None
    if not isinstance(raw, str):
        raise InvalidToolCallArguments(
            call_id, f"arguments must be a JSON object string, got {type(raw).__name__}"
        )
    if not raw.strip():
        return {}
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidToolCallArguments(call_id, f"arguments are not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidToolCallArguments(
            call_id, f"arguments must be a JSON object, got {_json_type(value)}"
        )
    return value


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _malformed(call_id: str, message: str) -> ToolResult:
    return failure(
        call_id,
        "invalid_arguments",
        ToolError(
            code=ErrorCode.MALFORMED_CALL,
            message=message,
            retryable=False,
            details=[ErrorDetail(path="", message=message)],
        ),
    )


# ---------------------------------------------------------------------------
# shared plumbing


def _get(obj: object, key: str, default: Any = None) -> Any:
    """Read `key` from an SDK model (attribute) or a plain dict (item)."""
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _as_list(value: object, what: str) -> list[Any]:
    if value is None:
        return []
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise AdapterError(f"expected a list of {what}, got {type(value).__name__}")
    return list(value)


def _provider_id(item: object, key: str, what: str) -> str:
    value = _get(item, key)
    if not isinstance(value, str) or not value:
        raise AdapterError(f"{what} has no {key!r}")
    return value


class _Builder:
    def __init__(
        self,
        principal: Principal,
        task_id: str | None,
        context: Mapping[str, Any] | None,
    ) -> None:
        self.principal = principal
        self.task_id = task_id
        self.context = dict(context or {})
        self.out = AdaptedCalls()

    def add(self, provider_call_id: str, name: object, raw_arguments: object) -> None:
        call_id = safe_call_id(provider_call_id)
        self.out.provider_ids[call_id] = provider_call_id
        if not isinstance(name, str) or not name:
            self.out.append(_malformed(call_id, "tool call has no tool name"))
            return
        try:
            arguments = parse_arguments(call_id, raw_arguments)
        except InvalidToolCallArguments as exc:
            self.out.append(_malformed(call_id, exc.message))
            return
        self.out.append(self._call(call_id, provider_call_id, name, arguments))

    def reject(self, provider_call_id: str, message: str) -> None:
        call_id = safe_call_id(provider_call_id)
        self.out.provider_ids[call_id] = provider_call_id
        self.out.append(_malformed(call_id, message))

    def _call(
        self, call_id: str, provider_call_id: str, name: str, arguments: dict[str, Any]
    ) -> ToolCall:
        context = dict(self.context)
        if call_id != provider_call_id:
            context[PROVIDER_CALL_ID_KEY] = provider_call_id
        return ToolCall(
            call_id=call_id,
            tool=name,
            arguments=arguments,
            principal=self.principal,
            task_id=self.task_id,
            context=context,
        )


def observation_json(result: ToolResult | PendingNotice) -> str:
    """The text the model reads back: the JSON encoding of the whole result; for a call
    that waits for a human, an error result saying the tool has not run."""
    if isinstance(result, PendingNotice):
        return msgspec.json.encode(_not_run(result)).decode("utf-8")
    return msgspec.json.encode(result).decode("utf-8")


def _not_run(notice: PendingNotice) -> dict[str, Any]:
    """A pending call as the model reads it: an error of the ToolResult's shape."""
    expiry = f" until {notice.expires_at}" if notice.expires_at else ""
    message = (
        f"the tool has not run: it waits for a human decision{expiry}"
        f"{': ' + notice.message if notice.message else ''}. Do not call it again; if a "
        f"human approves it, it runs once and its result is stored under call_id "
        f"{notice.call_id}"
    )
    error = ToolError(code=ErrorCode.APPROVAL_REQUIRED, message=message, retryable=False)
    return {
        "call_id": notice.call_id,
        "ok": False,
        "status": notice.status,
        "data": None,
        "error": error,
    }


def _reply_id(result: ToolResult | PendingNotice, provider_call_id: str | None) -> str:
    return provider_call_id if provider_call_id is not None else result.call_id


# ---------------------------------------------------------------------------
# OpenAI Chat Completions


def from_openai_chat(
    message_or_tool_calls: object,
    *,
    principal: Principal,
    task_id: str | None = None,
    context: Mapping[str, Any] | None = None,
) -> AdaptedCalls:
    """Tool calls of an OpenAI `ChatCompletionMessage` as toolgate calls.

    Accepts the message, its `.tool_calls` list, or dicts of the same shape.
    Returns `ToolCall`s for well-formed calls and immediate `invalid_arguments`
    `ToolResult`s for malformed ones (see the module docstring). A `custom`
    tool call (free-text input, not JSON) is also answered with an immediate
    rejection: toolgate tools take JSON-object arguments.
    """
    if isinstance(message_or_tool_calls, Mapping) or hasattr(message_or_tool_calls, "tool_calls"):
        tool_calls = _get(message_or_tool_calls, "tool_calls")
    else:
        tool_calls = message_or_tool_calls
    builder = _Builder(principal, task_id, context)
    for tool_call in _as_list(tool_calls, "chat tool calls"):
        provider_call_id = _provider_id(tool_call, "id", "chat tool call")
        kind = _get(tool_call, "type", "function")
        if kind != "function":
            builder.reject(
                provider_call_id,
                f"unsupported tool call type {kind!r}: toolgate tools are functions",
            )
            continue
        function = _get(tool_call, "function")
        if function is None:
            builder.reject(provider_call_id, "tool call has no function")
            continue
        builder.add(provider_call_id, _get(function, "name"), _get(function, "arguments"))
    return builder.out


def to_openai_chat(
    result: ToolResult | PendingNotice, *, provider_call_id: str | None = None
) -> dict[str, Any]:
    """A `ChatCompletionToolMessageParam` answering the call with `result`."""
    return {
        "role": "tool",
        "tool_call_id": _reply_id(result, provider_call_id),
        "content": observation_json(result),
    }


# ---------------------------------------------------------------------------
# OpenAI Responses


def from_openai_responses(
    output_items: object,
    *,
    principal: Principal,
    task_id: str | None = None,
    context: Mapping[str, Any] | None = None,
) -> AdaptedCalls:
    """`function_call` items of an OpenAI `Response.output` as toolgate calls.

    Accepts the `Response`, its `.output` list, or dicts of the same shape.
    Items of any other type (messages, reasoning, built-in tool calls) are
    skipped. Malformed arguments become immediate rejections, as for chat.
    """
    if isinstance(output_items, Mapping) or hasattr(output_items, "output"):
        items = _get(output_items, "output")
    else:
        items = output_items
    builder = _Builder(principal, task_id, context)
    for item in _as_list(items, "response output items"):
        if _get(item, "type") != "function_call":
            continue
        provider_call_id = _provider_id(item, "call_id", "function_call item")
        builder.add(provider_call_id, _get(item, "name"), _get(item, "arguments"))
    return builder.out


def to_openai_responses(
    result: ToolResult | PendingNotice, *, provider_call_id: str | None = None
) -> dict[str, Any]:
    """A `function_call_output` input item answering the call with `result`."""
    return {
        "type": "function_call_output",
        "call_id": _reply_id(result, provider_call_id),
        "output": observation_json(result),
    }


# ---------------------------------------------------------------------------
# Anthropic Messages


def from_anthropic(
    message_or_content: object,
    *,
    principal: Principal,
    task_id: str | None = None,
    context: Mapping[str, Any] | None = None,
) -> AdaptedCalls:
    """`tool_use` blocks of an Anthropic `Message` as toolgate calls.

    Accepts the `Message`, its `.content` list, or dicts of the same shape.
    Other blocks (text, thinking, server-side `server_tool_use`, ...) are
    skipped. `input` is already an object; anything else is rejected immediately.
    """
    if isinstance(message_or_content, Mapping) or hasattr(message_or_content, "content"):
        content = _get(message_or_content, "content")
    else:
        content = message_or_content
    builder = _Builder(principal, task_id, context)
    for block in _as_list(content, "content blocks"):
        if _get(block, "type") != "tool_use":
            continue
        provider_call_id = _provider_id(block, "id", "tool_use block")
        raw_input = _get(block, "input")
        if not isinstance(raw_input, Mapping):
            builder.reject(
                provider_call_id,
                f"tool_use input must be an object, got {type(raw_input).__name__}",
            )
            continue
        builder.add(provider_call_id, _get(block, "name"), raw_input)
    return builder.out


def to_anthropic(
    result: ToolResult | PendingNotice, *, provider_call_id: str | None = None
) -> dict[str, Any]:
    """A `ToolResultBlockParam` answering the `tool_use` block with `result`."""
    return {
        "type": "tool_result",
        "tool_use_id": _reply_id(result, provider_call_id),
        "content": observation_json(result),
        "is_error": isinstance(result, PendingNotice) or not result.ok,
    }
