"""A result subject is written once; a writer that finds it full learns whether it was its own.

A stage that stored a result and crashed before its ack retries with the same
Nats-Msg-Id. Within the duplicate window JetStream answers "duplicate"; after
it, the write-once subject answers "full", and the publisher reads the stored
message back to tell its own earlier write from someone else's.
"""

from __future__ import annotations

import asyncio

import nats

from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, success
from toolgate.runtime import process, publishing
from toolgate.runtime.topology import Topology, apply_topology
from toolgate.stack.nats_server import EmbeddedNats

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")


async def test_a_full_subject_is_ours_only_if_it_holds_our_message(
    nats_server: EmbeddedNats,
) -> None:
    # The shortest duplicate window NATS allows, so a retry falls outside it.
    await apply_topology(nats_server.url, Topology(duplicate_window_s=0.1))
    broker = process.make_broker(nats_server.url, "test-results")
    await broker.connect()
    try:
        publisher = publishing.Publisher(broker)
        first = success("c1", {"n": 1})
        assert await publisher.publish_result(first, ALICE, message_id="attach-1") is True
        await asyncio.sleep(0.3)  # past the duplicate window: the stream now answers "full"
        assert await publisher.publish_result(first, ALICE, message_id="attach-1") is True
        other = success("c1", {"n": 2})
        assert await publisher.publish_result(other, ALICE, message_id="attach-2") is False
    finally:
        await broker.stop()

    nc = await nats.connect(nats_server.url)
    try:
        stored = await nc.jetstream().get_last_msg(
            subjects.RESULTS_STREAM,
            subjects.results_subject("acme", "researcher", "c1"),
            direct=True,
        )
        assert (
            stored.data == b'{"call_id":"c1","ok":true,"status":"ok","data":{"n":1},"error":null}'
        )
    finally:
        await nc.close()
