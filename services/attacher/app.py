"""The attacher service: every call ends here in exactly one ToolResult.

Consumes: the terminal events `ArgumentsRejected`, `CallDenied`,
`ApprovalDenied`, `ApprovalExpired`, `ExecutionSucceeded`, `ExecutionFailed`
and `CallAbandoned` (a stage gave up on the call), one durable each; and
`CallRetried` (an agent published a call_id again).
Emits: the `ToolResult` on `toolgate.results.<tenant>.<agent>.<call_id>`
(results stream, written once: a call's first result is never replaced) and
`ResultAttached` for the audit. For a retried call: the stored result (or
pending notice) again, the same bytes, as a plain publish on its subject (the
stream, one message per subject, stores nothing new) so that a retry which
subscribed is answered; nothing new is stored or emitted.
"""

from __future__ import annotations

import logging

from faststream import FastStream
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.events import (
    TERMINAL_EVENTS,
    CallRetried,
    ResultAttached,
    carried_fields,
    decode_event,
    derive_event_id,
    utc_now,
)
from toolgate.runtime import bus
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.services.attacher.logic import ResultBuilder

SERVICE = "attacher"
RETRIED_DURABLE = f"{SERVICE}-{CallRetried.__name__}"
ANSWERED_AGAIN = {
    "result": "its stored result sent again",
    "pending": "its pending notice sent again (the result follows when it lands)",
    "": "no answer stored yet (the result reaches the retry when it lands)",
}
log = logging.getLogger("toolgate.attacher")


def build_app(settings: GatewaySettings) -> FastStream:
    served = ServedRegistry(settings)  # the pushed registry, followed
    builder = served.derive(ResultBuilder)
    broker = bus.make_broker(settings.nats_url, bus.worker_name(SERVICE), settings.nats_creds)
    publisher = bus.Publisher(broker)

    async def on_terminal(msg: Msg) -> None:
        """One handler body for every terminal event type."""
        delivery = bus.delivery_of(msg)

        async def work() -> None:
            event = decode_event(msg.data)
            if event.principal is None:
                raise ValueError(f"{type(event).__name__} has no principal: no result subject")
            result = builder().result_for(event)
            attached_id = derive_event_id(event.event_id, "attached")
            if not await publisher.publish_result(result, event.principal, message_id=attached_id):
                log.warning(
                    "call %s: a result is already stored; %s not attached",
                    event.call_id,
                    type(event).__name__,
                )
                return
            await publisher.emit(
                ResultAttached(
                    event_id=attached_id,
                    occurred_at=utc_now(),
                    service=SERVICE,
                    result=result,
                    **carried_fields(event),
                )
            )

        async def give_up(exc: Exception) -> None:
            await bus.give_up_on(publisher, SERVICE, delivery, msg.data, exc)

        await bus.settle(msg, delivery, work, give_up)

    for event_type in TERMINAL_EVENTS:
        durable = f"{SERVICE}-{event_type.__name__}"
        source = subjects.event_filter(event_type)
        bus.durable_subscriber(broker, source, subjects.EVENTS_STREAM, durable)(on_terminal)

    @bus.durable_subscriber(
        broker, subjects.event_filter(CallRetried), subjects.EVENTS_STREAM, RETRIED_DURABLE
    )
    async def on_retried(msg: Msg) -> None:
        delivery = bus.delivery_of(msg)

        async def work() -> None:
            event = decode_event(msg.data)
            if not isinstance(event, CallRetried) or event.principal is None:
                raise ValueError(f"{type(event).__name__} on the retries' subject")
            sent = await publisher.answer_again(event.principal, event.call_id)
            log.info(
                "call %s of %s.%s retried: %s",
                event.call_id,
                event.principal.tenant,
                event.principal.agent,
                ANSWERED_AGAIN[sent],
            )

        async def give_up(exc: Exception) -> None:  # a retry it cannot answer: no call ends
            await bus.give_up_on(publisher, SERVICE, delivery, msg.data, exc, end_call=False)

        await bus.settle(msg, delivery, work, give_up)

    app = FastStream(broker)

    @app.on_startup
    async def follow_registry() -> None:
        await broker.connect()
        await start_registry(served, bus.jetstream(broker))

    @app.on_shutdown
    async def stop_following() -> None:
        await served.stop()

    bus.run_consumers(app, broker)
    return app
