"""Held acks (runtime/acking.py) on a real nats-server: a stage's ack goes out in the
write of whatever its connection sends next, never in a write of its own, and none is
lost: the ones still held when the consumer stops are sent before it is done.

The socket writes are seen by recording what nats-py hands its transport (the server is
the real one; nothing of its behaviour is imitated).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from toolgate.runtime import acking, consumers, settling
from toolgate.runtime.jetstream import LeanJetStream
from toolgate.stack.nats_server import EmbeddedNats

STREAM = "HELDACKS"
IN, OUT = "heldacks.in", "heldacks.out"
DURABLE = "heldacks"


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    await client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["heldacks.>"]))
    yield client
    await client.close()


def record_writes(nc: Client) -> list[bytes]:
    """Every write nats-py makes on `nc` from now on, as the bytes it hands the socket."""
    writes: list[bytes] = []
    transport = nc._transport
    assert transport is not None
    write_lines = transport.writelines

    def recording(payload: list[bytes]) -> None:
        writes.append(b"".join(payload))
        write_lines(payload)

    transport.writelines = recording  # type: ignore[method-assign]
    return writes


async def ack_pending(nats_server: EmbeddedNats) -> int:
    other = await nats.connect(nats_server.url)
    try:
        info = await other.jetstream().consumer_info(STREAM, DURABLE)
    finally:
        await other.close()
    return info.num_ack_pending or 0


async def test_a_stages_ack_rides_on_its_next_write_and_the_last_goes_out_at_stop(
    nc: Client, nats_server: EmbeddedNats
) -> None:
    # Held for an hour: only a write of the connection (or the stop) sends them here.
    acking.hold_acks_on(nc, hold_s=3600)
    js = LeanJetStream(nc)
    handled: asyncio.Queue[int] = asyncio.Queue()

    async def stage(msg: Msg) -> None:
        delivery = settling.delivery_of(msg)

        async def work() -> None:  # the stage's output, stored before the input is acked
            await js.publish(OUT, b"out-" + msg.data, stream=STREAM)

        async def give_up(exc: Exception) -> None:
            raise AssertionError(f"gave up: {exc!r}")

        await settling.settle(msg, delivery, work, give_up)
        await handled.put(delivery.stream_sequence)

    config = consumers.consumer_config(DURABLE, IN, ack_wait_s=60)
    consumer = await consumers.PullConsumer(
        nc, consumers.DurableConsumer(STREAM, config, stage, 8)
    ).start()
    feeder = await nats.connect(nats_server.url)
    try:
        writes = record_writes(nc)
        calls = 12
        for i in range(calls):  # one at a time, as an agent calling and waiting
            await feeder.jetstream().publish(IN, str(i).encode())
            await asyncio.wait_for(handled.get(), 30)
        assert await ack_pending(nats_server) == 1  # the last one's ack is held still
        acks = [w.count(b"PUB $JS.ACK.") for w in writes]
        assert sum(acks) == calls - 1  # every other ack went out...
        alone = [w for w in writes if w.count(b"PUB $JS.ACK.") and b"HPUB heldacks.out" not in w]
        alone = [w for w in alone if b"PUB $JS.API.CONSUMER.MSG.NEXT" not in w]
        assert alone == []  # ...in the write of an output (or of a pull request), never alone
        await consumer.stop()
        assert await ack_pending(nats_server) == 0  # the held one was sent at the stop
    finally:
        await feeder.close()


class AckRecorder:
    def __init__(self, name: str, acked: list[str]) -> None:
        self.subject, self._name, self._acked = name, name, acked

    async def ack(self) -> None:
        self._acked.append(self._name)


async def test_acks_held_with_nothing_else_to_send_go_out_within_the_hold_time() -> None:
    acked: list[str] = []
    held = acking.HeldAcks(hold_s=0.01)
    for name in ("a", "b", "c"):
        held.hold(AckRecorder(name, acked))  # type: ignore[arg-type]
    assert acked == [] and len(held) == 3  # held, not sent
    for _ in range(3000):
        if len(acked) == 3:
            break
        await asyncio.sleep(0.01)
    assert acked == ["a", "b", "c"] and len(held) == 0  # in the order they were settled
