"""Waiting on a condition instead of sleeping a fixed time.

`eventually(check)` asks `check` again and again until it returns something truthy
(and returns that), or raises AssertionError once `timeout` has passed: the timeout
only bounds how long a broken gateway is waited on, it is never a threshold under test.
A check may be a plain function or a coroutine function.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import nats

from toolgate.runtime.creds import nats_servers

if TYPE_CHECKING:
    from tests.harness import Gateway

T = TypeVar("T")

GIVE_UP_S = 60.0  # bounded waits: only to give up, never a threshold under test
POLL_S = 0.05


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    timeout: float = GIVE_UP_S,
    interval: float = POLL_S,
    what: str = "",
) -> T:
    """The first truthy value `check()` returns, asked every `interval` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"not so after {timeout:.0f} s: {what or check!r} ({value!r})")
        await asyncio.sleep(interval)


def wait_until(
    check: Callable[[], T],
    timeout: float = GIVE_UP_S,
    interval: float = POLL_S,
    what: str = "",
) -> T:
    """`eventually` for plain (not async) tests and checks."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not so after {timeout:.0f} s: {what or check!r} ({value!r})")
        time.sleep(interval)


async def settled(url: str, stream: str, durable: str, **options: Any) -> bool:
    """True once durable `durable` has been handed and has acked everything in `stream`
    it filters: whatever it does with a message stored before this call is done.
    (`options`: nats.connect's.)"""
    nc = await nats.connect(nats_servers(url), **options)
    try:
        info = await nc.jsm().consumer_info(stream, durable)
    finally:
        await nc.close()
    return info.num_pending == 0 and info.num_ack_pending == 0


async def all_settled(gateway: Gateway, timeout: float = 120.0) -> None:
    """Every stage of `gateway` has handled every message stored so far: each of its
    durables (the handler table's) acked all it was handed, in two rounds in a row (a
    stage asked early in one round may since have been handed an event by a later one)."""

    async def every_durable() -> bool:
        for stream, durable in gateway.durables():
            if not await gateway.settled(stream, durable):
                return False
        return True

    for _ in range(2):
        await eventually(every_durable, timeout=timeout, interval=0.2, what="the gateway settled")
