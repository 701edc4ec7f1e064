"""When a stage gives up on a message: which errors it never gives up on, and how the
call it names still ends in a result (runtime/bus.py `settle`, `abandoned`).

`settle` decides from what JetStream says of the delivery and what `work`
raised; the message here is a recorder of the ack it gets (the same calls on a
real server are covered by tests/system/test_faults.py).
"""

from __future__ import annotations

from typing import Any

import nats.errors
import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from toolgate.contracts.calls import ErrorCode, Principal, ToolCall, ToolError
from toolgate.contracts.events import (
    ArgumentsValidated,
    CallAbandoned,
    CallDenied,
    MessageDeadLettered,
    call_fields,
    decode_event,
    encode_event,
    utc_now,
)
from toolgate.contracts.registry import load_registry
from toolgate.runtime import bus
from toolgate.services.attacher.logic import ResultBuilder
from toolgate.services.audit.trace import STAGE, describe

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
CALL = ToolCall(call_id="c-give-up", tool="echo", arguments={"payload": 1}, principal=BOB)


class AckRecorder:
    """What `settle` did with the message: ack, nak (with its delay) or term."""

    def __init__(self) -> None:
        self.acks: list[tuple[str, float | None]] = []

    async def ack(self) -> None:
        self.acks.append(("ack", None))

    async def nak(self, delay: float | None = None) -> None:
        self.acks.append(("nak", delay))

    async def term(self) -> None:
        self.acks.append(("term", None))


def delivery(attempt: int) -> bus.Delivery:
    return bus.Delivery(
        stream_sequence=41, attempt=attempt, subject="toolgate.evt.ArgumentsValidated.echo"
    )


async def settle_failing(exc: Exception, attempt: int) -> tuple[AckRecorder, list[Exception]]:
    msg, given_up = AckRecorder(), []

    async def work() -> None:
        raise exc

    async def give_up(reason: Exception) -> None:
        given_up.append(reason)

    await bus.settle(msg, delivery(attempt), work, give_up)  # type: ignore[arg-type]
    return msg, given_up


def validated() -> ArgumentsValidated:
    return ArgumentsValidated(
        event_id="e-validated",
        occurred_at=utc_now(),
        service="validator",
        call=CALL,
        arguments_sha256="0" * 64,
        **call_fields(CALL),
    )


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionClosedError(),
        ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable"),
    ],
)
async def test_an_unanswering_bus_is_retried_past_the_last_attempt(exc: Exception) -> None:
    assert bus.is_transient(exc)
    msg, given_up = await settle_failing(exc, bus.MAX_ATTEMPTS + 3)
    assert given_up == []
    assert msg.acks == [("nak", bus.retry_delay(bus.MAX_ATTEMPTS + 3))]


@pytest.mark.parametrize(
    "exc", [ValueError("bad"), TypeError("expected X"), APIError(code=400, err_code=10999)]
)
async def test_other_errors_are_given_up_on_at_the_last_attempt(exc: Exception) -> None:
    assert not bus.is_transient(exc)
    msg, given_up = await settle_failing(exc, bus.MAX_ATTEMPTS - 1)
    assert given_up == [] and msg.acks == [("nak", bus.retry_delay(bus.MAX_ATTEMPTS - 1))]
    msg, given_up = await settle_failing(exc, bus.MAX_ATTEMPTS)
    assert given_up == [exc] and msg.acks == [("term", None)]


async def test_a_give_up_that_fails_keeps_the_message() -> None:
    msg = AckRecorder()

    async def work() -> None:
        raise ValueError("bad")

    async def give_up(reason: Exception) -> None:
        raise nats.errors.TimeoutError()

    await bus.settle(msg, delivery(bus.MAX_ATTEMPTS), work, give_up)  # type: ignore[arg-type]
    assert [kind for kind, _ in msg.acks] == ["nak"]


def test_the_back_off_is_capped() -> None:
    assert bus.retry_delay(1) == 0.5
    assert bus.retry_delay(50) == 15.0


