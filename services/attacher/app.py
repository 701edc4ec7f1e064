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
subscribed is answered; nothing new is stored or emitted. A result and a notice
name the call they answer in their headers (tool, arguments_sha256): a "retry"
with another tool or other arguments is another call under a used call_id, and
is refused (CALL_ID_REUSED, published, not stored), never given the first one's
answer.
"""

from __future__ import annotations

import logging

from faststream import FastStream
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.calls import answer_headers
from toolgate.contracts.events import (
    CallRetried,
    ResultAttached,
    carried_fields,
    decode_event,
    derive_event_id,
    utc_now,
)
from toolgate.runtime import publishing, settling
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner
from toolgate.services.attacher.logic import ResultBuilder

SERVICE = "attacher"
ANSWERED_AGAIN = {
    "result": "its stored result sent again",
    "pending": "its pending notice sent again (the result follows when it lands)",
    "": "no answer stored yet (the result reaches the retry when it lands)",
    "refused": "refused: its call_id names another call (another tool or other arguments)",
    "another": "nothing sent: its call_id names another call, which has no result yet",
}
log = logging.getLogger("toolgate.attacher")


def build_app(settings: GatewaySettings) -> FastStream:
    served = ServedRegistry(settings)  # the pushed registry, followed
    builder = served.derive(ResultBuilder)
    runner = StageRunner(SERVICE, settings)
    publisher = runner.publisher

    async def on_terminal(msg: Msg, delivery: settling.Delivery) -> None:
        """One handler body for every terminal event type."""
        event = decode_event(msg.data)
        if event.principal is None:
            raise ValueError(f"{type(event).__name__} has no principal: no result subject")
        result = builder().result_for(event)
        attached_id = derive_event_id(event.event_id, "attached")
        answers = answer_headers(event.tool, event.arguments_sha256)
        if not await publisher.publish_result(result, event.principal, attached_id, answers):
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

    async def on_retried(msg: Msg, delivery: settling.Delivery) -> None:
        event = decode_event(msg.data)
        if not isinstance(event, CallRetried) or event.principal is None:
            raise ValueError(f"{type(event).__name__} on the retries' subject")
        sent = await publisher.answer_again(
            event.principal, event.call_id, event.tool, event.arguments_sha256
        )
        log.info(
            "call %s of %s.%s retried: %s",
            event.call_id,
            event.principal.tenant,
            event.principal.agent,
            ANSWERED_AGAIN[sent],
        )

    # A retry it cannot answer: no call ends.
    retried = runner.durable_for(subjects.event_filter(CallRetried))
    runner.add(Stage(retried, on_retried, end_call=False))
    for durable in runner.unstaged():  # one per terminal event type (TERMINAL_EVENTS)
        runner.add(Stage(durable, on_terminal))

    app = runner.app()

    @app.on_startup
    async def follow_registry() -> None:
        await runner.broker.connect()
        await start_registry(served, publishing.jetstream(runner.broker))

    @app.on_shutdown
    async def stop_following() -> None:
        await served.stop()

    runner.run_consumers(app)
    return app
