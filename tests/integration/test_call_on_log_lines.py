"""A line logged while a stage handles a call's message names the call: call_id, tenant and
agent, in the services' log format (runtime/call_context.py, set by the bus's PullConsumer).

On a real nats-server: a ToolCall on its calls subject (tenant and agent from the subject)
and an event of a call (from its principal), each handled by a handler that logs a line
and fails once, so the bus's own retry line is checked too.
"""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import StreamConfig

from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import ExecutionStarted, encode_event, utc_now
from toolgate.runtime import consumers, settling
from toolgate.runtime.call_context import SERVICE_LOG_FORMAT, log_calls
from toolgate.runtime.outside_text import VisibleLogFormatter
from toolgate.stack.nats_server import EmbeddedNats

STREAM = "LOGTEST"
log = logging.getLogger("toolgate.logtest")


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url)
    await client.jetstream().add_stream(
        StreamConfig(name=STREAM, subjects=["toolgate.calls.>", "logtest.>"])
    )
    yield client
    await client.close()


@pytest.fixture
def service_log() -> Iterator[io.StringIO]:
    """The root logger's handler as `toolgate serve` sets it up, writing to a buffer."""
    lines = io.StringIO()
    handler = logging.StreamHandler(lines)
    handler.setFormatter(VisibleLogFormatter(SERVICE_LOG_FORMAT.format(service="logtest")))
    holder = logging.Logger("holder")  # log_calls puts the filter on a logger's handlers
    holder.addHandler(handler)
    log_calls(holder)
    root = logging.getLogger()
    root.addHandler(handler)
    level = root.level
    root.setLevel(logging.INFO)
    yield lines
    root.removeHandler(handler)
    root.setLevel(level)


async def until(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not reached within {timeout_s} s")


async def test_lines_logged_while_handling_a_call_name_it(
    nc: Client, service_log: io.StringIO
) -> None:
    principal = Principal(tenant="acme", user="u1", agent="bot", session="s1")
    call = ToolCall(call_id="c-1234", tool="echo", arguments={}, principal=principal)
    event = ExecutionStarted(
        event_id="e-1",
        occurred_at=utc_now(),
        service="executor",
        call_id="c-5678",
        principal=Principal(tenant="globex", user="u2", agent="helper", session="s2"),
        tool="echo",
        attempt=1,
        worker="w",
    )
    js = nc.jetstream()
    await js.publish(subjects.calls_subject("acme", "bot"), msgspec.json.encode(call))
    await js.publish("logtest.events", encode_event(event))
    await js.publish("logtest.events", b"not a call")
    acked: list[str] = []

    async def handler(msg: Msg) -> None:
        delivery = settling.delivery_of(msg)

        async def work() -> None:
            log.info("handling %s", msg.subject)
            if delivery.attempt == 1:
                raise ValueError("first attempt fails")
            acked.append(msg.subject)

        async def give_up(exc: Exception) -> None:
            raise AssertionError("never gives up here")

        await settling.settle(msg, delivery, work, give_up)

    config = consumers.consumer_config("logtest", ">", ack_wait_s=10)
    consumer = await consumers.PullConsumer(
        nc, consumers.DurableConsumer(STREAM, config, handler, concurrency=4)
    ).start()
    await until(lambda: len(acked) == 3)
    await consumer.stop()
    log.info("after the calls")

    lines = service_log.getvalue().splitlines()
    for shown in (
        "tenant=acme agent=bot call_id=c-1234 ",
        "tenant=globex agent=helper call_id=c-5678 ",
    ):
        mine = [line for line in lines if shown in line]
        assert any(" INFO " + shown + "handling " in line for line in mine), lines
        assert any("attempt 1 on" in line for line in mine), lines  # the bus's own line
        assert all(line.count("call_id=") == 1 for line in mine)
    unnamed = [line for line in lines if "handling logtest" in line and "call_id" not in line]
    assert len(unnamed) == 2  # the message that names no call: its two attempts, no call shown
    assert [line for line in lines if "after the calls" in line] == [
        next(line for line in lines if line.endswith("INFO after the calls"))
    ]
