"""The NATS edge every service shares: broker, consumer settings, publishing.

Publishing is always to a stream with a publish ack, and always with a
`Nats-Msg-Id` derived from the message that caused it, so a stage that is
redelivered its input publishes nothing new (JetStream drops the duplicate
within the stream's duplicate window; the audit dedupes by `event_id` after).
"""

from __future__ import annotations

import gc
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import msgspec
from faststream import AckPolicy
from faststream.nats import ConsumerConfig, JStream, NatsBroker, PullSub
from faststream.nats.message import NatsMessage
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError

from toolgate.contracts import subjects
from toolgate.contracts.calls import PendingNotice, Principal, ToolResult
from toolgate.contracts.events import (
    Event,
    MessageDeadLettered,
    derive_event_id,
    encode_event,
    utc_now,
)
from toolgate.runtime.creds import broker_options, nats_servers

log = logging.getLogger("toolgate")


class _QuietSupervisor(logging.Filter):
    """Drop FastStream's task-supervisor chatter: an INFO line each time a pull loop
    ends, and a traceback when an idle fetch times out (it is restarted at once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith("callback for ") and text.endswith("is being executed..."):
            return False
        return not (
            text.endswith(
                "raised an exception, retrying...\n"
                "If this behavior causes issues, you can disable it via "
                "setting the FASTSTREAM_SUPERVISOR_DISABLED env to 1. Also, "
                "please consider opening issue on the repository: "
                "https://github.com/ag2ai/faststream."
            )
            and record.exc_info is not None
            and isinstance(record.exc_info[1], TimeoutError)
        )


log.addFilter(_QuietSupervisor())

# How often a stage tries an input before it gives up on it and dead-letters
# it. JetStream's own max_deliver is unlimited on purpose: if dead-lettering
# itself fails (NATS is down), the message must stay, not vanish.
MAX_ATTEMPTS = 5
# Every stage acks by hand, after its output is durable.
MANUAL = AckPolicy.MANUAL
ACK_WAIT_S = 30.0

_json = msgspec.json.Encoder()
# JetStream's answer when a write-once subject (discard new per subject) already holds one.
SUBJECT_FULL_ERR_CODE = 10077


def worker_name(service: str) -> str:
    return f"{service}@{socket.gethostname()}:{os.getpid()}"


def tune_gc_for_a_service() -> None:
    """Keep the cyclic GC off the hot path of a long-running service.

    Profiled under load (py-spy + GC timing): full collections walked the ~70k
    objects every service holds from start-up, about 40 ms each, some 14% of the
    validator's CPU. Freezing what exists after start-up takes it out of every
    later collection; a larger young generation makes collections rarer.
    """
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def make_broker(nats_url: str, name: str, creds: Path | None = None) -> NatsBroker:
    # Reconnect forever: a restarted NATS server must not need restarted services.
    # apply_types=False: handlers take the raw message and decode it themselves
    # with msgspec. FastDepends' per-message injection ran sync resolvers in a
    # thread pool and cost 4x in latency and throughput (measured: one hop
    # 6.7 ms -> 1.7 ms p50, 334 -> 1185 msgs/s).
    return NatsBroker(
        nats_servers(nats_url),  # a cluster: every node's URL
        name=name,
        apply_types=False,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        logger=log,
        # Per-message "Received/Processed" lines only at DEBUG: the events
        # stream and the audit table are the record, not the service log.
        log_level=logging.DEBUG,
        # On a locked bus: log in as this service's role (nkey, and its inbox prefix).
        **broker_options(creds),
    )


def stream(name: str) -> JStream:
    """A reference to a stream the topology already declared (never re-declared here)."""
    return JStream(name, declare=False)


def pull(batch_size: int = 16) -> PullSub:
    return PullSub(batch_size=batch_size, timeout=1.0)


async def _message_itself(msg: NatsMessage) -> NatsMessage:
    """A decoder that hands the handler the message, undecoded."""
    return msg


Handler = Callable[[NatsMessage], Awaitable[None]]


def durable_subscriber(
    broker: NatsBroker,
    subject: str,
    stream_name: str,
    durable: str,
    *,
    batch_size: int = 16,
    max_workers: int | None = None,
    max_ack_pending: int = 1000,
) -> Callable[[Handler], object]:
    """A durable pull consumer with manual acks whose handler gets the raw NatsMessage.

    Every toolgate stage subscribes through this, so they all share one
    consumer shape: explicit acks, unlimited redelivery, our own give-up rule.
    """
    options: dict[str, object] = {}
    if max_workers is not None:
        options["max_workers"] = max_workers
    return broker.subscriber(  # type: ignore[call-overload, no-any-return]
        subject,
        stream=stream(stream_name),
        durable=durable,
        config=consumer_config(durable, subject, max_ack_pending=max_ack_pending),
        pull_sub=pull(batch_size),
        ack_policy=MANUAL,
        decoder=_message_itself,
        **options,
    )


def consumer_config(
    durable: str, filter_subject: str, ack_wait_s: float = ACK_WAIT_S, max_ack_pending: int = 1000
) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        filter_subject=filter_subject,
        ack_policy=JsAckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=ack_wait_s,
        max_deliver=-1,
        max_ack_pending=max_ack_pending,
    )


@dataclass(frozen=True)
class Delivery:
    """What JetStream says about the message being handled."""

    stream_sequence: int
    attempt: int
    subject: str

    @property
    def message_id(self) -> str:
        """A stable id for the stored message: the root of derived event ids."""
        return f"seq:{self.stream_sequence}"

    @property
    def is_last_attempt(self) -> bool:
        return self.attempt >= MAX_ATTEMPTS


def delivery_of(msg: NatsMessage) -> Delivery:
    meta = msg.raw_message.metadata
    return Delivery(
        stream_sequence=meta.sequence.stream,
        attempt=meta.num_delivered,
        subject=msg.raw_message.subject,
    )


def retry_delay(attempt: int) -> float:
    return min(0.5 * 2 ** (attempt - 1), 15.0)


class Publisher:
    """Publishes events, results and notices, each with a publish ack."""

    def __init__(self, broker: NatsBroker) -> None:
        self._broker = broker

    async def emit(self, event: Event) -> None:
        await self._broker.publish(
            encode_event(event),
            subject=subjects.subject_of(event),
            stream=subjects.EVENTS_STREAM,
            headers={"Nats-Msg-Id": event.event_id},
        )

    async def publish_result(
        self, result: ToolResult, principal: Principal, message_id: str
    ) -> bool:
        """Store the call's one result; False if it already has one (it is never replaced)."""
        return await self._publish_once(
            _json.encode(result),
            subjects.results_subject(principal.tenant, principal.agent, result.call_id),
            message_id,
        )

    async def publish_pending(
        self, notice: PendingNotice, principal: Principal, message_id: str
    ) -> bool:
        return await self._publish_once(
            _json.encode(notice),
            subjects.pending_subject(principal.tenant, principal.agent, notice.call_id),
            message_id,
        )

    async def _publish_once(self, body: bytes, subject: str, message_id: str) -> bool:
        """True if the subject now holds this message (stored now, or by an earlier try)."""
        try:
            await self._broker.publish(
                body,
                subject=subject,
                stream=subjects.RESULTS_STREAM,
                headers={"Nats-Msg-Id": message_id},
            )
        except APIError as exc:
            if exc.err_code != SUBJECT_FULL_ERR_CODE:
                raise
            # Ours, stored by an attempt that crashed before its ack (beyond the
            # duplicate window), or another message that holds the subject for good?
            stored = await self._broker.connection.jetstream().get_last_msg(
                subjects.RESULTS_STREAM, subject, direct=True
            )
            return (stored.headers or {}).get("Nats-Msg-Id") == message_id
        return True


