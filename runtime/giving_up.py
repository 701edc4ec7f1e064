"""What a stage does when it gives up on a message: a dead letter with the reason, and
the end of the call the message names (a CallAbandoned the attacher answers)."""

from __future__ import annotations

import logging
from typing import Any

import msgspec

from toolgate.contracts.calls import ErrorCode, Principal, ToolError
from toolgate.contracts.events import (
    CallAbandoned,
    MessageDeadLettered,
    carried_fields,
    decode_event,
    derive_event_id,
    payload_sha256,
    utc_now,
)
from toolgate.runtime.publishing import Publisher
from toolgate.runtime.settling import FAILURES, Delivery

log = logging.getLogger("toolgate")


# Stages that act before the tool runs: when one of them gives up, the tool did not run.
BEFORE_EXECUTION = frozenset({"validator", "policy", "approvals"})


def dead_letter(
    service: str, delivery: Delivery, raw: bytes, exc: Exception, call_id: str = ""
) -> MessageDeadLettered:
    attempts = max(FAILURES.of(delivery), 1)
    return MessageDeadLettered(
        event_id=derive_event_id(delivery.message_id, f"{service}/gave-up"),
        occurred_at=utc_now(),
        service=service,
        call_id=call_id,
        reason=f"{service} gave up after {attempts} failed attempt(s) "
        f"(delivery {delivery.attempt}): {exc!r}",
        source_subject=delivery.subject,
        payload_bytes=len(raw),
        payload_sha256=payload_sha256(raw),
    )


def abandoned(
    service: str,
    delivery: Delivery,
    raw: bytes,
    call: dict[str, Any] | None = None,
) -> CallAbandoned | None:
    """The end of the call whose message `service` gave up on, if the message names one.

    `call`: the call's event fields (`call_fields`/`carried_fields`) where the
    stage knows them otherwise (the validator's input is a ToolCall); else they
    are read from `raw` as an event. None if no call (call_id and principal) is
    named, or if the message is itself a CallAbandoned: giving up on the end of a
    call never ends it again.
    """
    if call is None:
        try:
            event = decode_event(raw)
        except Exception:
            return None
        if isinstance(event, CallAbandoned):
            return None
        call = carried_fields(event)
    call_id, principal = call.get("call_id"), call.get("principal")
    if not call_id or not isinstance(principal, Principal):
        return None
    attempts = f"after {max(FAILURES.of(delivery), 1)} failed attempt(s)"
    if service in BEFORE_EXECUTION:
        message = (
            f"the gateway's {service} gave up on this call {attempts}; the tool did not run. "
            "Send the call again under a new call_id."
        )
    elif service == "executor":
        message = (
            f"the gateway's executor gave up on this call {attempts}; whether the tool ran "
            "is not known (an operator can see in the audit: toolgate audit trace CALL_ID)."
        )
    else:
        message = (
            f"the gateway's {service} gave up on this call {attempts}; its outcome is in "
            "the audit, but no result could be formed from it."
        )
    return CallAbandoned(
        event_id=derive_event_id(delivery.message_id, f"{service}/abandoned"),
        occurred_at=utc_now(),
        service=service,
        status="execution_error",
        error=ToolError(
            code=ErrorCode.GATEWAY_GAVE_UP,
            message=message,
            retryable=service in BEFORE_EXECUTION,
        ),
        **call,
    )


async def give_up_on(
    publisher: Publisher,
    service: str,
    delivery: Delivery,
    raw: bytes,
    exc: Exception,
    call: dict[str, Any] | None = None,
    end_call: bool = True,
) -> None:
    """What a stage does when it gives up on a message: record it for an operator (a
    dead letter with the reason), and end the call it names in an error result (a
    CallAbandoned the attacher answers), so no agent waits for a result that never comes.

    `end_call=False`: something else will still end the call (a stored approval the
    approvers or the sweeper close); ending it here could let it run after the agent
    was told it did not."""
    end = abandoned(service, delivery, raw, call)
    letter = dead_letter(service, delivery, raw, exc)
    if end is not None:  # the audit files the dead letter under the call, and its sender
        letter = msgspec.structs.replace(letter, **carried_fields(end))
    await publisher.emit(letter)
    if end is not None and end_call:
        await publisher.emit(end)
