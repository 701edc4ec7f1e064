"""The stage runner's app on a real nats-server: what it starts with the consumers and
stops at shutdown (runtime/stage.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from faststream import TestApp
from nats.aio.msg import Msg

from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import BatchStage, StageRunner
from toolgate.runtime.topology import apply_topology
from toolgate.stack.nats_server import EmbeddedNats


async def test_a_loop_alongside_runs_with_the_consumers_and_stops_at_shutdown(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    await apply_topology(nats_server.url)
    runner = StageRunner("audit", GatewaySettings(nats_url=nats_server.url, data_dir=tmp_path))

    async def write(batch: list[Msg]) -> None:
        pass

    runner.add_batch(BatchStage(write, max_messages=10, max_wait_s=0.5))
    started, stopped = asyncio.Event(), asyncio.Event()

    async def sweep() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    runner.alongside("sweep", sweep)
    app = runner.app()
    runner.run_consumers(app)
    async with TestApp(app):
        await asyncio.wait_for(started.wait(), 30)
        assert not stopped.is_set()
    assert stopped.is_set()
