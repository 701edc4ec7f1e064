"""The raw floor's hop survives an idle fetch, whichever TimeoutError nats-py raises."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest

from toolgate.bench.floor import pump


@pytest.mark.parametrize(
    "idle",
    [asyncio.TimeoutError, nats.errors.TimeoutError],
    ids=["bare asyncio", "nats-py's own"],
)
async def test_an_idle_fetch_does_not_end_the_hop(idle: type[BaseException]) -> None:
    batches: list[object] = [idle(), idle(), ["m1", "m2"], ["m3"]]
    forwarded: list[str] = []
    drained = asyncio.Event()

    async def fetch() -> list[str]:
        if not batches:
            drained.set()
            await asyncio.Event().wait()  # idle forever, like a quiet stream
        step = batches.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step  # type: ignore[return-value]

    async def forward(msg: str) -> None:
        forwarded.append(msg)

    hop = asyncio.create_task(pump(fetch, forward))  # type: ignore[arg-type]
    await asyncio.wait_for(drained.wait(), timeout=10)
    assert not hop.done(), "the hop ended on an idle fetch"
    hop.cancel()
    assert forwarded == ["m1", "m2", "m3"]
