"""From a stored JetStream message to one audit row. Pure: no I/O.

Two sources: the raw call on TOOLGATE_CALLS becomes a `CallRequested` row,
each event on TOOLGATE_EVENTS a row of its own type. A raw call's tenant and
agent are those of the subject it was stored under (the server let only that
agent publish there), never the payload's word; a payload that names someone
else is recorded as sent, with a note. Anything that does not
decode is still recorded (`note` says why), with an event_id derived from
the stream sequence, so a redelivered copy has the same id.

Arguments and results are kept as the tool's `audit` metadata says:
full (as is), hash (only the SHA-256 of the canonical JSON), none (nothing,
not even the hash, which would let a guess be confirmed). The tool is the one
the decoded call names (JSON escapes resolved, as the registry is looked up);
a tool the registry does not know is kept as `hash`. A message that cannot be
decoded (or is too large to be) is kept as its size and SHA-256, never an
excerpt: nothing tells which tool's secret it may carry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from toolgate.contracts import events as ev
from toolgate.contracts.authorization import arguments_sha256, canonical_json
from toolgate.contracts.calls import ToolCall, is_valid_call_id
from toolgate.contracts.registry import AuditSpec, Registry
from toolgate.contracts.subjects import CALLS_STREAM, EVENTS_STREAM, identity_of_calls_subject

CALL_REQUESTED = "CallRequested"
UNDECODABLE_EVENT = "UndecodableEvent"
# Larger payloads are cut to an excerpt plus the hash of the whole.
MAX_PAYLOAD_CHARS = 256 * 1024
EXCERPT_CHARS = 512
REDACTED = "[redacted]"
UNKNOWN_TOOL_AUDIT = AuditSpec(arguments="hash", result="hash")
NO_TOOL_AUDIT = AuditSpec()
# The tool names whose rules a builder remembers (names come from the bus: bounded).
MAX_REMEMBERED_TOOLS = 4096
MAX_REMEMBERED_SUBJECTS = 4096  # the calls subjects whose sender a builder remembers

# The columns of event_log this sink writes, in insert order. The chain hash
# covers exactly CONTENT_COLUMNS, so verify can recompute it from a read.
CONTENT_COLUMNS = (
    "event_id",
    "call_id",
    "event_type",
    "occurred_at",
    "service",
    "tenant",
    "user",
    "agent",
    "session",
    "task_id",
    "tool",
    "risk",
    "decision",
    "status",
    "error_code",
    "arguments_sha256",
    "result_sha256",
    "policy_version",
    "approver",
    "duration_ms",
    "note",
    "payload",
    "source_stream",
    "source_seq",
)
CHAIN_COLUMNS = ("chain_id", "chain_seq", "chain_hash")
INSERT_COLUMNS = CONTENT_COLUMNS + CHAIN_COLUMNS

# DateTime64 holds 1900..2299; a timestamp outside is clamped, not refused.
_MIN_TIME = datetime(1900, 1, 2, tzinfo=UTC)
_MAX_TIME = datetime(2299, 12, 30, tzinfo=UTC)

_DECISIONS: dict[type[ev.Event], str] = {
    ev.CallAuthorized: "allowed",
    ev.CallDenied: "denied",
    ev.ApprovalRequested: "approval_required",
    ev.ApprovalGranted: "approved",
    ev.ApprovalDenied: "approval_denied",
    ev.ApprovalExpired: "approval_expired",
    ev.ExecutionRefused: "refused",
}
_call_decoder = msgspec.json.Decoder(ToolCall)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class StoredMessage(msgspec.Struct, frozen=True):
    """What the sink knows of one JetStream message (decoupled from nats-py for tests). A
    msgspec struct: made once per row, ten times cheaper than a frozen dataclass."""

    stream: str
    sequence: int
    # When the server stored it: a datetime, or the ack subject's nanoseconds since the
    # epoch as read (the datetime is made only for the rows that use it: stored_at).
    stored: datetime | int
    subject: str
    data: bytes

    @property
    def stored_at(self) -> datetime:
        stored = self.stored
        if isinstance(stored, int):
            return _EPOCH + timedelta(0, 0, stored // 1000)
        return stored


def sha256_of(value: Any) -> str:
    return hashlib.sha256(canonical_json(value)).hexdigest()


def clamp_time(value: datetime) -> datetime:
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return min(max(value, _MIN_TIME), _MAX_TIME)


def to_micros(value: datetime) -> int:
    """Microseconds since the epoch; a naive datetime (as read back) is UTC. (A timedelta
    division: exact, and several times cheaper per row than calendar.timegm.)"""
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    return (value - _EPOCH) // _MICROSECOND


def _fingerprint(data: bytes) -> dict[str, Any]:
    """What the audit keeps of a message it could not decode: its size and SHA-256."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


