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
from typing import TypeVar

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
