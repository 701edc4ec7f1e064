"""Pure validation of one raw call: decode, check call_id, find the tool, check arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jsonschema_rs
import msgspec

from toolgate.contracts.calls import (
    ErrorCode,
    ErrorDetail,
    Status,
    ToolCall,
    ToolError,
    is_valid_call_id,
)
from toolgate.contracts.registry import Registry

MAX_DETAILS = 50
CALL_ID_RULE = "a subject-safe token (letters, digits, '-', '_'; 1 to 128 characters)"


@dataclass(frozen=True)
class Validated:
    call: ToolCall


@dataclass(frozen=True)
class Rejected:
    """The call cannot run; the agent gets `status` and `error`."""

    call_id: str
    status: Status
    error: ToolError
    call: ToolCall | None = None
    # Also kept as a dead letter: the message itself was malformed.
    dead_letter_reason: str | None = None


@dataclass(frozen=True)
class Undeliverable:
    """No result subject can be formed (no usable call_id): dead-letter only."""

    reason: str


CheckOutcome = Validated | Rejected | Undeliverable


class _CallIdOnly(msgspec.Struct):
    call_id: Any = None


def _read_call_id(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw, type=_CallIdOnly).call_id
    except msgspec.DecodeError:
        return None


def json_pointer(path: list[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


class CallChecker:
    """Holds one compiled validator per tool: schemas are compiled once, not per call."""

    def __init__(self, registry: Registry, max_call_bytes: int) -> None:
        self.registry = registry
        self.max_call_bytes = max_call_bytes
        self._validators = {
            spec.name: jsonschema_rs.validator_for(spec.input_schema) for spec in registry
        }
        self._decoder = msgspec.json.Decoder(ToolCall)

    def check(self, raw: bytes) -> CheckOutcome:
        if len(raw) > self.max_call_bytes:
            return self._too_large(raw)
        try:
            call = self._decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return self._malformed(raw, str(exc))
        if not is_valid_call_id(call.call_id):
            return Undeliverable(f"call_id {call.call_id[:140]!r} is not {CALL_ID_RULE}")
        spec = self.registry.get(call.tool)
        if spec is None:
            return Rejected(call.call_id, "unknown_tool", ToolError(
                code=ErrorCode.TOOL_NOT_FOUND,
                message=f"no tool named {call.tool[:200]!r} is registered",
                retryable=False), call=call)
        errors = [
            ErrorDetail(path=json_pointer(list(err.instance_path)), message=err.message)
            for _, err in zip(range(MAX_DETAILS), self._validators[call.tool].iter_errors(
                call.arguments), strict=False)
        ]
        if errors:
            return Rejected(call.call_id, "invalid_arguments", ToolError(
                code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                message=f"arguments do not match the input_schema of {call.tool}: "
                        + "; ".join(f"{e.path or '/'}: {e.message}" for e in errors[:3]),
                retryable=False, details=errors), call=call)
        return Validated(call)

    def _too_large(self, raw: bytes) -> CheckOutcome:
        call_id = _read_call_id(raw)
        reason = f"call is {len(raw)} bytes; the limit is {self.max_call_bytes}"
        if not is_valid_call_id(call_id):
            return Undeliverable(f"{reason}; and it has no call_id that is {CALL_ID_RULE}")
        return Rejected(call_id, "invalid_arguments", ToolError(
            code=ErrorCode.PAYLOAD_TOO_LARGE, message=reason, retryable=False))

    def _malformed(self, raw: bytes, problem: str) -> CheckOutcome:
        call_id = _read_call_id(raw)
        reason = f"malformed ToolCall: {problem}"
        if call_id is not None and not is_valid_call_id(call_id):
            return Undeliverable(f"{reason}; and its call_id is not {CALL_ID_RULE}")
        if call_id is None:
            return Undeliverable(f"{reason}; and it has no call_id to answer to")
        return Rejected(call_id, "invalid_arguments", ToolError(
            code=ErrorCode.MALFORMED_CALL, message=reason, retryable=False),
            dead_letter_reason=reason)