class RowBuilder:
    """Builds rows with the registry's audit metadata (unknown tools: kept in full)."""

    def __init__(self, registry: Registry, max_call_bytes: int = 1024 * 1024) -> None:
        self.registry = registry
        self.max_call_bytes = max_call_bytes
        self._rules: dict[str, tuple[AuditSpec, str, bool]] = {}  # tool -> _rule's
        self._senders: dict[str, tuple[str, str] | None] = {}  # subject -> _sender's

    def audit_of(self, tool: str) -> AuditSpec:
        """The registry's rule for `tool`; a name it does not know is kept as `hash` (a
        secret meant for a guarded tool may come under a misspelt name). An event of no
        tool (a dead letter, a malformed call) carries no arguments to keep."""
        return self._rule(tool)[0]

    def risk_of(self, tool: str) -> str:
        return self._rule(tool)[1]

    def _rule(self, tool: str) -> tuple[AuditSpec, str, bool]:
        """(audit, risk, kept in full) of `tool`, looked up in the registry once per name."""
        rule = self._rules.get(tool)
        if rule is None:
            spec = self.registry.get(tool)
            if not tool:
                audit = NO_TOOL_AUDIT
            else:
                audit = spec.audit if spec is not None else UNKNOWN_TOOL_AUDIT
            full = (audit.arguments, audit.result) == ("full", "full")
            rule = (audit, spec.risk if spec is not None else "", full)
            if len(self._rules) < MAX_REMEMBERED_TOOLS:
                self._rules[tool] = rule
        return rule

    def row_for(self, message: StoredMessage) -> dict[str, Any]:
        if message.stream == CALLS_STREAM:
            return self.call_row(message)
        return self.event_row(message)

    def fallback_row(self, message: StoredMessage, exc: Exception) -> dict[str, Any]:
        """A row for a message the builder failed on: recorded, never skipped."""
        row = self._blank(message, derive_id(message, "unrecorded"), UNDECODABLE_EVENT)
        row["note"] = f"audit row could not be built: {exc!r}"
        row["payload"] = {"subject": message.subject, "bytes": len(message.data)}
        return self._finish(row)

    # -- the raw call -----------------------------------------------------------------
    def call_row(self, message: StoredMessage) -> dict[str, Any]:
        # The usual call (under its sender's subject, decodable, naming its sender, with
        # a subject-safe id) is made in one go; anything else by _call_row_apart.
        data = message.data
        sender = self._sender(message.subject)
        if sender is None or len(data) > self.max_call_bytes:
            return self._call_row_apart(message)
        try:
            call = _call_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return self._call_row_apart(message)
        principal = call.principal
        if (principal.tenant, principal.agent) != sender or not is_valid_call_id(call.call_id):
            return self._call_row_apart(message)
        tool = call.tool
        audit, risk, _ = self._rule(tool)
        if audit.arguments == "full":  # nothing to redact: keep the bytes as published
            payload: Any = '{"call":' + data.decode() + "}"
        else:
            payload = {"call": self._redacted_call(call, audit)}
        at = message.stored_at
        if at.tzinfo is None or not _MIN_TIME <= at <= _MAX_TIME:
            at = clamp_time(at)
        row = {
            "event_id": derive_id(message, "requested"),
            "call_id": call.call_id,
            "event_type": CALL_REQUESTED,
            "occurred_at": at,
            "service": "agent",
            "tenant": sender[0],
            "user": principal.user,
            "agent": sender[1],
            "session": principal.session,
            "task_id": call.task_id or "",
            "tool": tool,
            "risk": risk,
            "decision": "",
            "status": "",
            "error_code": "",
            "arguments_sha256": (
                "" if audit.arguments == "none" else arguments_sha256(call.arguments)
            ),
            "result_sha256": "",
            "policy_version": "",
            "approver": "",
            "duration_ms": None,
            "note": "",
            "payload": payload,
            "source_stream": message.stream,
            "source_seq": message.sequence,
        }
        if payload.__class__ is str and len(payload) <= MAX_PAYLOAD_CHARS:
            return row
        return self._finish(row)

    def _sender(self, subject: str) -> tuple[str, str] | None:
        """(tenant, agent) of a calls subject, or None; parsed once per subject."""
        senders = self._senders
        if subject in senders:
            return senders[subject]
        sender = identity_of_calls_subject(subject)
        if len(senders) < MAX_REMEMBERED_SUBJECTS:
            senders[subject] = sender
        return sender

    def _call_row_apart(self, message: StoredMessage) -> dict[str, Any]:
        """A raw call's row, whatever the call: each odd case noted."""
        row = self._blank(message, derive_id(message, "requested"), CALL_REQUESTED)
        row["service"] = "agent"
        sender = self._sender(message.subject)
        if sender is not None:
            row["tenant"], row["agent"] = sender
        else:
            row["note"] = f"not stored under an agent's calls subject: {message.subject[:200]}"
        if len(message.data) > self.max_call_bytes:
            _add_note(row, f"oversized call: {len(message.data)} bytes, kept as its SHA-256")
            row["payload"] = _fingerprint(message.data)
            return self._finish(row)
        try:
            call = _call_decoder.decode(message.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._finish(self._undecodable_call(row, message, exc))
        if not is_valid_call_id(call.call_id):
            _add_note(row, "call_id is not a subject-safe token")
        else:
            row["call_id"] = call.call_id
        self._principal(row, call, sender)
        audit = self.audit_of(call.tool)
        if audit.arguments != "none":
            row["arguments_sha256"] = arguments_sha256(call.arguments)
        if audit.arguments == "full":  # nothing to redact: keep the bytes as published
            row["payload"] = '{"call":' + message.data.decode() + "}"
        else:
            row["payload"] = {"call": self._redacted_call(call, audit)}
        return self._finish(row)

    def _undecodable_call(
        self, row: dict[str, Any], message: StoredMessage, exc: Exception
    ) -> dict[str, Any]:
        _add_note(row, f"not a decodable ToolCall: {exc}")
        # Recover what names the call, for queries by call_id or tool.
        try:
            loose = msgspec.json.decode(message.data)
        except msgspec.DecodeError:
            loose = None
        if isinstance(loose, dict):
            if is_valid_call_id(loose.get("call_id")):
                row["call_id"] = loose["call_id"]
            if isinstance(loose.get("tool"), str):
                row["tool"] = loose["tool"][:128]
        row["payload"] = _fingerprint(message.data)
        return row

    def _redacted_call(self, call: ToolCall, audit: AuditSpec) -> dict[str, Any]:
        document = msgspec.to_builtins(call)
        document["arguments"] = _redact(call.arguments, audit.arguments)
        return document

    # -- events -----------------------------------------------------------------------
    def event_row(self, message: StoredMessage) -> dict[str, Any]:
        try:
            event = ev.decode_event(message.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            row = self._blank(message, derive_id(message, "undecodable"), UNDECODABLE_EVENT)
            row["note"] = f"not a decodable event: {exc}"
            row["payload"] = {"subject": message.subject, **_fingerprint(message.data)}
            return self._finish(row)
        # Most rows are events, so this is the sink's hottest path: what a type of event
        # carries is looked up once per type (_EventShape), and the row is made in one go.
        shape = _shape_of(event.__class__)
        tenant = user = agent = session = ""
        principal = event.principal
        if principal is not None:
            tenant, user, agent = principal.tenant, principal.user, principal.agent
            session = principal.session
        elif shape.dead_letter:
            # A call that could not be read still names its sender: the subject it came on.
            sender = self._sender(event.source_subject)  # type: ignore[attr-defined]
            if sender is not None:
                tenant, agent = sender
        status, error_code, policy_version, approver, duration = shape.columns(event)
        tool = event.tool
        audit, risk, full = self._rule(tool)
        result_sha256 = ""
        if shape.output is not None and audit.result != "none":
            output = shape.output(event)
            if output is not _MISSING:
                result_sha256 = sha256_of(output)
        # An excerpt (events of older versions had them) is never quoted.
        if full and not (shape.excerpt and event.payload_excerpt):  # type: ignore[attr-defined]
            payload: Any = message.data.decode()  # nothing to redact: the event as emitted
        else:
            payload = self._redacted_event(event, audit)
            if shape.dead_letter:
                payload["payload_excerpt"] = REDACTED
        at = event.occurred_at
        if at.tzinfo is None or not _MIN_TIME <= at <= _MAX_TIME:
            at = clamp_time(at)
        row = {
            "event_id": event.event_id,
            "call_id": event.call_id,
            "event_type": shape.name,
            "occurred_at": at,
            "service": event.service,
            "tenant": tenant,
            "user": user,
            "agent": agent,
            "session": session,
            "task_id": event.task_id or "",
            "tool": tool,
            "risk": risk,
            "decision": shape.decision,
            "status": status,
            "error_code": error_code,
            "arguments_sha256": ("" if audit.arguments == "none" else event.arguments_sha256 or ""),
            "result_sha256": result_sha256,
            "policy_version": policy_version,
            "approver": approver,
            "duration_ms": duration,
            "note": "",
            "payload": payload,
            "source_stream": message.stream,
            "source_seq": message.sequence,
        }
        if payload.__class__ is str and len(payload) <= MAX_PAYLOAD_CHARS:
            return row
        return self._finish(row)

    def _redacted_event(self, event: ev.Event, audit: AuditSpec) -> dict[str, Any]:
        document: dict[str, Any] = msgspec.to_builtins(event)
        call = getattr(event, "call", None)
        if isinstance(call, ToolCall):
            document["call"]["arguments"] = _redact(call.arguments, audit.arguments)
        if audit.arguments == "none":
            document["arguments_sha256"] = None
            if "authorization" in document:
                document["authorization"]["arguments_sha256"] = ""
        if audit.arguments != "full":
            # Every message may quote an argument (a schema error quotes the value, a tool's
            # exception its input, a resource id comes from the arguments): codes, paths
            # and flags stay, the text goes.
            _redact_error(document.get("error"))
            for key in ("reason", "message"):
                if isinstance(document.get(key), str) and document[key]:
                    document[key] = REDACTED
            if "payload_excerpt" in document:
                document["payload_excerpt"] = REDACTED
            for seen in document.get("resources") or []:
                seen["id"] = _redact(seen.get("id"), audit.arguments)
                seen["attributes"] = _redact(seen.get("attributes"), audit.arguments)
                if seen.get("error"):
                    seen["error"] = REDACTED
        if isinstance(event, ev.ExecutionSucceeded):
            document["output"] = _redact(event.output, audit.result)
        elif isinstance(event, ev.ResultAttached) and event.result.ok:
            document["result"]["data"] = _redact(event.result.data, audit.result)
        if isinstance(event, ev.ResultAttached) and (audit.arguments, audit.result) != (
            "full",
            "full",
        ):
            _redact_error(document["result"].get("error"))
        if isinstance(event, ev.ExecutionFailed | ev.ExecutionSucceeded) and audit.result != "full":
            _redact_error(document.get("error"))
        return document

    # -- common -----------------------------------------------------------------------
    def _principal(
        self, row: dict[str, Any], call: ToolCall, sender: tuple[str, str] | None
    ) -> None:
        """Tenant and agent from the bus; user and session are the platform's word."""
        principal = call.principal
        row.update(
            tool=call.tool,
            task_id=call.task_id or "",
            user=principal.user,
            session=principal.session,
        )
        claimed = (principal.tenant, principal.agent)
        if sender is None:
            row["tenant"], row["agent"] = claimed
        elif claimed != sender:
            _add_note(
                row,
                f"the payload names tenant {principal.tenant[:64]!r} and agent "
                f"{principal.agent[:64]!r}; sent by {sender[0]}.{sender[1]}",
            )

    def _blank(self, message: StoredMessage, event_id: str, event_type: str) -> dict[str, Any]:
        row = _BLANK_ROW.copy()
        row["event_id"] = event_id
        row["event_type"] = event_type
        row["occurred_at"] = message.stored_at
        row["source_stream"] = message.stream
        row["source_seq"] = message.sequence
        return row

    def _finish(self, row: dict[str, Any]) -> dict[str, Any]:
        row["occurred_at"] = clamp_time(row["occurred_at"])
        row["risk"] = self.risk_of(row["tool"])
        payload = row["payload"]
        text = payload if isinstance(payload, str) else canonical_json(payload).decode()
        if len(text) > MAX_PAYLOAD_CHARS:
            _add_note(row, "payload truncated")
            text = canonical_json(
                {
                    "truncated": True,
                    "chars": len(text),
                    "sha256": hashlib.sha256(text.encode()).hexdigest(),
                    "excerpt": text[:EXCERPT_CHARS],
                }
            ).decode()
        row["payload"] = text
        return row


_MISSING = object()


class _EventShape:
    """What one type of event carries into its row's columns, found once per type (a
    getattr of a field the type lacks costs an exception, and most types lack most)."""

    def __init__(self, kind: type[ev.Event]) -> None:
        fields = set(kind.__struct_fields__)
        self.name = kind.__name__
        self.decision = _DECISIONS.get(kind, "")
        self.dead_letter = issubclass(kind, ev.MessageDeadLettered)
        self.excerpt = "payload_excerpt" in fields
        self._succeeded = issubclass(kind, ev.ExecutionSucceeded)
        self._result = issubclass(kind, ev.ResultAttached)
        # What the tool returned, for the types that may carry it.
        self.output: Callable[[Any], Any] | None = (
            _output_of if self._succeeded or self._result else None
        )
        self._status = "status" in fields
        self._error = "error" in fields
        self._policy_version = "policy_version" in fields
        self._approver = "approver" in fields
        self._duration = "duration_ms" in fields

    def columns(self, event: Any) -> tuple[str, str, str, str, float | None]:
        """(status, error_code, policy_version, approver, duration_ms) of `event`."""
        status = event.status if self._status else ""
        error = event.error if self._error else None
        if self._succeeded:
            status = "ok"
        if self._result:
            status, error = event.result.status, event.result.error
        duration = event.duration_ms if self._duration else None
        return (
            status or "",
            error.code if error is not None else "",
            (event.policy_version if self._policy_version else "") or "",
            (event.approver if self._approver else "") or "",
            float(duration) if duration is not None else None,
        )


_SHAPES: dict[type[ev.Event], _EventShape] = {}


def _shape_of(kind: type[ev.Event]) -> _EventShape:
    shape = _SHAPES.get(kind)
    if shape is None:
        shape = _SHAPES[kind] = _EventShape(kind)
    return shape


_BLANK_ROW: dict[str, Any] = dict.fromkeys(CONTENT_COLUMNS, "") | {"duration_ms": None}


def _add_note(row: dict[str, Any], text: str) -> None:
    row["note"] = f"{row['note']}; {text}" if row["note"] else text


def _output_of(event: ev.Event) -> Any:
    """What the tool returned, if this event carries it (a failed result carries none)."""
    if isinstance(event, ev.ExecutionSucceeded):
        return event.output
    if isinstance(event, ev.ResultAttached) and event.result.ok:
        return event.result.data
    return _MISSING


def derive_id(message: StoredMessage, kind: str) -> str:
    """An event_id for a row the sink makes itself: the same stored message, the same id."""
    return ev.derive_event_id(f"{message.stream}:{message.sequence}", kind)


def _redact(value: Any, mode: str) -> Any:
    if mode == "full":
        return value
    if mode == "hash":
        return {"redacted": "hash", "sha256": sha256_of(value)}
    return {"redacted": "none"}


def _redact_error(error: Any) -> None:
    """Error messages quote the offending value: keep the code and the paths, drop the text."""
    if isinstance(error, dict):
        if error.get("message"):
            error["message"] = REDACTED
        for detail in error.get("details") or []:
            if isinstance(detail, dict):
                detail["message"] = REDACTED


__all__ = ["CALLS_STREAM", "EVENTS_STREAM", "RowBuilder", "StoredMessage", "to_micros"]
