"""Which call a log line concerns: call_id, tenant and agent on every line logged while
a stage handles a call's message.

The bus sets the call (`handling`) in the task that handles one message, before the
handler runs; a context variable, so each message's task sees its own and every line
logged under it (the handler's, the bus's retries and give-ups, a tool's) carries it.
`CallLogFilter`, on a service's log handlers, puts it on each record (`call_id`,
`tenant`, `agent`, and `call`: "tenant=… agent=… call_id=… " or "") for the format.
The values come from agents: they are shown escaped, as every outside text is.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

import msgspec

from toolgate.contracts.subjects import identity_of_calls_subject
from toolgate.runtime.outside_text import visible


class CallMark(msgspec.Struct, frozen=True):
    call_id: str
    tenant: str
    agent: str


class _Principal(msgspec.Struct):
    tenant: str = ""
    agent: str = ""


class _Named(msgspec.Struct):
    """The fields of a call or of any event that name the call (all others skipped)."""

    call_id: str = ""
    principal: _Principal | None = None


# A service's log format (`toolgate serve`): the call, when there is one, before the message.
SERVICE_LOG_FORMAT = "%(asctime)s {service} %(levelname)s %(call)s%(message)s"

_peek = msgspec.json.Decoder(_Named)


class _Unread(msgspec.Struct):
    """A message whose call is read only when a line is logged (most messages log none:
    decoding every one on the hot path was 3.4% of the executor's CPU, profiled)."""

    subject: str
    data: bytes


_current: ContextVar[CallMark | _Unread | None] = ContextVar("toolgate_call", default=None)


def call_of_message(subject: str, data: bytes) -> CallMark | None:
    """The call a message (a ToolCall, or an event of a call) names; None if none."""
    try:
        named = _peek.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        # A nesting bomb raises RecursionError even though the fields are skipped: the
        # line names no call, and the stage's own check answers the message.
        return None
    if not named.call_id:
        return None
    # A call's own subject says who sent it (its principal is only the agent's word).
    identity = identity_of_calls_subject(subject)
    if identity is None and named.principal is not None:
        identity = (named.principal.tenant, named.principal.agent)
    tenant, agent = identity or ("", "")
    return CallMark(named.call_id, tenant, agent)


def handling(call: CallMark | None) -> None:
    """From now on in this task (and the tasks it starts), log lines concern `call`."""
    _current.set(call)


def handling_message(subject: str, data: bytes) -> None:
    """From now on in this task, log lines concern the call this message names; it is
    read (`call_of_message`) at the first line logged, not before."""
    _current.set(_Unread(subject, data))


def current_call() -> CallMark | None:
    found = _current.get()
    if isinstance(found, _Unread):
        found = call_of_message(found.subject, found.data)
        _current.set(found)  # read once per task (a task started meanwhile reads its own)
    return found


class CallLogFilter(logging.Filter):
    """Adds the call being handled to each record: `call_id`, `tenant`, `agent`, `call`."""

    def filter(self, record: logging.LogRecord) -> bool:
        call = current_call()
        if call is None:
            record.__dict__.update(call_id="", tenant="", agent="", call="")
            return True
        call_id, tenant, agent = visible(call.call_id), visible(call.tenant), visible(call.agent)
        record.__dict__.update(
            call_id=call_id,
            tenant=tenant,
            agent=agent,
            call=f"tenant={tenant} agent={agent} call_id={call_id} ",
        )
        return True


def log_calls(logger: logging.Logger | None = None) -> None:
    """Put the call on every record of `logger`'s handlers (the root logger's by default)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, CallLogFilter) for f in handler.filters):
            handler.addFilter(CallLogFilter())
