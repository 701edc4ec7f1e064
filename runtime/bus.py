"""The NATS edge every service shares: broker, consumer settings, publishing.

Publishing is always to a stream with a publish ack, and always with a
`Nats-Msg-Id` derived from the message that caused it, so a stage that is
redelivered its input publishes nothing new (JetStream drops the duplicate
within the stream's duplicate window; the audit dedupes by `event_id` after).

FastStream owns each service's process: the connection (reconnects, the
locked bus's creds), start-up and shutdown hooks, signals, and the approvals
service's request/reply. The hot path does not go through it. Each durable
consumer is a plain nats-py pull loop (`PullConsumer`): one pull request asks
for as many messages as there are free handler slots, the messages land in a
plain subscription's callback and each runs as a task of its own, so a batch
is handled concurrently and its publish acks are awaited together, while a
slow message (a long tool call) holds one slot, not the next fetch. Profiled
under load (py-spy, faststream 0.7.8), FastStream's per-message subscriber
stack (anyio task group, middlewares, call wrappers, the pull loop's
`fetch`) and its publisher stack cost more CPU than the handlers' own work in
the validator and the attacher. Publishing goes straight to nats-py too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import socket
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from faststream import FastStream
from faststream.nats import ConsumerConfig, NatsBroker
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import DeliverPolicy
from nats.js.errors import APIError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from toolgate.contracts import subjects
from toolgate.contracts.calls import ErrorCode, PendingNotice, Principal, ToolError, ToolResult
from toolgate.contracts.events import (
    CallAbandoned,
    Event,
    MessageDeadLettered,
    carried_fields,
    decode_event,
    derive_event_id,
    encode_event,
    payload_sha256,
    utc_now,
)
from toolgate.runtime import call_context, emits, telemetry
from toolgate.runtime.creds import broker_options, nats_servers
from toolgate.runtime.jetstream import LeanJetStream
from toolgate.runtime.topology import heartbeat_interval, stage_ack_wait

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
# Stages that act before the tool runs: when one of them gives up, the tool did not run.
BEFORE_EXECUTION = frozenset({"validator", "policy", "approvals"})
ACK_WAIT_S = 30.0
# Handlers of one consumer running at once (each holds one un-acked message).
# A stage's message waits on one to four NATS round trips, so slots, not CPU,
# bound a burst; 32 against 16, back to back: 1.26-1.34 against 1.56 ms of CPU
# per burst call, 1,089-1,141 against 889 calls/s (shared machine, noisy).
CONCURRENCY = 32
# How long one pull request waits for messages; the server then ends it (408)
# and the loop asks again.
PULL_EXPIRES_S = 1.0
# A request whose end has not come by then is given up on (lost in a reconnect) and
# asked again. Its end may still come later (a busy loop): it no longer counts.
PULL_LOST_AFTER_S = PULL_EXPIRES_S + 1.0

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


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's app on uvloop: its sockets, callbacks and timers cost about
    half of asyncio's default loop per message (profiled: `write` syscalls and
    `_run_once` were 20-25% of the validator's and the attacher's samples)."""
    try:
        import uvloop
    except ImportError:  # an install without it still runs, on the default loop
        asyncio.run(main)
        return
    uvloop.run(main)


Handler = Callable[[Msg], Awaitable[None]]


@dataclass(frozen=True)
class DurableConsumer:
    """One durable pull consumer of a service: where it reads, and what handles a message."""

    stream: str
    config: ConsumerConfig
    handler: Handler
    concurrency: int


# The consumers each broker's service declared, started by `run_consumers`.
_declared: weakref.WeakKeyDictionary[NatsBroker, list[DurableConsumer]] = (
    weakref.WeakKeyDictionary()
)


def durable_subscriber(
    broker: NatsBroker,
    subject: str,
    stream_name: str,
    durable: str,
    *,
    concurrency: int = CONCURRENCY,
    max_ack_pending: int = 1000,
    ack_wait_s: float | None = None,
) -> Callable[[Handler], Handler]:
    """Declare a durable pull consumer with manual acks whose handler gets the raw nats-py Msg.

    Every toolgate stage subscribes through this, so they all share one
    consumer shape: explicit acks, unlimited redelivery, our own give-up rule.
    Up to `concurrency` messages are handled at once. The consumer starts with
    the app (`run_consumers`), after its start-up hooks bound what handlers use.
    """

    def declare(handler: Handler) -> Handler:
        config = consumer_config(durable, subject, ack_wait_s, max_ack_pending)
        consumer = DurableConsumer(stream_name, config, handler, max(1, concurrency))
        _declared.setdefault(broker, []).append(consumer)
        return handler

    return declare


