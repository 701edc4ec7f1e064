"""The notifier's HTTP edge: one POST, bounded in time, its answer reduced to a status.

An attempt never takes longer than its timeout, whatever the receiver does
(refuses, trickles, never answers): the whole request, connect to last byte of
the status line, runs under one deadline. The response body is not read (a
receiver cannot make the notifier hold or log its bytes), and redirects are
not followed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

DEFAULT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Answer:
    """What came of one attempt: an HTTP status, or `error` (a short, fixed-text
    reason: no receiver text, no URL)."""

    status: int | None = None
    error: str = ""

    @property
    def reason(self) -> str:
        return f"HTTP {self.status}" if self.status is not None else self.error


class Sender(Protocol):
    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer: ...


class HttpSender:
    """POSTs with one shared connection pool (httpx)."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import httpx  # here: `toolgate serve`'s flags read DEFAULT_TIMEOUT_S in every command

        self.timeout_s = timeout_s
        # httpx logs every request's URL at INFO: a webhook URL is a credential.
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
        )

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        import httpx

        try:
            async with asyncio.timeout(self.timeout_s):
                async with self._client.stream("POST", url, content=body, headers=headers) as r:
                    return Answer(status=r.status_code)
        except TimeoutError:
            return Answer(error=f"no answer within {self.timeout_s:g} s")
        except httpx.ConnectError:
            return Answer(error="connection failed (refused or unreachable)")
        except httpx.TimeoutException:
            return Answer(error=f"no answer within {self.timeout_s:g} s")
        except httpx.HTTPError as exc:
            return Answer(error=f"{type(exc).__name__}")

    async def close(self) -> None:
        await self._client.aclose()
