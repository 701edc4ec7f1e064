"""The stage runner: one way to write a stage.

A service declares its stages, one per row of the handler table
(runtime/topology.py) it owns: the durable, and the function that does the
work for one message. The runner does the rest, the same way for every stage:
it subscribes the durable on the row's stream and filter subject (nothing is
derived again in the service), names the row in the handling task (what the
handler publishes is checked against the row's `emits`: runtime/emits.py),
runs the work, and settles the message: ack once the work's outputs are
stored, nak for a retry, or, after MAX_ATTEMPTS failures, give up (a dead
letter with the reason and, unless the stage says otherwise, the end of the
call the message names) and term (runtime/settling.py `settle`, runtime/giving_up.py
`give_up_on`).

    runner = StageRunner(SERVICE, settings)
    retried = runner.durable_for(subjects.event_filter(CallRetried))
    runner.add(Stage(retried, on_retried, end_call=False))
    app = runner.app()
    ...  # start-up hooks that bind what the work uses
    runner.run_consumers(app)  # consumers start once those hooks have run
    return app

A stage whose unit of work is a batch (the audit sink: one ClickHouse insert
for many messages) is a `BatchStage`: the runner pulls up to `max_messages`, or
what came within `max_wait_s`, hands the batch to `work(msgs)`, and settles
every message of it the same way (runtime/settling.py `settle_batch`): all
acked once the work returned; on a failure each retried, or given up on and
dead-lettered as a single message is. Its durables are the service's rows of
the table (one per source stream for the audit): a new row needs no code.

    runner.add_batch(BatchStage(write, max_messages=2000, max_wait_s=1.0, end_call=False))

A message in hand is kept with `in_progress` by the consumer, no later than a
third of its AckWait after it was handed over (runtime/consumers.py: `PullLoop`): one heartbeat
for every stage, a long tool call's and a batch waiting for ClickHouse included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, TypeVar

from faststream import FastStream
from faststream.nats import ConsumerConfig, NatsBroker
from nats.aio.msg import Msg

from toolgate.contracts.events import Event, decode_event
from toolgate.runtime import consumers, emits, giving_up, process, publishing, settling
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.topology import Handler, rows_of

Work = Callable[[Msg, settling.Delivery], Awaitable[None]]
BatchWork = Callable[[list[Msg]], Awaitable[None]]
GiveUp = Callable[[Msg, settling.Delivery, Exception], Awaitable[None]]
# Entered before the work: yields False when the message is not to be worked on now
# (the gate settled it itself, e.g. nak'ed it for later).
Gate = Callable[[Msg, settling.Delivery], AbstractAsyncContextManager[bool]]

E = TypeVar("E", bound=Event)


@dataclass(frozen=True)
class Stage:
    """One durable of a service: its row of the handler table, and what handles a message.

    `work(msg, delivery)` publishes the stage's outputs (each with a publish ack) and is
    safe to run again: the message is acked only after it returns. `give_up(msg,
    delivery, exc)` replaces the default give-up (a dead letter, and a CallAbandoned
    for the call the message names unless `end_call` is False). `gate` is entered
    around the settling (the validator's fair admission). `settles_itself`: `work`
    acks or naks the message itself (the notifier's deliveries, whose outcome is a
    webhook's answer); the runner then only subscribes and calls it.
    """

    durable: str
    work: Work
    give_up: GiveUp | None = None
    end_call: bool = True
    gate: Gate | None = None
    settles_itself: bool = False
    concurrency: int = consumers.CONCURRENCY
    max_ack_pending: int = 1000
    ack_wait_s: float | None = None  # None: the stage's (runtime/topology.py)


@dataclass(frozen=True)
class BatchStage:
    """Durables of a service whose unit of work is a batch of messages.

    `work(msgs)` does one thing for the whole batch (the audit's insert), safe to run
    again; every message is acked only after it returns. A batch is up to
    `max_messages` messages, or what came within `max_wait_s`. `durable`: the rows of
    that name; None, every row of the service that has no stage yet. `give_up` and
    `end_call` as for a Stage, per message.
    """

    work: BatchWork
    max_messages: int
    max_wait_s: float
    durable: str | None = None
    give_up: GiveUp | None = None
    end_call: bool = True
    max_ack_pending: int = 1000
    ack_wait_s: float | None = None  # None: the stage's (runtime/topology.py)


class StageRunner:
    """A service's broker, publisher and stages; the rows it owns come from the table."""

    def __init__(
        self, service: str, settings: GatewaySettings, tools: list[str] | None = None
    ) -> None:
        self.service = service
        self.broker: NatsBroker = process.make_broker(
            settings.nats_url, process.worker_name(service), settings.nats_creds
        )
        self.publisher = publishing.Publisher(self.broker)
        # Keyed by (stream, durable): the audit's durable has one name on each stream.
        self.rows: dict[tuple[str, str], Handler] = {
            (row.stream, row.durable): row for row in rows_of(service, tools)
        }
        self.stages: dict[tuple[str, str], Stage | BatchStage] = {}
        self.loops: dict[str, Callable[[], Coroutine[Any, Any, None]]] = {}

    def _row_named(self, durable: str) -> Handler:
        rows = [row for row in self.rows.values() if row.durable == durable]
        if not rows:
            names = ", ".join(dict.fromkeys(row.durable for row in self.rows.values()))
            raise ValueError(
                f"{self.service}: no durable {durable!r} in the handler table "
                f"(runtime/topology.py); its rows: {names or 'none'}"
            )
        if len(rows) > 1:
            raise ValueError(
                f"{self.service}: durable {durable!r} is on {len(rows)} streams; "
                "declare it with a BatchStage, or name it once in the table"
            )
        if (rows[0].stream, durable) in self.stages:
            raise ValueError(f"{self.service}: durable {durable!r} declared twice")
        return rows[0]

    def add(self, stage: Stage) -> None:
        row = self._row_named(stage.durable)
        self.stages[(row.stream, row.durable)] = stage
        consumers.declare(self.broker, self._consumer(stage, row))

    def add_batch(self, stage: BatchStage) -> None:
        """Declare a batch stage on its rows (see BatchStage.durable), one consumer each."""
        rows = [
            row
            for key, row in self.rows.items()
            if key not in self.stages and stage.durable in (None, row.durable)
        ]
        if not rows:
            wanted = f"durable {stage.durable!r}" if stage.durable else "rows"
            raise ValueError(
                f"{self.service}: no {wanted} without a stage in the handler table "
                "(runtime/topology.py)"
            )
        for row in rows:
            self.stages[(row.stream, row.durable)] = stage
            handler = self._batch_handler(stage, row)
            consumer = consumers.DurableBatchConsumer(
                row.stream,
                self._config(row, stage),
                handler,
                max(1, stage.max_messages),
                stage.max_wait_s,
            )
            consumers.declare(self.broker, consumer)

    def started_later(self, stage: Stage, tools: list[str]) -> consumers.DurableConsumer:
        """A stage for a tool served after the start (a pushed registry, the executor):
        its row comes from the table as for any stage; the consumer is returned for
        the caller to start, as the app's consumers are running already."""
        rows = {row.durable: row for row in rows_of(self.service, tools)}
        row = rows.get(stage.durable)
        if row is None:
            raise ValueError(f"{self.service}: no durable {stage.durable!r} in the handler table")
        if (row.stream, row.durable) in self.stages:
            raise ValueError(f"{self.service}: durable {stage.durable!r} declared twice")
        self.rows[(row.stream, row.durable)] = row
        self.stages[(row.stream, row.durable)] = stage
        return self._consumer(stage, row)

    def _consumer(self, stage: Stage, row: Handler) -> consumers.DurableConsumer:
        config = self._config(row, stage)
        handler = self._handler(stage, row)
        return consumers.DurableConsumer(row.stream, config, handler, max(1, stage.concurrency))

    @staticmethod
    def _config(row: Handler, stage: Stage | BatchStage) -> ConsumerConfig:
        return consumers.consumer_config(
            row.durable, row.filter_subject, stage.ack_wait_s, stage.max_ack_pending
        )

    def durable_for(self, filter_subject: str, tools: list[str] | None = None) -> str:
        """The durable of this service's row that consumes `filter_subject` (`tools`: the
        executor's rows for those tools, served after the start)."""
        rows = rows_of(self.service, tools) if tools else self.rows.values()
        for row in rows:
            if row.filter_subject == filter_subject:
                return row.durable
        raise ValueError(f"{self.service}: no row of the handler table consumes {filter_subject!r}")

    def unstaged(self) -> list[str]:
        """This service's durables that have no stage yet, in the table's order."""
        return [row.durable for key, row in self.rows.items() if key not in self.stages]

    def app(self, kind: type[FastStream] = FastStream) -> FastStream:
        return kind(self.broker)

    def alongside(self, name: str, loop: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A loop the service runs besides its stages (the approvals' expiry sweep, the
        audit's lag watch): `loop()` starts with the consumers and is cancelled at
        shutdown, before they stop."""
        if name in self.loops:
            raise ValueError(f"{self.service}: loop {name!r} declared twice")
        self.loops[name] = loop

    def run_consumers(self, app: FastStream) -> None:
        """Start the stages' consumers (and the loops alongside) once the app's start-up
        hooks declared so far have run; stop them at shutdown (after the shutdown hooks
        declared so far)."""
        missing = self.unstaged()
        if missing:
            raise ValueError(
                f"{self.service}: the handler table lists durable(s) with no stage: "
                f"{', '.join(missing)}"
            )
        running: list[asyncio.Task[None]] = []

        @app.after_startup
        async def start_loops() -> None:
            for name, loop in self.loops.items():
                running.append(asyncio.create_task(loop(), name=f"{self.service}-{name}"))

        @app.on_shutdown
        async def stop_loops() -> None:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

        consumers.run_consumers(app, self.broker)

    def _give_up(self, stage: Stage | BatchStage) -> GiveUp:
        """The stage's give-up, else the default: a dead letter (and the call's end)."""
        if stage.give_up is not None:
            return stage.give_up
        publisher, service, end_call = self.publisher, self.service, stage.end_call

        async def give_up(msg: Msg, delivery: settling.Delivery, exc: Exception) -> None:
            await giving_up.give_up_on(
                publisher, service, delivery, msg.data, exc, end_call=end_call
            )

        return give_up

    def _handler(self, stage: Stage, row: Handler) -> consumers.Handler:
        give_up_on = self._give_up(stage)

        async def handle(msg: Msg) -> None:
            emits.handling(row)  # this task's publishes are checked against the row
            delivery = settling.delivery_of(msg)
            if stage.settles_itself:
                await stage.work(msg, delivery)
                return

            async def work() -> None:
                await stage.work(msg, delivery)

            async def give_up(exc: Exception) -> None:
                await give_up_on(msg, delivery, exc)

            if stage.gate is None:
                await settling.settle(msg, delivery, work, give_up)
                return
            async with stage.gate(msg, delivery) as admitted:
                if admitted:
                    await settling.settle(msg, delivery, work, give_up)

        return handle

    def _batch_handler(self, stage: BatchStage, row: Handler) -> consumers.BatchHandler:
        give_up = self._give_up(stage)

        async def handle(msgs: list[Msg]) -> None:
            emits.handling(row)  # what this task publishes is checked against the row

            async def work() -> None:
                await stage.work(msgs)

            await settling.settle_batch(msgs, work, give_up)

        return handle


def event_of(raw: bytes, kind: type[E]) -> E:
    """The event a message holds, which must be a `kind` (else TypeError: a failed attempt)."""
    event = decode_event(raw)
    if not isinstance(event, kind):
        raise TypeError(f"expected {kind.__name__}, got {type(event).__name__}")
    return event