def run_consumers(app: FastStream, broker: NatsBroker) -> None:
    """Start the broker's declared consumers once the app has started (every
    `on_startup` hook has run: stores are bound); at shutdown stop asking for
    messages and let the ones in hand finish, so their outputs and acks go out."""
    running: list[PullConsumer] = []

    @app.after_startup
    async def start_consumers() -> None:
        nc = await broker.connect()
        for consumer in _declared.get(broker, []):
            running.append(await PullConsumer(nc, consumer).start())

    @app.on_shutdown
    async def stop_consumers() -> None:
        await asyncio.gather(*(consumer.stop() for consumer in running))


async def ensure_consumer(nc: Client, stream: str, config: ConsumerConfig) -> None:
    """Create the durable once; later replicas (and restarts) find it and leave it as is."""
    js = nc.jetstream()
    try:
        await js.consumer_info(stream, config.durable_name or "")
    except NotFoundError:
        # Named as well as durable: the server then takes the request on
        # CONSUMER.CREATE.<stream>.<name>.<filter>, the subject the locked bus grants.
        await js.add_consumer(stream, dataclasses.replace(config, name=config.durable_name))


class PullConsumer:
    """A durable consumer's pull loop, on JetStream's own pull API.

    A request (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>`, batch = free
    handler slots, expires PULL_EXPIRES_S) stays open until it has delivered
    its batch or expires, so at low rates one request serves many messages and
    at high rates each brings a batch. Messages arrive in a plain
    subscription's callback, each handled in a task of its own; the handler
    acks (through `settle`) only after its outputs are stored. A request whose
    end never came (a reconnect) is given up after its expiry and asked again;
    anything lost that way is redelivered after the consumer's AckWait.

    Each request has a reply subject of its own (`<inbox>.<n>`), so the end
    (408, 409) of a request given up on, arriving late on a busy loop, does not
    end the current one: before, each such late end started one more request
    that was never given up, and under load requests piled up, each with a
    batch, past the handler slots. A message in hand longer than a third of
    the AckWait is kept with `in_progress`, so a handler slowed by load is not
    handed its message a second time (a redelivery counts as an attempt, and
    MAX_ATTEMPTS of them give the message up).
    """

    def __init__(self, nc: Client, consumer: DurableConsumer) -> None:
        self._nc = nc
        self._consumer = consumer
        self._durable = consumer.config.durable_name or ""
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{self._durable}"
        self._inbox = nc.new_inbox()
        self._asked = 0
        self._current = ""  # the reply subject of the latest request
        self._handling: dict[asyncio.Task[None], Msg] = {}
        self._expected = 0  # messages the open request may still bring
        self._open = False
        self._back_off = False
        self._wake = asyncio.Event()
        self._stopping = False
        self._asking: asyncio.Task[None] | None = None
        self._keeping: asyncio.Task[None] | None = None
        # Ask again once this many slots are free (or nothing is in hand): at
        # saturation a request then brings several messages, not one. Counted on
        # CONCURRENCY at most: the validator's many slots hold waiting calls (fair
        # admission), and a new agent's call must not wait for a quarter of them.
        self._min_batch = max(1, min(consumer.concurrency, CONCURRENCY) // 4)

    async def start(self) -> PullConsumer:
        await ensure_consumer(self._nc, self._consumer.stream, self._consumer.config)
        self._subscription = await self._nc.subscribe(
            self._inbox + ".*", cb=self._on_message, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        self._asking = asyncio.create_task(self._ask(), name=f"pull-{self._durable}")
        ack_wait = self._consumer.config.ack_wait
        if ack_wait:
            self._keeping = asyncio.create_task(
                self._keep_in_progress(heartbeat_interval(ack_wait)),
                name=f"in-progress-{self._durable}",
            )
        return self

    async def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        if self._asking is not None:
            self._asking.cancel()
        if self._handling:
            await asyncio.wait(set(self._handling), timeout=grace_s)
        if self._keeping is not None:
            self._keeping.cancel()

    async def _on_message(self, msg: Msg) -> None:
        if not msg.reply:  # a status: 408 request expired, 409 a limit, 100 heartbeat
            status = (msg.headers or {}).get("Status")
            if status == "100" or msg.subject != self._current:
                return  # a heartbeat, or the late end of a request given up on
            if status != "408":
                self._back_off = True
                log.info(
                    "pull request on %s ended: %s %s",
                    self._durable,
                    status,
                    (msg.headers or {}).get("Description"),
                )
            self._open = False
            self._wake.set()
            return
        self._expected -= 1
        if self._expected <= 0:
            self._open = False
            self._wake.set()
        task = asyncio.create_task(self._handle(msg))
        self._handling[task] = msg
        task.add_done_callback(self._handled)

    def _handled(self, task: asyncio.Task[None]) -> None:
        self._handling.pop(task, None)
        if not self._open:
            self._wake.set()

    async def _handle(self, msg: Msg) -> None:
        # This task's log lines (the handler's, settle's) name the message's call.
        call_context.handling(call_context.call_of_message(msg.subject, msg.data))
        try:
            await self._consumer.handler(msg)
        except Exception:  # settle decides every failure; this is a bug: redelivered later
            log.exception("handler of %s raised; the message will be redelivered", self._durable)

    async def _ask(self) -> None:
        concurrency = self._consumer.concurrency
        while not self._stopping:
            self._wake.clear()
            free = concurrency - len(self._handling)
            if self._open or free < (self._min_batch if self._handling else 1):
                try:
                    await asyncio.wait_for(self._wake.wait(), PULL_LOST_AFTER_S)
                except TimeoutError:
                    self._open = False  # the request's end never came: ask again
                continue
            if self._back_off:  # a limit (max_ack_pending) or a missing consumer
                self._back_off = False
                await asyncio.sleep(0.5)
                continue
            self._expected, self._open = free, True
            self._asked += 1
            self._current = f"{self._inbox}.{self._asked}"
            request = b'{"batch":%d,"expires":%d}' % (free, int(PULL_EXPIRES_S * 1e9))
            try:
                await self._nc.publish(self._api, request, reply=self._current)
            except Exception as exc:  # NATS reconnecting: ask again in a moment
                log.warning("pull request on %s failed: %r", self._durable, exc)
                self._open = False
                await asyncio.sleep(0.5)

    async def _keep_in_progress(self, every_s: float) -> None:
        """Every `every_s`, `in_progress` for each message in hand since the last round."""
        held: set[asyncio.Task[None]] = set()
        while True:
            await asyncio.sleep(every_s)
            for task, msg in list(self._handling.items()):
                if task in held:
                    try:
                        await msg.in_progress()
                    except Exception as exc:  # NATS reconnecting: AckWait decides
                        log.debug("in_progress on %s failed: %r", self._durable, exc)
            held = set(self._handling)


def consumer_config(
    durable: str,
    filter_subject: str,
    ack_wait_s: float | None = None,
    max_ack_pending: int = 1000,
) -> ConsumerConfig:
    return ConsumerConfig(
        durable_name=durable,
        filter_subject=filter_subject,
        ack_policy=JsAckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        # Sized to the stage (runtime/topology.py), not JetStream's 30 s default.
        ack_wait=ack_wait_s if ack_wait_s is not None else stage_ack_wait(durable),
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


def delivery_of(msg: Msg) -> Delivery:
    meta = msg.metadata
    return Delivery(
        stream_sequence=meta.sequence.stream,
        attempt=meta.num_delivered,
        subject=msg.subject,
    )


def retry_delay(attempt: int) -> float:
    return min(0.5 * 2.0 ** (attempt - 1), 15.0)


# One per connection: the services' Publisher and the KV buckets they write share it.
_lean: weakref.WeakKeyDictionary[Client, LeanJetStream] = weakref.WeakKeyDictionary()


def jetstream(broker: NatsBroker) -> LeanJetStream:
    """The JetStream context of a connected broker's connection (survives reconnects)."""
    connection = broker.connection
    found = _lean.get(connection)
    if found is None:
        found = _lean[connection] = LeanJetStream(connection)
    return found


class Publisher:
    """Publishes events, results and notices, each with a publish ack."""

    def __init__(self, broker: NatsBroker) -> None:
        self._broker = broker
        self._js: LeanJetStream | None = None

    def _jetstream(self) -> JetStreamContext:
        # Looked up once: FastStream's `broker.connection` walks its config
        # layers on every access (5 % of the validator's CPU, profiled), and a
        # connected broker keeps its connection (nats-py reconnects inside it).
        if self._js is None:
            self._js = jetstream(self._broker)
        return self._js

    async def emit(self, event: Event) -> None:
        emits.check(type(event).__name__)
        await self._jetstream().publish(
            subjects.subject_of(event),
            encode_event(event),
            stream=subjects.EVENTS_STREAM,
            headers=telemetry.trace_headers({"Nats-Msg-Id": event.event_id}),
        )
        telemetry.emitted(event)

    async def publish_result(
        self, result: ToolResult, principal: Principal, message_id: str
    ) -> bool:
        """Store the call's one result; False if it already has one (it is never replaced)."""
        emits.check("ToolResult")
        return await self._publish_once(
            _json.encode(result),
            subjects.results_subject(principal.tenant, principal.agent, result.call_id),
            message_id,
        )

    async def publish_pending(
        self, notice: PendingNotice, principal: Principal, message_id: str
    ) -> bool:
        emits.check("PendingNotice")
        return await self._publish_once(
            _json.encode(notice),
            subjects.pending_subject(principal.tenant, principal.agent, notice.call_id),
            message_id,
        )

    async def answer_again(self, principal: Principal, call_id: str) -> str:
        """Send a retried call's stored answer again, to whoever listens on its subjects now.

        A plain (core NATS) publish of the stored bytes: the retry's subscriber gets
        exactly what the first one got, and the results stream, which holds one message
        per subject, stores nothing new (checked against nats-server: the copy is
        delivered, the stream refuses it). Returns what was sent: "result", "pending"
        (the call waits for a human), or "" (no answer stored yet: the result reaches
        the retry's subscriber when it lands, as it reaches every subscriber)."""
        result = subjects.results_subject(principal.tenant, principal.agent, call_id)
        pending = subjects.pending_subject(principal.tenant, principal.agent, call_id)
        # The notice first: a result stored between the two reads is then found too.
        notice = await self._stored(pending)
        stored = await self._stored(result)
        subject, body = (result, stored) if stored is not None else (pending, notice)
        if body is None:
            return ""
        emits.check("ToolResult" if stored is not None else "PendingNotice")
        await self._broker.connection.publish(subject, body)
        return "result" if stored is not None else "pending"

    async def _stored(self, subject: str) -> bytes | None:
        try:
            msg = await self._jetstream().get_last_msg(
                subjects.RESULTS_STREAM, subject, direct=True
            )
        except NotFoundError:
            return None
        return msg.data

    async def _publish_once(self, body: bytes, subject: str, message_id: str) -> bool:
        """True if the subject now holds this message (stored now, or by an earlier try)."""
        js = self._jetstream()
        try:
            await js.publish(
                subject,
                body,
                stream=subjects.RESULTS_STREAM,
                headers=telemetry.trace_headers({"Nats-Msg-Id": message_id}),
            )
        except APIError as exc:
            if exc.err_code != SUBJECT_FULL_ERR_CODE:
                raise
            # Ours, stored by an attempt that crashed before its ack (beyond the
            # duplicate window), or another message that holds the subject for good?
            stored = await js.get_last_msg(subjects.RESULTS_STREAM, subject, direct=True)
            return (stored.headers or {}).get("Nats-Msg-Id") == message_id
        return True


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
    """
    try:
        await work()
    except Exception as exc:  # a handler never lets an exception reach the broker
        if is_transient(exc):
            BUS_TROUBLE.failed(delivery, exc)
            await msg.nak(delay=retry_delay(delivery.attempt))
            return
        failures = FAILURES.failed(delivery)
        if failures < MAX_ATTEMPTS:
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
        return
    FAILURES.forget(delivery)
    await msg.ack()


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


def is_transient(exc: BaseException) -> bool:
    """Does `exc` say the bus is not answering now, rather than that the message is bad?"""
    return isinstance(exc, TRANSIENT_ERRORS)


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
