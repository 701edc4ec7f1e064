"""Durables made with JetStream's default AckWait get their stage's on the next `toolgate up`."""

from __future__ import annotations

import dataclasses

import nats

from toolgate.contracts import subjects
from toolgate.runtime import consumers
from toolgate.runtime.topology import (
    apply_topology,
    executor_ack_wait,
    refresh_ack_waits,
    stage_ack_wait,
)
from toolgate.stack.nats_server import EmbeddedNats


async def test_existing_durables_get_the_ack_wait_of_their_stage(
    nats_server: EmbeddedNats,
) -> None:
    await apply_topology(nats_server.url)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    old = [
        (
            subjects.CALLS_STREAM,
            consumers.consumer_config("validator", subjects.CALLS_FILTER, 30.0),
        ),
        (
            subjects.EVENTS_STREAM,
            consumers.consumer_config(
                "executor-echo", f"{subjects.EVENTS_PREFIX}.CallAuthorized.echo", 30.0
            ),
        ),
    ]
    for stream, config in old:
        await js.add_consumer(stream, dataclasses.replace(config, name=config.durable_name))
    try:
        changed = await refresh_ack_waits(nats_server.url, {"echo": 2.0, "search_sources": 5.0})
        assert sorted(changed) == ["executor-echo", "validator"]
        validator = await js.consumer_info(subjects.CALLS_STREAM, "validator")
        executor = await js.consumer_info(subjects.EVENTS_STREAM, "executor-echo")
        assert validator.config.ack_wait == stage_ack_wait("validator")
        assert executor.config.ack_wait == executor_ack_wait(2.0)
        assert executor.config.filter_subject == f"{subjects.EVENTS_PREFIX}.CallAuthorized.echo"
        # Nothing left to change: a second run changes nothing.
        assert await refresh_ack_waits(nats_server.url, {"echo": 2.0}) == []
    finally:
        await nc.close()
