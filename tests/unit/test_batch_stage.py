"""The stage runner's batch stages (runtime/stage.py `BatchStage`): the audit sink's kind.

A batch is pulled by one request (runtime/consumers.py `BatchPullConsumer`, played
here against a stand-in connection, as in test_pull_consumer_requests.py), handed
to one task, kept `in_progress` by the consumers' one heartbeat while its work
waits, and settled message by message the same way (runtime/settling.py
`settle_batch`): all acked after the work; on a failure each retried, then given
up on (a dead letter) and terminated. The same on real servers: the audit tests
(tests/integration/test_audit_sink.py, tests/system/test_audit_*.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from nats.aio.msg import Msg

from tests.unit.test_pull_consumer_requests import StandIn, Status, no_consumer_to_create, until
from toolgate.contracts import subjects
from toolgate.runtime import consumers, settling
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import BatchStage, Stage, StageRunner

_sequences = iter(range(5000, 10**9))


class Stored:
    """A delivered message of a stream: what settling reads of it, and what it was told."""

    def __init__(self, attempt: int = 1, sequence: int | None = None) -> None:
        self.sequence = next(_sequences) if sequence is None else sequence
        self.attempt = attempt
        self.subject, self.data, self.headers = "toolgate.evt.X.y", b"{}", None
        self.reply = f"$JS.ACK.S.d.{attempt}.{self.sequence}.1.1.0"
        self.told: list[str] = []

    @property
    def metadata(self) -> SimpleNamespace:
        return SimpleNamespace(
            sequence=SimpleNamespace(stream=self.sequence), num_delivered=self.attempt
        )

    async def ack(self) -> None:
        self.told.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.told.append("nak")

    async def term(self) -> None:
        self.told.append("term")

    async def in_progress(self) -> None:
        self.told.append("wip")


async def test_a_batch_is_acked_as_a_whole_after_its_work() -> None:
    batch = [Stored() for _ in range(3)]
    seen: list[list[str]] = []

    async def work() -> None:
        seen.extend(list(m.told) for m in batch)

    async def never(msg: Any, delivery: Any, exc: Exception) -> None:
        raise AssertionError("nothing is given up")

    await settling.settle_batch(batch, work, never)  # type: ignore[arg-type]
    assert seen == [[], [], []]  # nothing acked while the work ran
    assert [m.told for m in batch] == [["ack"]] * 3


async def test_a_failed_batch_is_retried_then_each_message_given_up_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    batch = [Stored() for _ in range(3)]
    given_up: list[tuple[int, str]] = []

    async def work() -> None:
        raise ValueError("ClickHouse refused the block")

    async def give_up(msg: Any, delivery: settling.Delivery, exc: Exception) -> None:
        given_up.append((delivery.stream_sequence, str(exc)))

    for attempt in range(1, settling.MAX_ATTEMPTS + 1):
        for m in batch:
            m.attempt = attempt
        with caplog.at_level(logging.WARNING, logger="toolgate"):
            await settling.settle_batch(batch, work, give_up)  # type: ignore[arg-type]
        if attempt == 1:  # one line for the batch, not a line per message
            assert [r.getMessage()[:30] for r in caplog.records] == [
                "a batch of 3 message(s) failed"
            ]
    tries = ["nak"] * (settling.MAX_ATTEMPTS - 1)
    assert [m.told for m in batch] == [[*tries, "term"]] * 3
    assert given_up == [(m.sequence, "ClickHouse refused the block") for m in batch]


async def test_a_batch_the_bus_did_not_answer_is_retried_without_counting() -> None:
    batch = [Stored(attempt=settling.MAX_ATTEMPTS + 3) for _ in range(2)]

    async def work() -> None:
        raise TimeoutError("no publish ack")

    async def never(msg: Any, delivery: Any, exc: Exception) -> None:
        raise AssertionError("an outage is never given up on")

    await settling.settle_batch(batch, work, never)  # type: ignore[arg-type]
    assert [m.told for m in batch] == [["nak"], ["nak"]]


def batch_consumer(
    nc: StandIn, handler: Any, rows: int = 3, ack_wait_s: float = 10.0
) -> consumers.BatchPullConsumer:
    config = consumers.consumer_config("d", "s.in", ack_wait_s=ack_wait_s)
    return consumers.BatchPullConsumer(
        nc,  # type: ignore[arg-type]
        consumers.DurableBatchConsumer("S", config, handler, rows, max_wait_s=3600.0),
    )


class Asks(StandIn):
    """The stand-in connection, keeping each request's body too."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: list[dict[str, int]] = []

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        self.bodies.append(json.loads(payload))
        await super().publish(subject, payload, reply)


async def test_a_batch_is_one_request_and_one_handler_and_kept_while_it_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumers, "ensure_consumer", no_consumer_to_create)
    nc = Asks()
    handed: list[list[Msg]] = []
    release = asyncio.Event()

    async def insert(batch: list[Msg]) -> None:  # waits, as the audit's for ClickHouse
        handed.append(batch)
        await release.wait()

    pulling = await batch_consumer(nc, insert, rows=3, ack_wait_s=0.03).start()
    try:
        await until(lambda: len(nc.asked) == 1)
        assert nc.bodies[0]["batch"] == 3
        batch = [Stored() for _ in range(3)]
        for m in batch:
            await nc.deliver(m)
        await until(lambda: len(handed) == 1)
        assert handed[0] == batch
        # In hand past a sixth of the AckWait: each of its messages kept, by the one heartbeat.
        await until(lambda: all(m.told.count("wip") >= 2 for m in batch))
        assert len(nc.asked) == 1  # one batch in hand at a time: nothing more asked meanwhile
        release.set()
        await until(lambda: len(nc.asked) == 2)
        # Fewer than a batch, then the request expires: what came is the next batch.
        late = Stored()
        await nc.deliver(late)
        await nc.deliver(Status(nc.asked[1], "408"))
        await until(lambda: len(handed) == 2)
        assert handed[1] == [late]
    finally:
        release.set()
        await pulling.stop()


async def nothing(msgs: object) -> None:
    pass


def test_a_batch_stage_takes_every_row_of_its_service_from_the_table(tmp_path: Path) -> None:
    settings = GatewaySettings(nats_url="nats://127.0.0.1:1", data_dir=tmp_path)
    runner = StageRunner("audit", settings)
    assert runner.unstaged() == ["audit", "audit"]  # one durable name, a row per stream
    with pytest.raises(ValueError, match="on 2 streams"):
        runner.add(Stage("audit", lambda msg, delivery: nothing(msg)))
    runner.add_batch(BatchStage(nothing, max_messages=10, max_wait_s=1.0))
    assert sorted(stream for stream, _ in runner.stages) == sorted(
        [subjects.CALLS_STREAM, subjects.EVENTS_STREAM]
    )
    assert runner.unstaged() == []
    with pytest.raises(ValueError, match="no rows without a stage"):
        runner.add_batch(BatchStage(nothing, max_messages=10, max_wait_s=1.0))
    runner.run_consumers(runner.app())  # every row has its stage
