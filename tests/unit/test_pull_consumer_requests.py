"""PullConsumer (runtime/consumers.py) against a stand-in connection, so the order of
events a loaded machine produces (a request's end arriving after the loop gave
up on it, a handler slower than its AckWait) is played exactly, not waited for.

Before: every pull request replied on one inbox, so the late 408 of a request
the loop had given up on ended the current request in the loop's eyes; it
asked again while that one was still open on the server, and each later end
did the same: requests piled up, each with a batch, past the handler slots.
And a handler slowed past the AckWait had its message handed out again,
each delivery counting as an attempt towards MAX_ATTEMPTS (then a dead letter).
Also LeanJetStream's one reply subscription, which a cancelled publish broke.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from nats.aio.msg import Msg

from toolgate.runtime import consumers
from toolgate.runtime.jetstream import LeanJetStream


class Status:
    """A JetStream status message on a pull request's reply subject."""

    def __init__(self, subject: str, code: str) -> None:
        self.subject, self.reply, self.data = subject, "", b""
        self.headers = {"Status": code, "Description": "Request Timeout"}


class Delivered:
    """A delivered message: it has an ack reply subject; records in_progress."""

    def __init__(self) -> None:
        self.subject, self.reply, self.data, self.headers = "s.in", "$JS.ACK.x", b"", None
        self.in_progress_sent = 0

    async def in_progress(self) -> None:
        self.in_progress_sent += 1


class StandIn:
    """Records pull requests (their reply subjects); the test plays the server."""

    def __init__(self, on_ask: Callable[[int], None] = lambda n: None) -> None:
        self.asked: list[str] = []
        self.on_ask = on_ask
        self.deliver: Any = None

    def new_inbox(self) -> str:
        return "_INBOX.standin"

    async def subscribe(self, subject: str, cb: Any, **options: Any) -> object:
        self.deliver = cb
        return object()

    async def publish(self, subject: str, payload: bytes, reply: str = "") -> None:
        self.asked.append(reply)
        self.on_ask(len(self.asked))


async def no_consumer_to_create(*args: Any) -> None:
    return None


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(2000):  # a deadline for a hung loop, not a measure
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not reached")


async def settle_loop() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def consumer(nc: StandIn, handler: Any, ack_wait_s: float = 10.0) -> consumers.PullConsumer:
    config = consumers.consumer_config("d", "s.in", ack_wait_s=ack_wait_s)
    return consumers.PullConsumer(nc, consumers.DurableConsumer("S", config, handler, 4))  # type: ignore[arg-type]


async def test_the_late_end_of_a_request_given_up_on_does_not_end_the_current_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumers, "ensure_consumer", no_consumer_to_create)
    # The first request's end is "lost": the loop gives up on it at once and asks again;
    # from the second on, it waits for the server as usual.
    monkeypatch.setattr(consumers, "PULL_LOST_AFTER_S", 0.0)
    monkeypatch.setattr(consumers, "PULL_EXPIRES_S", 0.0)  # what the old loop's timeout came from

    def second_waits(n: int) -> None:
        if n == 2:
            monkeypatch.setattr(consumers, "PULL_LOST_AFTER_S", 3600.0)
            monkeypatch.setattr(consumers, "PULL_EXPIRES_S", 3600.0)

    nc = StandIn(second_waits)

    async def handler(msg: Msg) -> None:
        return None

    pulling = await consumer(nc, handler).start()
    try:
        await until(lambda: len(nc.asked) == 2)
        first, second = nc.asked
        await nc.deliver(Status(first, "408"))  # the end of the request given up on, late
        await settle_loop()
        assert nc.asked == [first, second]  # the second is still open: nothing more asked
        await nc.deliver(Status(second, "408"))  # the current request ends
        await until(lambda: len(nc.asked) == 3)
    finally:
        await pulling.stop()


async def test_a_message_held_past_a_third_of_its_ack_wait_is_kept_in_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(consumers, "ensure_consumer", no_consumer_to_create)
    nc = StandIn()
    release = asyncio.Event()

    async def slow(msg: Msg) -> None:  # a handler slowed by load
        await release.wait()

    pulling = await consumer(nc, slow, ack_wait_s=0.03).start()
    try:
        await until(lambda: len(nc.asked) == 1)
        held = Delivered()
        await nc.deliver(held)
        await until(lambda: held.in_progress_sent >= 2)  # every ~10 ms while in hand
        release.set()
        await until(lambda: not pulling._handling)
        sent = held.in_progress_sent
        await asyncio.sleep(0.1)  # several rounds of the keeper
        assert held.in_progress_sent == sent  # nothing for a message no longer in hand
    finally:
        await pulling.stop()


async def test_a_consumer_with_many_slots_held_asks_again_with_a_few_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The validator holds calls in its agents' waiting rooms (fair admission): most of
    # its slots can be taken by held calls. Before, it asked again only once a quarter
    # of all its slots were free, so another agent's call waited for 264 held ones.
    monkeypatch.setattr(consumers, "ensure_consumer", no_consumer_to_create)
    nc = StandIn()
    release = asyncio.Event()

    async def held(msg: Msg) -> None:
        await release.wait()

    slots = consumers.CONCURRENCY + 1024
    config = consumers.consumer_config("validator", "s.in")
    pulling = await consumers.PullConsumer(
        nc,  # type: ignore[arg-type]
        consumers.DurableConsumer("S", config, held, slots),
    ).start()
    try:
        await until(lambda: len(nc.asked) == 1)
        for _ in range(slots - consumers.CONCURRENCY // 4):
            await nc.deliver(Delivered())
        await nc.deliver(Status(nc.asked[0], "408"))
        await until(lambda: len(nc.asked) == 2)  # 8 slots free: asks for them
    finally:
        release.set()
        await pulling.stop()


class BlockingSubscribe:
    """A connection whose first subscribe waits until released; a publish is acked at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.on_reply: Any = None
        self.subscribes = 0

    def new_inbox(self) -> str:
        return "_INBOX.lean"

    async def subscribe(self, subject: str, cb: Any, **options: Any) -> object:
        self.subscribes += 1
        await self.release.wait()
        self.on_reply = cb
        return object()

    async def publish(self, subject: str, payload: bytes, reply: str = "", **kw: Any) -> None:
        ack = Delivered()
        ack.subject, ack.data = reply, b'{"stream":"S","seq":1}'
        asyncio.get_running_loop().call_soon(asyncio.ensure_future, self.on_reply(ack))


async def test_a_publish_cancelled_while_the_reply_subscription_opens_does_not_break_the_next() -> (
    None
):
    # Before: the first publish awaited the shared subscribing task itself, so cancelling
    # that publish (a tool's timeout) cancelled it, and every later publish of the
    # connection raised CancelledError: outputs never published, inputs never settled.
    nc = BlockingSubscribe()
    js = LeanJetStream(nc)  # type: ignore[arg-type]
    first = asyncio.ensure_future(js.publish("s.out", b"1"))
    await until(lambda: nc.subscribes == 1)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    nc.release.set()
    ack = await js.publish("s.out", b"2")
    assert ack.seq == 1