@pytest.mark.parametrize(
    ("service", "retryable", "words"),
    [
        ("policy", True, "the tool did not run"),
        ("executor", False, "whether the tool ran is not known"),
        ("attacher", False, "no result could be formed"),
    ],
)
def test_a_given_up_event_ends_its_call(service: str, retryable: bool, words: str) -> None:
    raw = encode_event(validated())
    end = bus.abandoned(service, delivery(bus.MAX_ATTEMPTS), raw)
    assert isinstance(end, CallAbandoned)
    assert (end.call_id, end.principal, end.tool) == (CALL.call_id, BOB, "echo")
    assert end.status == "execution_error"
    assert end.error.code == ErrorCode.GATEWAY_GAVE_UP
    assert end.error.retryable is retryable and words in end.error.message
    # A redelivery of the same stored message gives the same event: deduplicated.
    again = bus.abandoned(service, delivery(bus.MAX_ATTEMPTS + 1), raw)
    assert again is not None and again.event_id == end.event_id
    # And it decodes as what the attacher consumes.
    assert decode_event(encode_event(end)) == end


def test_nothing_ends_a_call_the_message_does_not_name() -> None:
    at = delivery(bus.MAX_ATTEMPTS)
    assert bus.abandoned("policy", at, b"not json at all") is None
    no_principal = CallDenied(
        event_id="e-denied",
        call_id="c-1",
        occurred_at=utc_now(),
        service="policy",
        status="denied",
        error=ToolError(code="POLICY_DENIED", message="no"),
    )
    assert bus.abandoned("attacher", at, encode_event(no_principal)) is None
    assert bus.abandoned("validator", at, b"{}", call={}) is None
    named = bus.abandoned("validator", at, b"{}", call={"call_id": "c-2", "principal": BOB})
    assert named is not None and named.call_id == "c-2" and named.error.retryable


def test_giving_up_on_an_abandoned_call_does_not_abandon_it_again() -> None:
    end = bus.abandoned("policy", delivery(bus.MAX_ATTEMPTS), encode_event(validated()))
    assert end is not None
    assert bus.abandoned("attacher", delivery(bus.MAX_ATTEMPTS), encode_event(end)) is None


class EmitRecorder:
    def __init__(self) -> None:
        self.emitted: list[Any] = []

    async def emit(self, event: Any) -> None:
        self.emitted.append(event)


async def test_give_up_records_the_dead_letter_under_the_call_then_ends_it() -> None:
    publisher = EmitRecorder()
    raw = encode_event(validated())
    at = delivery(bus.MAX_ATTEMPTS)
    await bus.give_up_on(publisher, "policy", at, raw, TypeError("boom"))  # type: ignore[arg-type]
    letter, end = publisher.emitted
    assert isinstance(letter, MessageDeadLettered) and isinstance(end, CallAbandoned)
    assert "policy gave up after 5 attempts: TypeError('boom')" == letter.reason
    assert (letter.call_id, letter.principal, letter.tool) == (CALL.call_id, BOB, "echo")
    # The agent reads the end of its call, not the internals of the failure.
    assert "boom" not in end.error.message


def test_the_attacher_answers_an_abandoned_call_with_its_error() -> None:
    end = bus.abandoned("executor", delivery(bus.MAX_ATTEMPTS), encode_event(validated()))
    assert end is not None
    result = ResultBuilder(load_registry()).result_for(end)
    assert (result.call_id, result.ok, result.status) == (CALL.call_id, False, "execution_error")
    assert result.error == end.error


def test_the_audit_trace_tells_who_gave_up_and_what_the_agent_was_told() -> None:
    end = bus.abandoned("executor", delivery(bus.MAX_ATTEMPTS), encode_event(validated()))
    assert end is not None
    row = {
        "event_type": "CallAbandoned",
        "service": "executor",
        "payload": encode_event(end).decode(),
        "policy_version": "",
        "note": "",
    }
    (line,) = describe(row)
    assert line.startswith("executor gave up on the call: ")
    assert end.error.message in line
    assert STAGE["CallAbandoned"] == STAGE["ExecutionFailed"]