async def settle(msg: NatsMessage, delivery: Delivery, work, give_up) -> None:  # type: ignore[no-untyped-def]
    """Run `work()`, then ack; on failure decide: retry later, or give up cleanly.

    `work` publishes the stage's output (with publish acks) and is safe to
    run again. After MAX_ATTEMPTS, `give_up(exc)` records a dead letter (and
    an error result where one can be formed) and the message is terminated.
    If even that fails, the message is nak'ed again: never dropped silently.
    """
    try:
        await work()
    except Exception as exc:  # a handler never lets an exception reach the broker
        if not delivery.is_last_attempt:
            log.warning(
                "attempt %s on %s failed, retrying: %r", delivery.attempt, delivery.subject, exc
            )
            await msg.nack(delay=retry_delay(delivery.attempt))
            return
        try:
            await give_up(exc)
        except Exception as again:
            log.error("giving up on %s failed too, will retry: %r", delivery.subject, again)
            await msg.nack(delay=retry_delay(delivery.attempt))
            return
        await msg.reject()
        return
    await msg.ack()


def dead_letter(
    service: str, delivery: Delivery, raw: bytes, exc: Exception, call_id: str = ""
) -> MessageDeadLettered:
    return MessageDeadLettered(
        event_id=derive_event_id(delivery.message_id, f"{service}/gave-up"),
        occurred_at=utc_now(),
        service=service,
        call_id=call_id,
        reason=f"{service} gave up after {delivery.attempt} attempts: {exc!r}",
        source_subject=delivery.subject,
        payload_excerpt=raw[:512].decode("utf-8", "replace"),
        payload_bytes=len(raw),
    )
