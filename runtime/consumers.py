"""The durable pull consumers every stage reads through.

Each durable consumer is a plain nats-py pull loop (`PullConsumer`): one pull
request asks for as many messages as there are free handler slots, the
messages land in a plain subscription's callback and each runs as a task of
its own, so a batch is handled concurrently and its publish acks are awaited
together, while a slow message (a long tool call) holds one slot, not the next
fetch. Profiled under load (py-spy, faststream 0.7.8), FastStream's
per-message subscriber stack (anyio task group, middlewares, call wrappers,
the pull loop's `fetch`) and its publisher stack cost more CPU than the
handlers' own work in the validator and the attacher. A stage declares its
consumers through the stage runner (runtime/stage.py).

A batch stage's durable (the audit sink's: one ClickHouse insert per batch) reads
through `BatchPullConsumer`: one request for up to a batch's worth of messages,
waiting at most the stage's flush time, and the whole batch handed to one task.
Both keep what they hold with one heartbeat (`in_progress` every sixth of the AckWait
for what was in hand a sixth ago: kept within a third of the AckWait).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Self

from faststream import FastStream
from faststream.nats import ConsumerConfig, NatsBroker
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import DeliverPolicy
from nats.js.errors import NotFoundError

from toolgate.runtime import acking, call_context
from toolgate.runtime.topology import heartbeat_interval, stage_ack_wait

log = logging.getLogger("toolgate")


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


Handler = Callable[[Msg], Awaitable[None]]
BatchHandler = Callable[[list[Msg]], Awaitable[None]]
# The most one batch request may bring, in bytes (the server ends it with a 409 past it).
MAX_BATCH_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class DurableConsumer:
    """One durable pull consumer of a service: where it reads, and what handles a message."""

    stream: str
    config: ConsumerConfig
    handler: Handler
    concurrency: int


@dataclass(frozen=True)
class DurableBatchConsumer:
    """A durable read in batches: up to `max_messages`, or what came in `max_wait_s`."""

    stream: str
    config: ConsumerConfig
    handler: BatchHandler
    max_messages: int
    max_wait_s: float


# The consumers each broker's service declared, started by `run_consumers`.
_declared: weakref.WeakKeyDictionary[NatsBroker, list[DurableConsumer | DurableBatchConsumer]] = (
    weakref.WeakKeyDictionary()
)


def declare(broker: NatsBroker, consumer: DurableConsumer | DurableBatchConsumer) -> None:
    """Declare a durable pull consumer of the broker's service, started with the app
    (`run_consumers`) after its start-up hooks bound what handlers use.

    Every toolgate stage subscribes through this (runtime/stage.py), so they all share
    one consumer shape (`consumer_config`): explicit acks, unlimited redelivery, our own
    give-up rule. A DurableConsumer handles up to `concurrency` messages at once; a
    DurableBatchConsumer one batch at a time.
    """
    _declared.setdefault(broker, []).append(consumer)


def run_consumers(app: FastStream, broker: NatsBroker) -> None:
    """Start the broker's declared consumers once the app has started (every
    `on_startup` hook has run: stores are bound); at shutdown stop asking for
    messages and let the ones in hand finish, so their outputs and acks go out."""
    running: list[PullLoop] = []

    @app.after_startup
    async def start_consumers() -> None:
        nc = await broker.connect()
        for consumer in _declared.get(broker, []):
            pulling = (
                BatchPullConsumer(nc, consumer)
                if isinstance(consumer, DurableBatchConsumer)
                else PullConsumer(nc, consumer)
            )
            running.append(await pulling.start())

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


class PullLoop:
    """What every durable's pull loop shares: the durable created if missing, one reply
    subject per request (`<inbox>.<n>`), the messages in hand (a task each: one message,
    or a batch) and the one heartbeat that keeps them (`in_progress` every sixth of the
    AckWait, for what was in hand at the previous round already)."""

    def __init__(self, nc: Client, stream: str, config: ConsumerConfig) -> None:
        self._nc = nc
        self._stream = stream
        self._config = config
        self._durable = config.durable_name or ""
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{self._durable}"
        self._inbox = nc.new_inbox()
        self._asked = 0
        self._current = ""  # the reply subject of the latest request
        self._handling: dict[asyncio.Task[None], Sequence[Msg]] = {}
        self._back_off = False
        self._stopping = False
        self._asking: asyncio.Task[None] | None = None
        self._keeping: asyncio.Task[None] | None = None

    async def start(self) -> Self:
        await ensure_consumer(self._nc, self._stream, self._config)
        # A settled message's ack goes out with this connection's next write
        # (runtime/acking.py): one socket write fewer per message.
        acking.hold_acks_on(self._nc)
        self._subscription = await self._nc.subscribe(
            self._inbox + ".*", cb=self._on_message, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        self._asking = asyncio.create_task(self._ask(), name=f"pull-{self._durable}")
        ack_wait = self._config.ack_wait
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
        try:  # the acks held for the last messages, sent and seen by the server
            await acking.send_held(self._nc)
            await self._nc.flush(timeout=2)
        except Exception as exc:  # the bus is away: AckWait redelivers them
            log.debug("acks held by %s not sent: %r", self._durable, exc)

    async def _on_message(self, msg: Msg) -> None:
        raise NotImplementedError

    async def _ask(self) -> None:
        raise NotImplementedError

    def _next_request(self) -> str:
        """The reply subject of a new request: only its end counts from now on."""
        self._asked += 1
        self._current = f"{self._inbox}.{self._asked}"
        return self._current

    def _request_ended(self, msg: Msg) -> bool | None:
        """For a status message (no reply subject): True if it ends the current request
        (a 408 expiry, or a limit, after which the loop backs off), None if it is a
        heartbeat or the late end of a request given up on. False: a delivered message."""
        if msg.reply:
            return False
        status = (msg.headers or {}).get("Status")
        if status == "100" or msg.subject != self._current:
            return None
        if status != "408":
            self._back_off = True
            log.info(
                "pull request on %s ended: %s %s",
                self._durable,
                status,
                (msg.headers or {}).get("Description"),
            )
        return True

    async def _keep_in_progress(self, every_s: float) -> None:
        """Every `every_s`, `in_progress` for each message in hand since the last round."""
        held: set[asyncio.Task[None]] = set()
        while True:
            await asyncio.sleep(every_s)
            for task, msgs in list(self._handling.items()):
                if task in held:
                    for msg in msgs:
                        try:
                            await msg.in_progress()
                        except Exception as exc:  # NATS reconnecting: AckWait decides
                            log.debug("in_progress on %s failed: %r", self._durable, exc)
            held = set(self._handling)


class PullConsumer(PullLoop):
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
    batch, past the handler slots. A message in hand is kept with `in_progress`
    no later than a third of the AckWait after it was handed over, so a handler
    slowed by load is not handed its message a second time (a redelivery counts as an attempt, and
    MAX_ATTEMPTS of them give the message up).
    """

    def __init__(self, nc: Client, consumer: DurableConsumer) -> None:
        super().__init__(nc, consumer.stream, consumer.config)
        self._consumer = consumer
        self._expected = 0  # messages the open request may still bring
        self._open = False
        self._wake = asyncio.Event()
        # Ask again once this many slots are free (or nothing is in hand): at
        # saturation a request then brings several messages, not one. Counted on
        # CONCURRENCY at most: the validator's many slots hold waiting calls (fair
        # admission), and a new agent's call must not wait for a quarter of them.
        self._min_batch = max(1, min(consumer.concurrency, CONCURRENCY) // 4)

    async def _on_message(self, msg: Msg) -> None:
        ended = self._request_ended(msg)
        if ended is None:
            return
        if ended:
            self._open = False
            self._wake.set()
            return
        self._expected -= 1
        if self._expected <= 0:
            self._open = False
            self._wake.set()
        task = asyncio.create_task(self._handle(msg))
        self._handling[task] = (msg,)
        task.add_done_callback(self._handled)

    def _handled(self, task: asyncio.Task[None]) -> None:
        self._handling.pop(task, None)
        if not self._open:
            self._wake.set()

    async def _handle(self, msg: Msg) -> None:
        # This task's log lines (the handler's, settle's) name the message's call.
        call_context.handling_message(msg.subject, msg.data)
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
            reply = self._next_request()
            request = b'{"batch":%d,"expires":%d}' % (free, int(PULL_EXPIRES_S * 1e9))
            try:
                await acking.send_held(self._nc)  # in the request's write
                await self._nc.publish(self._api, request, reply=reply)
            except Exception as exc:  # NATS reconnecting: ask again in a moment
                log.warning("pull request on %s failed: %r", self._durable, exc)
                self._open = False
                await asyncio.sleep(0.5)


class BatchPullConsumer(PullLoop):
    """A batch stage's durable: one request for up to a batch, the batch to one task.

    Why not nats-py's `PullSubscription.fetch`: it hands messages over one
    `asyncio.wait_for(queue.get())` at a time, about 60 us each; measured for the audit
    sink it topped out near 11,000 messages/s with acks, 25,000 with this. A request
    asks for what the batch still lacks, waits at most `max_wait_s` (its `expires`) and
    ends when the batch is full or the server says so (408: expired with fewer
    messages; 409: a limit such as max_ack_pending or MAX_BATCH_BYTES, after which an
    empty round backs off). Messages of a request the loop stopped waiting for still
    arrive and are kept for the next batch. One batch is in hand at a time; the
    heartbeat keeps it while its handler waits (the audit's, for ClickHouse).
    """

    def __init__(self, nc: Client, consumer: DurableBatchConsumer) -> None:
        super().__init__(nc, consumer.stream, consumer.config)
        self._consumer = consumer
        self._box: list[Msg] = []
        self._ended = asyncio.Event()

    async def _on_message(self, msg: Msg) -> None:
        ended = self._request_ended(msg)
        if ended is None:
            return
        if not ended:
            self._box.append(msg)
            if len(self._box) < self._consumer.max_messages:
                return
        self._ended.set()

    async def _handle(self, batch: list[Msg]) -> None:
        try:
            await self._consumer.handler(batch)
        except Exception:  # settle_batch decides every failure; this is a bug
            log.exception("handler of %s raised; the batch will be redelivered", self._durable)

    async def _ask(self) -> None:
        rows, wait_s = self._consumer.max_messages, self._consumer.max_wait_s
        while not self._stopping:
            if len(self._box) < rows:
                await self._fill(rows - len(self._box), wait_s)
            batch, self._box = self._box[:rows], self._box[rows:]
            if not batch:
                if self._back_off:
                    self._back_off = False
                    await asyncio.sleep(0.5)
                continue
            task = asyncio.create_task(self._handle(batch), name=f"batch-{self._durable}")
            self._handling[task] = batch
            task.add_done_callback(lambda done: self._handling.pop(done, None))
            await asyncio.wait({task})  # cancelling the loop (stop) leaves the batch to finish

    async def _fill(self, wanted: int, wait_s: float) -> None:
        self._ended.clear()
        self._back_off = False
        reply = self._next_request()
        request = b'{"batch":%d,"expires":%d,"max_bytes":%d}' % (
            wanted,
            int(wait_s * 1e9),
            MAX_BATCH_BYTES,
        )
        try:
            await self._nc.publish(self._api, request, reply=reply)
        except Exception as exc:  # NATS reconnecting: ask again in a moment
            log.warning("pull request on %s failed: %r", self._durable, exc)
            await asyncio.sleep(0.5)
            return
        try:
            # The server ends the request at `expires`; the margin covers a slow link.
            await asyncio.wait_for(self._ended.wait(), wait_s + 1.0)
        except TimeoutError:
            pass


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
