"""The floor the pipeline is measured against: N JetStream hops that do no work.

Each hop is its own process, consumes with the same FastStream pull
subscriber and manual ack as a toolgate service, and republishes the body
with a publish ack. Nothing else: no decoding, no validation, no policy.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from faststream import FastStream
from faststream.nats.message import NatsMessage
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from toolgate.runtime import bus

STREAM = "TOOLGATE_BENCH_FLOOR"
SUBJECT_PREFIX = "toolgate_bench"
CALL_HEADER = "Tg-Call-Id"


def hop_subject(index: int) -> str:
    return f"{SUBJECT_PREFIX}.hop{index}"


def out_subject(call_id: str) -> str:
    return f"{SUBJECT_PREFIX}.out.{call_id}"


def stream_config() -> StreamConfig:
    return StreamConfig(name=STREAM, subjects=[f"{SUBJECT_PREFIX}.>"],
                        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                        duplicate_window=120.0)


def build_hop(nats_url: str, index: int, last: bool, creds: Path | None = None) -> FastStream:
    broker = bus.make_broker(nats_url, f"bench-hop{index}", creds)
    durable = f"bench-hop{index}"
    source = hop_subject(index)

    @bus.durable_subscriber(broker, source, STREAM, durable)
    async def forward(msg: NatsMessage) -> None:
        call_id = (msg.raw_message.headers or {}).get(CALL_HEADER, "")
        target = out_subject(call_id) if last else hop_subject(index + 1)
        # Same publish as a service does: to a stream, with a dedupe id and a publish ack.
        await broker.publish(msg.body, subject=target, stream=STREAM,
                             headers={CALL_HEADER: call_id, "Nats-Msg-Id": f"{call_id}.{index}"})
        await msg.ack()

    return FastStream(broker)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--hop", type=int, required=True)
    parser.add_argument("--hops", type=int, required=True)
    parser.add_argument("--creds", type=Path, default=None)
    args = parser.parse_args()
    asyncio.run(build_hop(args.nats_url, args.hop, args.hop == args.hops - 1, args.creds).run())


if __name__ == "__main__":
    main()
