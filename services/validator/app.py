"""The validator service.

Consumes: `toolgate.calls` (raw `ToolCall` JSON from agents), durable `validator`.
Emits: `ArgumentsValidated` (to policy), `ArgumentsRejected` (to the attacher:
unknown tool, malformed call, bad arguments, oversized call), and
`MessageDeadLettered` for a message with no usable call_id.
"""

from __future__ import annotations

from faststream import FastStream
from faststream.nats.message import NatsMessage

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.events import (
    ArgumentsRejected,
    ArgumentsValidated,
    Event,
    MessageDeadLettered,
    call_fields,
    derive_event_id,
    utc_now,
)
from toolgate.services import bus
from toolgate.services.settings import GatewaySettings
from toolgate.services.validator.logic import CallChecker, CheckOutcome, Rejected, Validated

SERVICE = "validator"
EXCERPT_BYTES = 512


def events_for(outcome: CheckOutcome, raw: bytes, delivery: bus.Delivery) -> list[Event]:
    def eid(kind: str) -> str:
        return derive_event_id(delivery.message_id, kind)

    now = utc_now()
    if isinstance(outcome, Validated):
        call = outcome.call
        return [ArgumentsValidated(
            event_id=eid("validated"), occurred_at=now, service=SERVICE, call=call,
            arguments_sha256=arguments_sha256(call.arguments), **call_fields(call))]
    events: list[Event] = []
    reason = outcome.dead_letter_reason if isinstance(outcome, Rejected) else outcome.reason
    call_id = outcome.call_id if isinstance(outcome, Rejected) else ""
    if reason:
        events.append(MessageDeadLettered(
            event_id=eid("dead-letter"), occurred_at=now, service=SERVICE, call_id=call_id,
            reason=reason, source_subject=delivery.subject,
            payload_excerpt=raw[:EXCERPT_BYTES].decode("utf-8", "replace"),
            payload_bytes=len(raw)))
    if isinstance(outcome, Rejected):
        fields = call_fields(outcome.call) if outcome.call else {"call_id": outcome.call_id}
        events.append(ArgumentsRejected(
            event_id=eid("rejected"), occurred_at=now, service=SERVICE,
            status=outcome.status, error=outcome.error, **fields))
    return events


def build_app(settings: GatewaySettings) -> FastStream:
    checker = CallChecker(settings.load_registry(), settings.max_call_bytes)
    broker = bus.make_broker(settings.nats_url, bus.worker_name(SERVICE), settings.nats_creds)
    publisher = bus.Publisher(broker)

    @bus.durable_subscriber(broker, subjects.CALLS, subjects.CALLS_STREAM, SERVICE)
    async def on_call(msg: NatsMessage) -> None:
        delivery = bus.delivery_of(msg)
        raw: bytes = msg.body

        async def work() -> None:
            for event in events_for(checker.check(raw), raw, delivery):
                await publisher.emit(event)

        async def give_up(exc: Exception) -> None:
            await publisher.emit(bus.dead_letter(SERVICE, delivery, raw, exc))

        await bus.settle(msg, delivery, work, give_up)

    return FastStream(broker)
