"""Pure validation of one raw call: decode, check identity and call_id, find the tool,
check arguments.

The caller's tenant and agent come from the subject the call arrived on (the
server let only that agent publish there), never from the payload: a payload
naming someone else is refused, and every answer goes to the publisher.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsonschema_rs
import msgspec

from toolgate.contracts.calls import (
    MAX_DETAILS,
    ErrorCode,
    ErrorDetail,
    Principal,
    Status,
    ToolCall,
    ToolError,
    is_valid_call_id,
    json_pointer,
)
from toolgate.contracts.registry import Registry
from toolgate.services.validator.normalize import Normalizer, compile_normalizer

CALL_ID_RULE = "a subject-safe token (letters, digits, '-', '_'; 1 to 128 characters)"
# Deeper arguments are refused: nothing downstream (policy context, audit)
# should have to walk a bomb, and msgspec itself gives up near 1,000.
MAX_ARGUMENT_DEPTH = 64
# A call_id field as it appears in a body that is not (all) JSON: the key unescaped and
# not inside a string (no backslash before its quote), the value a subject-safe token.
_CALL_ID_FIELD = re.compile(
    rb'(?<!\\)"call_id"[ \t\r\n]{0,16}:[ \t\r\n]{0,16}"([A-Za-z0-9_-]{1,128})"'
)
# Enough to tell one call_id from two: a body naming several different ones is not answered.
_CALL_ID_SCAN_LIMIT = 8


@dataclass(frozen=True)
class Identity:
    """Who published the call, as the server authenticated it (from the subject)."""

    tenant: str
    agent: str

    def principal(self, claimed: Principal | None = None) -> Principal:
        """The call's principal: tenant and agent from the bus, user and session claimed."""
        return Principal(
            tenant=self.tenant,
            agent=self.agent,
            user=claimed.user if claimed else "",
            session=claimed.session if claimed else "",
        )


@dataclass(frozen=True)
class Validated:
    call: ToolCall


@dataclass(frozen=True)
class Rejected:
    """The call cannot run; the agent gets `status` and `error`."""

    call_id: str
    status: Status
    error: ToolError
    principal: Principal
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
    except (msgspec.DecodeError, RecursionError):
        # Not JSON (NaN, cut short) or too deep even to skip: scan for the field.
        return scan_call_id(raw)


def scan_call_id(raw: bytes) -> str | None:
    """The call_id a body that cannot be decoded names, if it names exactly one.

    A bounded scan (one pass, at most a few matches) for `"call_id": "<token>"`;
    several different ones (one may sit inside the arguments) are no answer. Even
    a wrong guess is answered only on the publisher's own result subjects."""
    found: set[bytes] = set()
    for match, _ in zip(_CALL_ID_FIELD.finditer(raw), range(_CALL_ID_SCAN_LIMIT), strict=False):
        found.add(match.group(1))
        if len(found) > 1:
            return None
    return found.pop().decode() if found else None


def nesting_depth(value: Any, limit: int) -> int:
    """How deeply `value` nests lists and objects, counting no further than `limit` + 1."""
    depth, level = 0, [value]
    while depth <= limit:
        containers = [node for node in level if isinstance(node, dict | list)]
        if not containers:
            break
        depth += 1
        level = [
            child
            for node in containers
            for child in (node.values() if isinstance(node, dict) else node)
        ]
    return depth


