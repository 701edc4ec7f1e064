"""Internal events: one per step of a call, each keyed by `call_id`.

Every event is a frozen msgspec Struct tagged by its class name in the field
`event_type`, and carries its identity (`event_id`), the producing `service`,
a UTC timestamp and the trace context. Event ids are *derived*, not random:
`derive_event_id(parent, kind)` hashes the id of the message that caused the
event, so a redelivered input produces the same output ids and both the
JetStream duplicate window and the audit table drop the copy.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import msgspec

from .calls import Principal, Status, ToolCall, ToolError, ToolResult

SCHEMA_VERSION = 1


def derive_event_id(parent: str, kind: str) -> str:
    """A deterministic id for the event of `kind` caused by message `parent`."""
    return hashlib.sha256(f"{parent}/{kind}".encode()).hexdigest()[:32]


def payload_sha256(raw: bytes) -> str:
    """How a message that could not be decoded is named in the record: never an excerpt."""
    return hashlib.sha256(raw).hexdigest()


def utc_now() -> datetime:
    return datetime.now(UTC)


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="event_type", tag=True):
    """Fields every event has. Call fields are filled wherever they are known."""

    event_id: str
    call_id: str
    occurred_at: datetime
    service: str
    schema_version: int = SCHEMA_VERSION
    traceparent: str | None = None
    tool: str = ""
    principal: Principal | None = None
    task_id: str | None = None
    arguments_sha256: str | None = None


class ArgumentsValidated(Event, frozen=True, kw_only=True):
    """The tool exists and the arguments satisfy its input_schema."""

    call: ToolCall


class ArgumentsRejected(Event, frozen=True, kw_only=True):
    """The call cannot run as asked: unknown tool, malformed call or bad arguments."""

    status: Status
    error: ToolError


class Authorization(msgspec.Struct, frozen=True, kw_only=True):
    """What the policy service signs: this call of this principal (the whole six-tuple:
    tenant, user, agent, session, task, tool + arguments), this policy, until then."""

    call_id: str
    tool: str
    arguments_sha256: str
    policy_version: str
    approvals: list[str] = []
    expires_at: datetime
    tenant: str = ""
    agent: str = ""
    user: str = ""
    session: str = ""
    task_id: str | None = None
    key_id: str = ""
    signature: str = ""


class ResourceSeen(msgspec.Struct, frozen=True, kw_only=True):
    """One resource a decision looked up, and what its entity provider said then.

    Recorded in the decision events so an auditor sees what the policy knew,
    and a re-decision (`policy test`, `audit replay`) can use the same facts.
    """

    type: str  # the Cedar entity type (registry `resources[].type`)
    id: str
    found: bool = False  # False: the provider knows no such resource, or failed (see error)
    attributes: dict[str, Any] = {}  # as the provider returned them (JSON values)
    provider: str = ""  # sql | http | python
    cached: bool = False  # answered from the policy service's short cache
    fetched_at: datetime | None = None  # when the provider answered
    error: str = ""  # why the lookup failed (timeout, error); empty otherwise


class CallAuthorized(Event, frozen=True, kw_only=True):
    call: ToolCall
    policy_version: str
    policy_ids: list[str] = []
    authorization: Authorization
    # The resources the decision looked up (tools that declare resources).
    resources: list[ResourceSeen] = []


class CallDenied(Event, frozen=True, kw_only=True):
    status: Status
    error: ToolError
    policy_version: str = ""
    policy_ids: list[str] = []
    resources: list[ResourceSeen] = []


class ApprovalRequested(Event, frozen=True, kw_only=True):
    """The policy allows this call only with human approval, bound to these exact arguments."""

    call: ToolCall
    policy_version: str
    policy_ids: list[str] = []
    risk: str
    required_approvals: int = 1
    expires_at: datetime
    reason: str = ""
    resources: list[ResourceSeen] = []


class ApprovalGranted(Event, frozen=True, kw_only=True):
    """One approver said yes. `quorum_reached` is set on the vote that completes the quorum."""

    call: ToolCall
    policy_version: str
    approver: str
    reason: str = ""
    approvers: list[str] = []
    required_approvals: int = 1
    quorum_reached: bool = False


class ApprovalDenied(Event, frozen=True, kw_only=True):
    approver: str
    reason: str = ""
    status: Status = "approval_denied"
    error: ToolError


class ApprovalExpired(Event, frozen=True, kw_only=True):
    status: Status = "approval_expired"
    error: ToolError


class ExecutionStarted(Event, frozen=True, kw_only=True):
    attempt: int
    worker: str


class ExecutionSucceeded(Event, frozen=True, kw_only=True):
    output: Any
    duration_ms: float
    replayed: bool = False


class ExecutionFailed(Event, frozen=True, kw_only=True):
    status: Status
    error: ToolError
    duration_ms: float = 0.0
    replayed: bool = False


class ExecutionRefused(Event, frozen=True, kw_only=True):
    """The executor would not run this message: it was not a valid authorization.

    Not terminal for the call (a forged message has no legitimate caller
    waiting): the audit records it, the agent gets nothing from it.
    """

    reason: str


class ResultAttached(Event, frozen=True, kw_only=True):
    result: ToolResult


class MessageDeadLettered(Event, frozen=True, kw_only=True):
    """A message no stage could act on; kept with the reason for an operator.

    The message itself is known by its size and SHA-256 only (the calls stream
    holds it for the retention): an excerpt of a message that could not be
    decoded could quote a secret meant for a tool audited as `hash` or `none`.
    `payload_excerpt` is left empty (kept for readers of older events).
    """

    reason: str
    source_subject: str
    payload_excerpt: str = ""
    payload_bytes: int = 0
    payload_sha256: str = ""


class CallRetried(Event, frozen=True, kw_only=True):
    """The agent published again a call_id it had used: nothing runs or is decided again.

    Not terminal: the attacher sends the call's stored result (or, while a human
    decides, its pending notice) again on the call's subjects, the same bytes, so
    a retry that subscribed is answered; a call still in flight is answered when
    its result lands.
    """


class CallAbandoned(Event, frozen=True, kw_only=True):
    """A stage gave up on this call: the call ends in an error result, not in silence.

    Emitted beside the MessageDeadLettered a stage records when its attempts run
    out (runtime/giving_up.py `give_up_on`), whenever the message it gave up on names
    the call (its call_id and principal). Terminal: the attacher turns it into
    the call's result (`execution_error`/`GATEWAY_GAVE_UP`), unless the call
    already has one.
    """

    status: Status
    error: ToolError


class PinAccepted(Event, frozen=True, kw_only=True):
    """An operator accepted an upstream MCP tool's changed definition after review
    (`toolgate tools accept NAME`): who, for which server and upstream tool, from which
    pin to which. No call's event: `call_id` is empty, `tool` is the registry name. The
    CLI publishes it as the operator before it writes the new pin, so no pin changes
    unrecorded; the audit writes it to ClickHouse like any event (`approver`: who)."""

    approver: str
    server: str
    upstream_tool: str
    previous_sha256: str
    accepted_sha256: str
    fields_updated: list[str] = []
    file: str = ""


AnyEvent = (
    ArgumentsValidated
    | ArgumentsRejected
    | CallAuthorized
    | CallDenied
    | ApprovalRequested
    | ApprovalGranted
    | ApprovalDenied
    | ApprovalExpired
    | ExecutionStarted
    | ExecutionSucceeded
    | ExecutionFailed
    | ExecutionRefused
    | ResultAttached
    | MessageDeadLettered
    | CallAbandoned
    | CallRetried
    | PinAccepted
)

TERMINAL_EVENTS: tuple[type[Event], ...] = (
    ArgumentsRejected,
    CallDenied,
    ApprovalDenied,
    ApprovalExpired,
    ExecutionSucceeded,
    ExecutionFailed,
    CallAbandoned,
)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(AnyEvent)


def encode_event(event: Event) -> bytes:
    return _encoder.encode(event)


def decode_event(data: bytes) -> Event:
    return _decoder.decode(data)


def event_type(cls: type[Event]) -> str:
    return cls.__name__


def traceparent_of(call: ToolCall) -> str:
    """The W3C trace context: the platform's, if it sent one, else one derived from call_id."""
    given = call.context.get("traceparent")
    if isinstance(given, str) and len(given) == 55 and given.count("-") == 3:
        return given
    digest = hashlib.sha256(call.call_id.encode()).hexdigest()
    return f"00-{digest[:32]}-{digest[32:48]}-01"


def call_fields(call: ToolCall) -> dict[str, Any]:
    """The call columns every event of this call carries."""
    return {
        "call_id": call.call_id,
        "tool": call.tool,
        "principal": call.principal,
        "task_id": call.task_id,
        "traceparent": traceparent_of(call),
    }


def carried_fields(event: Event) -> dict[str, Any]:
    """The call columns of `event`, for the next event of the same call."""
    return {
        "call_id": event.call_id,
        "tool": event.tool,
        "principal": event.principal,
        "task_id": event.task_id,
        "arguments_sha256": event.arguments_sha256,
        "traceparent": event.traceparent,
    }
