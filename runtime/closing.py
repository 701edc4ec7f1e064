"""Ending a NATS connection, the same way in every client and door.

Connected: what is in flight is delivered first (a drain). The bus away (the
connection reconnecting), or a drain cut short: closed at once. nats-py's
`drain()` raises on a reconnecting connection and leaves its reconnect loop
running, so a process that only drained could neither end cleanly nor at all.

And `close()` cancels the reconnect loop once. On Python 3.11 that cancellation can
be lost when it lands as a connection attempt fails (asyncio.wait_for then raises
the attempt's OSError, which the loop catches and retries): the loop then runs on
after the close, and whoever waits for the event loop's tasks (asyncio.run, a test
teardown) waits forever. It is cancelled again until it has ended.
"""

from __future__ import annotations

import asyncio
import contextlib

from nats.aio.client import Client


async def end_connection(nc: Client) -> None:
    if nc.is_connected and not nc.is_draining:
        with contextlib.suppress(Exception):  # lost mid-drain: closed below
            await nc.drain()
    if not nc.is_closed:
        await nc.close()
    reconnecting = getattr(nc, "_reconnection_task", None)  # nats-py's, private
    for _ in range(100):
        if reconnecting is None or reconnecting.done():
            return
        reconnecting.cancel()
        await asyncio.sleep(0.02)
