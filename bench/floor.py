"""The floor the pipeline is measured against: the raw bus, four JetStream hops.

Four pass-through hops in one Python process, written with plain nats-py
(DESIGN.md, "Known facts worth knowing"): each hop has its own connection and
durable pull consumer, fetches in batches, republishes each message's body to
the next hop's subject with a publish ack (and a `Nats-Msg-Id`, as a service
does) and then acks it. Nothing else: no decoding, no validation, no policy,
no audit. The last hop publishes to `toolgate_bench.out.<call_id>`, where the
bench's client waits, as an agent waits on its results subject.

A batch is handled concurrently and the next fetch waits for it (the
services' pull loops, toolgate.runtime.consumers.PullConsumer, do not wait: they
ask again as handler slots free up). Run as a process of its own
(`python -m toolgate.bench.floor`), so its CPU is counted apart from the
client's; it prints `ready` once every hop is subscribed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError

from toolgate.runtime.creds import connect_options

STREAM = "TOOLGATE_BENCH_FLOOR"
SUBJECT_PREFIX = "toolgate_bench"
CALL_HEADER = "Tg-Call-Id"
HOPS = 4
BATCH = (
    16  # messages per fetch (the services ask for their free slots: runtime.consumers.CONCURRENCY)
)


def hop_subject(index: int) -> str:
    return f"{SUBJECT_PREFIX}.hop{index}"


def out_subject(call_id: str) -> str:
    return f"{SUBJECT_PREFIX}.out.{call_id}"


def stream_config() -> StreamConfig:
    # File storage and a duplicate window, like the gateway's events stream.
    return StreamConfig(
        name=STREAM,
        subjects=[f"{SUBJECT_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        duplicate_window=120.0,
        max_age=3600.0,
    )


def consumer_config(index: int) -> ConsumerConfig:
    # The services' consumer shape (toolgate.runtime.consumers.consumer_config).
    return ConsumerConfig(
        durable_name=f"bench-hop{index}",
        filter_subject=hop_subject(index),
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=30.0,
        max_deliver=-1,
        max_ack_pending=1000,
    )


async def reset_stream(js: JetStreamContext) -> None:
    """A fresh, empty floor stream (its consumers go with the old one)."""
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(STREAM)
    await js.add_stream(stream_config())


async def delete_stream(js: JetStreamContext) -> None:
    with contextlib.suppress(NotFoundError):
        await js.delete_stream(STREAM)


async def _hop(nc: Client, index: int, last: bool, batch: int, ready: asyncio.Event) -> None:
    js = nc.jetstream()
    psub = await js.pull_subscribe(
        hop_subject(index),
        durable=f"bench-hop{index}",
        stream=STREAM,
        config=consumer_config(index),
    )

    async def forward(msg: Msg) -> None:
        call_id = (msg.headers or {}).get(CALL_HEADER, "")
        target = out_subject(call_id) if last else hop_subject(index + 1)
        await js.publish(
            target,
            msg.data,
            stream=STREAM,
            headers={CALL_HEADER: call_id, "Nats-Msg-Id": f"{call_id}.{index}"},
        )
        await msg.ack()

    ready.set()
    await pump(lambda: psub.fetch(batch, timeout=1.0), forward)


async def pump(
    fetch: Callable[[], Awaitable[list[Msg]]], forward: Callable[[Msg], Awaitable[None]]
) -> None:
    """Fetch and forward until cancelled. An idle fetch times out: nats-py raises its
    own TimeoutError, and 2.16 sometimes a bare asyncio one; both mean "nothing yet"
    (the builtin TimeoutError covers both on 3.11), never the end of the hop."""
    while True:
        try:
            messages = await fetch()
        except TimeoutError:
            continue
        await asyncio.gather(*(forward(m) for m in messages))


async def run_hops(nats_url: str, creds: Path | None, hops: int = HOPS, batch: int = BATCH) -> None:
    connections = [
        await nats.connect(nats_url, name=f"bench-hop{i}", **connect_options(creds))
        for i in range(hops)
    ]
    tasks = []
    for index, nc in enumerate(connections):
        ready = asyncio.Event()
        task = asyncio.create_task(_hop(nc, index, index == hops - 1, batch, ready))
        tasks.append(task)
        await asyncio.wait(
            [task, asyncio.create_task(ready.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if task.done():
            task.result()  # it failed before subscribing: say why
    print("ready", flush=True)
    await asyncio.gather(*tasks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--hops", type=int, default=HOPS)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--creds", type=Path, default=None)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run_hops(args.nats_url, args.creds, args.hops, args.batch))
    sys.exit(0)


if __name__ == "__main__":
    main()
