"""Settling a delivered message: ack after the work, nak for a retry, or give up.

One rule for every stage: an error of the bus itself is retried for as long as
it lasts; any other failure is retried MAX_ATTEMPTS times, then the message is
given up on (runtime/giving_up.py) and terminated.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import nats.errors
from nats.aio.msg import Msg
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from toolgate.runtime import acking, telemetry
from toolgate.runtime.jetstream import ack_subject_fields

log = logging.getLogger("toolgate")


# How often a stage tries an input before it gives up on it and dead-letters
# it. JetStream's own max_deliver is unlimited on purpose: if dead-lettering
# itself fails (NATS is down), the message must stay, not vanish.
MAX_ATTEMPTS = 5
# Errors that say the bus is not answering now (a reconnect, a leader election, a
# node down), not that the message is bad: they never count towards giving up. A
# stage retries such a message, backing off to every 15 s, until the bus answers;
# giving up would end a good call with an error because of an outage.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError (a request or publish ack) is one
    nats.errors.NoRespondersError,  # a stream with no leader yet
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.ConnectionDrainingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoServersError,
    ServiceUnavailableError,  # 503: JetStream not ready, no quorum
    NoStreamResponseError,
    ConnectionError,
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


def delivery_of(msg: Msg) -> Delivery:
    # The ack subject says where the message is stored and how often it was delivered.
    fields = ack_subject_fields(msg.reply)
    if fields is not None:
        return Delivery(stream_sequence=fields[3], attempt=fields[2], subject=msg.subject)
    meta = msg.metadata
    return Delivery(
        stream_sequence=meta.sequence.stream,
        attempt=meta.num_delivered,
        subject=msg.subject,
    )


def retry_delay(attempt: int) -> float:
    return min(0.5 * 2.0 ** (attempt - 1), 15.0)


class FailureCounts:
    """How often each message in hand failed on an error that is not the bus's own.

    JetStream's delivery count (`Delivery.attempt`) also counts the deliveries
    an outage cost, so after a long one every message in flight is past
    MAX_ATTEMPTS: giving up on that count would end good calls on their first
    real error. Counted per process (a message is tried by one worker at a time;
    another worker or a restart starts again from 0, which only retries more),
    bounded: the oldest counts are forgotten first.
    """

    def __init__(self, limit: int = 10_000) -> None:
        self.limit = limit
        self._counts: dict[tuple[str, int], int] = {}

    def failed(self, delivery: Delivery) -> int:
        key = (delivery.subject, delivery.stream_sequence)
        count = self._counts.pop(key, 0) + 1
        self._counts[key] = count  # last in: the newest (dicts keep insertion order)
        while len(self._counts) > self.limit:
            del self._counts[next(iter(self._counts))]
        return count

    def of(self, delivery: Delivery) -> int:
        return self._counts.get((delivery.subject, delivery.stream_sequence), 0)

    def __len__(self) -> int:
        return len(self._counts)

    def forget(self, delivery: Delivery) -> None:
        self._counts.pop((delivery.subject, delivery.stream_sequence), None)


FAILURES = FailureCounts()


class BusTroubleLog:
    """One log line a second, at most, for messages the bus did not answer.

    In a failover every message in hand fails at once, and again at each retry:
    a line per message is thousands of lines in seconds. The first is logged,
    then one line a second says how many more there were.
    """

    def __init__(self, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.last_at: float | None = None
        self.held = 0

    def failed(self, delivery: Delivery, exc: BaseException) -> None:
        now = self.clock()
        if self.last_at is not None and now - self.last_at < self.every_s:
            self.held += 1
            return
        more = f" (and {self.held} more since the last line)" if self.held else ""
        # Loud once it has lasted: a bus that refuses a publish (permissions) looks the
        # same as one that is away, and is retried for ever too.
        (log.error if delivery.attempt >= MAX_ATTEMPTS else log.warning)(
            "delivery %s of %s: the bus did not answer, retrying until it does: %r%s",
            delivery.attempt,
            delivery.subject,
            exc,
            more,
        )
        self.last_at, self.held = now, 0


BUS_TROUBLE = BusTroubleLog()


@telemetry.observed  # a span and the stage's latency, when switched on (else straight through)
async def settle(
    msg: Msg,
    delivery: Delivery,
    work: Callable[[], Awaitable[None]],
    give_up: Callable[[Exception], Awaitable[None]],
) -> None:
    """Run `work()`, then ack; on failure decide: retry later, or give up cleanly.

    `work` publishes the stage's output (with publish acks) and is safe to
    run again. An error of the bus itself (TRANSIENT_ERRORS) is retried for as
    long as it lasts, and does not count. After MAX_ATTEMPTS other failures,
    `give_up(exc)` records a dead letter (and ends the call in an error result
    where the message names it: `give_up_on`) and the message is terminated.
    If even that fails, the message is nak'ed again: never dropped silently.
    The ack goes out with the connection's next write (runtime/acking.py).
    """
    try:
        await work()
    except Exception as exc:  # a handler never lets an exception reach the broker
        await _failed(msg, delivery, exc, give_up)
        return
    FAILURES.forget(delivery)
    await acking.ack(msg)


async def settle_batch(
    msgs: Sequence[Msg],
    work: Callable[[], Awaitable[None]],
    give_up: Callable[[Msg, Delivery, Exception], Awaitable[None]],
) -> None:
    """`settle` for a batch whose work is one (the audit's insert): after `work()`, every
    message is acked; if it fails, each message is settled as `settle` settles one that
    failed (retried, or after MAX_ATTEMPTS given up on with `give_up(msg, delivery,
    exc)` and terminated). The deliveries are read only on a failure: JetStream's
    metadata is the costliest part of a message to parse."""
    try:
        await work()
    except Exception as exc:
        if not is_transient(exc):  # one line for the batch, not one per message
            log.warning("a batch of %d message(s) failed, retrying: %r", len(msgs), exc)
        for msg in msgs:
            delivery = delivery_of(msg)
            try:
                await _failed(
                    msg, delivery, exc, functools.partial(give_up, msg, delivery), quiet=True
                )
            except Exception as again:  # the bus went away: AckWait redelivers it
                log.debug("settling %s failed: %r", delivery.subject, again)
        return
    if FAILURES:  # a message of the batch may have failed before
        for msg in msgs:
            FAILURES.forget(delivery_of(msg))
    for msg in msgs:
        try:
            await msg.ack()
        except Exception as exc:  # a lost ack only means a redelivery, written again
            log.debug("ack on %s failed: %r", msg.subject, exc)


async def _failed(
    msg: Msg,
    delivery: Delivery,
    exc: Exception,
    give_up: Callable[[Exception], Awaitable[None]],
    quiet: bool = False,
) -> None:
    """A message whose work failed: retried later (`quiet`: no line of its own), or given
    up on cleanly."""
    if is_transient(exc):
        BUS_TROUBLE.failed(delivery, exc)
        await msg.nak(delay=retry_delay(delivery.attempt))
        return
    failures = FAILURES.failed(delivery)
    if failures < MAX_ATTEMPTS:
        if not quiet:
            log.warning("attempt %s on %s failed, retrying: %r", failures, delivery.subject, exc)
        await msg.nak(delay=retry_delay(failures))
        return
    log.error(
        "giving up on %s after %s failed attempts (dead letter): %r",
        delivery.subject,
        failures,
        exc,
    )
    try:
        await give_up(exc)
    except Exception as again:
        log.error("giving up on %s failed too, will retry: %r", delivery.subject, again)
        await msg.nak(delay=retry_delay(failures))
        return
    FAILURES.forget(delivery)
    await msg.term()


def is_transient(exc: BaseException) -> bool:
    """Does `exc` say the bus is not answering now, rather than that the message is bad?"""
    return isinstance(exc, TRANSIENT_ERRORS)
