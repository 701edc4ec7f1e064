"""The attacher service: every call ends here in exactly one ToolResult.

Consumes: the terminal events `ArgumentsRejected`, `CallDenied`,
`ApprovalDenied`, `ApprovalExpired`, `ExecutionSucceeded`, `ExecutionFailed`
and `CallAbandoned` (a stage gave up on the call), one durable each.
Emits: the `ToolResult` on `toolgate.results.<tenant>.<agent>.<call_id>`
(results stream, written once: a call's first result is never replaced) and
`ResultAttached` for the audit.
"""

from __future__ import annotations

import logging

from faststream import FastStream
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.events import (
    TERMINAL_EVENTS,
    ResultAttached,
    carried_fields,
    decode_event,
    derive_event_id,
    utc_now,
)
from toolgate.runtime import bus
from toolgate.runtime.settings import GatewaySettings
from toolgate.services.attacher.logic import ResultBuilder

SERVICE = "attacher"
log = logging.getLogger("toolgate.attacher")


def build_app(settings: GatewaySettings) -> FastStream:
    builder = ResultBuilder(settings.load_registry())
    broker = bus.make_broker(settings.nats_url, bus.worker_name(SERVICE), settings.nats_creds)
    publisher = bus.Publisher(broker)

    async def on_terminal(msg: Msg) -> None:
        """One handler body for every terminal event type."""
        delivery = bus.delivery_of(msg)

        async def work() -> None:
            event = decode_event(msg.data)
            if event.principal is None:
                raise ValueError(f"{type(event).__name__} has no principal: no result subject")
            result = builder.result_for(event)
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

    app = FastStream(broker)
    bus.run_consumers(app, broker)
    return app
