"""The services' hot path on a real nats-server: PullConsumer (runtime/consumers.py) and
LeanJetStream (runtime/jetstream.py).

Every stage consumes through a PullConsumer and publishes through a
LeanJetStream, so these are the bus's promises the stages build on: every
message handled, at most `concurrency` at once, a slow message holding one
slot and not the others, a message whose handler gave up on it redelivered,
and publish answers (acks, duplicates, errors) exactly as nats-py gives them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig
from nats.js.errors import APIError, NoStreamResponseError

from toolgate.runtime import consumers, settling
from toolgate.runtime.jetstream import LeanJetStream
from toolgate.stack.nats_server import EmbeddedNats

STREAM = "PULLTEST"
SUBJECT = "pulltest.in"


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    await client.jetstream().add_stream(StreamConfig(name=STREAM, subjects=["pulltest.>"]))
    yield client
    await client.close()


async def publish(nc: Client, count: int) -> None:
    js = nc.jetstream()
    for i in range(count):
        await js.publish(SUBJECT, str(i).encode())


async def consume(
    nc: Client, handler: Callable[[Msg], Awaitable[None]], concurrency: int, ack_wait_s: float = 10
) -> consumers.PullConsumer:
    config = consumers.consumer_config("pulltest", SUBJECT, ack_wait_s=ack_wait_s)
    return await consumers.PullConsumer(
        nc, consumers.DurableConsumer(STREAM, config, handler, concurrency)
    ).start()


async def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached within {timeout_s} s")


async def test_every_message_is_handled_once_with_at_most_concurrency_at_once(nc: Client) -> None:
    await publish(nc, 50)
    handled: list[bytes] = []
    in_flight = peak = 0

    async def handler(msg: Msg) -> None:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        handled.append(msg.data)
        in_flight -= 1
        await msg.ack()

    consumer = await consume(nc, handler, concurrency=4)
    await until(lambda: len(handled) == 50)
    await consumer.stop()
    assert sorted(handled, key=int) == [str(i).encode() for i in range(50)]
    assert peak == 4  # a batch is handled at once, and never more than the slots


async def test_a_slow_message_holds_one_slot_while_the_others_go_through(nc: Client) -> None:
    release = asyncio.Event()
    done: list[bytes] = []

    async def handler(msg: Msg) -> None:
        if msg.data == b"slow":
            await release.wait()  # a long tool call
        done.append(msg.data)
        await msg.ack()

    await nc.jetstream().publish(SUBJECT, b"slow")
    consumer = await consume(nc, handler, concurrency=2)
    await asyncio.sleep(0.2)
    await publish(nc, 10)
    await until(lambda: len(done) == 10)  # through the one free slot, while "slow" waits
    assert b"slow" not in done
    release.set()
    await until(lambda: len(done) == 11)
    await consumer.stop()


async def test_a_message_its_handler_gave_up_on_is_redelivered(nc: Client) -> None:
    attempts: list[int] = []

    async def handler(msg: Msg) -> None:
        attempts.append(settling.delivery_of(msg).attempt)
        if len(attempts) == 1:
            raise RuntimeError("a bug: no ack, no nak")
        await msg.ack()

    await publish(nc, 1)
    consumer = await consume(nc, handler, concurrency=2, ack_wait_s=1.0)
    await until(lambda: len(attempts) == 2)
    await consumer.stop()
    assert attempts == [1, 2]


async def test_lean_publish_answers_as_nats_py_does(nc: Client) -> None:
    js = LeanJetStream(nc)
    first = await js.publish(SUBJECT, b"x", stream=STREAM, headers={"Nats-Msg-Id": "m1"})
    assert (first.stream, first.duplicate) == (STREAM, False)
    again = await js.publish(SUBJECT, b"x", stream=STREAM, headers={"Nats-Msg-Id": "m1"})
    assert (again.seq, again.duplicate) == (first.seq, True)
    with pytest.raises(APIError):  # the subject is not in the stream we expect
        await js.publish(SUBJECT, b"x", stream="ANOTHER")
    with pytest.raises(NoStreamResponseError):  # no stream captures the subject
        await js.publish("nowhere.at.all", b"x")
    kv = await js.create_key_value(bucket="pulltest_kv")
    assert await kv.create("k", b"v") == 1  # KV writes go through the same publish