class CallChecker:
    """Holds one compiled validator per tool: schemas are compiled once, not per call."""

    def __init__(self, registry: Registry, max_call_bytes: int) -> None:
        self.registry = registry
        self.max_call_bytes = max_call_bytes
        self._validators = {
            spec.name: jsonschema_rs.validator_for(spec.input_schema) for spec in registry
        }
        self._normalizers: dict[str, Normalizer | None] = {
            spec.name: compile_normalizer(spec.input_schema) for spec in registry
        }
        self._decoder = msgspec.json.Decoder(ToolCall)

    def check(self, raw: bytes, identity: Identity) -> CheckOutcome:
        if len(raw) > self.max_call_bytes:
            return self._too_large(raw, identity)
        try:
            claimed = self._decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return self._malformed(raw, str(exc), identity)
        except RecursionError:
            return self._too_deep(raw, identity, "the call")
        if not is_valid_call_id(claimed.call_id):
            return Undeliverable(f"call_id {claimed.call_id[:140]!r} is not {CALL_ID_RULE}")
        principal = identity.principal(claimed.principal)
        call = msgspec.structs.replace(claimed, principal=principal)
        if (claimed.principal.tenant, claimed.principal.agent) != (identity.tenant, identity.agent):
            return Rejected(
                call.call_id,
                "denied",
                ToolError(
                    code=ErrorCode.PRINCIPAL_MISMATCH,
                    message=f"the call names tenant {claimed.principal.tenant[:64]!r} and agent "
                    f"{claimed.principal.agent[:64]!r}, but it was sent by agent "
                    f"{identity.agent!r} of tenant {identity.tenant!r}",
                    retryable=False,
                ),
                principal,
                call=call,
            )
        if nesting_depth(call.arguments, MAX_ARGUMENT_DEPTH) > MAX_ARGUMENT_DEPTH:
            return self._too_deep(raw, identity, "the arguments", call)
        spec = self.registry.get(call.tool)
        if spec is None:
            return Rejected(
                call.call_id,
                "unknown_tool",
                ToolError(
                    code=ErrorCode.TOOL_NOT_FOUND,
                    message=f"no tool named {call.tool[:200]!r} is registered",
                    retryable=False,
                ),
                principal,
                call=call,
            )
        errors = [
            ErrorDetail(path=json_pointer(list(err.instance_path)), message=err.message)
            for _, err in zip(
                range(MAX_DETAILS),
                self._validators[call.tool].iter_errors(call.arguments),
                strict=False,
            )
        ]
        if errors:
            return Rejected(
                call.call_id,
                "invalid_arguments",
                ToolError(
                    code=ErrorCode.SCHEMA_VALIDATION_FAILED,
                    message=f"arguments do not match the input_schema of {call.tool}: "
                    + "; ".join(f"{e.path or '/'}: {e.message}" for e in errors[:3]),
                    retryable=False,
                    details=errors,
                ),
                principal,
                call=call,
            )
        # In the schema's types from here on (900.0 in an integer field is 900): the
        # hash, the policy and the tool all see the same value.
        normalize = self._normalizers[call.tool]
        if normalize is not None:
            arguments = normalize(call.arguments)
            if arguments is not call.arguments:
                call = msgspec.structs.replace(call, arguments=arguments)
        return Validated(call)

    def _too_large(self, raw: bytes, identity: Identity) -> CheckOutcome:
        call_id = _read_call_id(raw)
        reason = f"call is {len(raw)} bytes; the limit is {self.max_call_bytes}"
        if not is_valid_call_id(call_id):
            return Undeliverable(f"{reason}; and it has no call_id that is {CALL_ID_RULE}")
        return Rejected(
            call_id,
            "invalid_arguments",
            ToolError(code=ErrorCode.PAYLOAD_TOO_LARGE, message=reason, retryable=False),
            identity.principal(),
        )

    def _too_deep(
        self, raw: bytes, identity: Identity, what: str, call: ToolCall | None = None
    ) -> CheckOutcome:
        call_id = call.call_id if call else _read_call_id(raw)
        reason = f"{what} nest more than {MAX_ARGUMENT_DEPTH} levels of lists and objects"
        if not is_valid_call_id(call_id):
            return Undeliverable(f"{reason}; and it has no call_id that is {CALL_ID_RULE}")
        return Rejected(
            call_id,
            "invalid_arguments",
            ToolError(code=ErrorCode.NESTING_TOO_DEEP, message=reason, retryable=False),
            call.principal if call else identity.principal(),
            call=call,
        )

    def _malformed(self, raw: bytes, problem: str, identity: Identity) -> CheckOutcome:
        call_id = _read_call_id(raw)
        reason = f"malformed ToolCall: {problem}"
        if call_id is not None and not is_valid_call_id(call_id):
            return Undeliverable(f"{reason}; and its call_id is not {CALL_ID_RULE}")
        if call_id is None:
            return Undeliverable(f"{reason}; and it has no call_id to answer to")
        return Rejected(
            call_id,
            "invalid_arguments",
            ToolError(code=ErrorCode.MALFORMED_CALL, message=reason, retryable=False),
            identity.principal(),
            dead_letter_reason=reason,
        )
