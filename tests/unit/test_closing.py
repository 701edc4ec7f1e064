"""end_connection: a reconnect loop whose cancellation was lost is cancelled again."""

from __future__ import annotations

import asyncio
from typing import Any

from toolgate.runtime.closing import end_connection


class _ClosedClient:
    """What end_connection reads of a nats-py client that closed while reconnecting."""

    is_connected = False
    is_draining = False
    is_closed = True

    def __init__(self, reconnecting: asyncio.Task[Any]) -> None:
        self._reconnection_task = reconnecting


async def test_a_reconnect_loop_that_lost_its_cancellation_is_ended() -> None:
    swallowed = 0

    async def loop_that_loses_one_cancel() -> None:
        # As nats-py's loop does when the cancellation lands while an attempt fails:
        # the attempt's error is caught and the loop goes on.
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise

    task = asyncio.create_task(loop_that_loses_one_cancel())
    await asyncio.sleep(0.02)
    task.cancel()  # what nats-py's close() does, once
    await asyncio.sleep(0.05)
    assert not task.done()  # lost: the loop runs on
    await end_connection(_ClosedClient(task))  # type: ignore[arg-type]
    assert task.cancelled()
    assert swallowed == 2
