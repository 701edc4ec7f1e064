"""The HTTP servers' guard against slow clients (the MCP front door and the web inbox).

Both run uvicorn with its httptools parser. Uvicorn bounds an idle keep-alive
connection (`timeout_keep_alive`) but nothing else: its keep-alive timer is not
armed before a connection's first request and any byte received cancels it, so a
client that trickles a request head (or a body) a byte at a time holds its socket,
and its protocol object, for as long as it likes; `limit_concurrency` answers 503
only once a request head is complete, so it does not free those either (uvicorn
0.55; `h11_max_incomplete_event_size` bounds the size of a head with h11, not its
time, and httptools has no such knob).

`GuardedHttpProtocol` adds, at the protocol level (no ASGI involved):
- a head deadline: from the connection's start, and from the end of each response,
  the next request head must be complete within `head_timeout_s` or the server
  closes the connection;
- a body deadline: once a head is complete, its body must be in within
  `body_timeout_s`;
- a connection cap: a connection beyond `max_connections` is closed as soon as it is
  accepted (it costs one accept and one close, no protocol state kept).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from toolgate.runtime.outside_text import escape_logger

log = logging.getLogger("toolgate.http")
# uvicorn's loggers: its access log quotes the request path (and a client address that
# X-Forwarded-For may set), its error log a client's request; both come from outside.
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")

# A browser or an SDK sends a request head in one packet: 10 s is ample on a slow link
# and lets a slow-client flood hold a socket for 10 s, not forever.
HEAD_TIMEOUT_S = 10.0
# A body is sent right after its head: the largest a door takes (an 8 MiB MCP call) needs
# about 2.2 Mbit/s to arrive within 30 s; the doors are meant for loopback or a LAN.
BODY_TIMEOUT_S = 30.0
# Uvicorn's own default: an idle keep-alive connection is closed after 5 s.
IDLE_TIMEOUT_S = 5.0
REFUSED_LOG_EVERY_S = 10.0


@dataclass(frozen=True)
class SlowClientLimits:
    max_connections: int
    head_timeout_s: float = HEAD_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head and body deadlines and a connection cap."""

    limits: SlowClientLimits = SlowClientLimits(max_connections=1000)
    refused = 0  # connections closed over the cap, by this class (one per server)
    refused_logged_at = float("-inf")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.transport is not None and not self.transport.is_closing():
            log.debug("closed a connection that was too slow to send its request")
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        # `connections` holds every open connection of this server, this one not yet.
        if len(self.connections) >= self.limits.max_connections:
            self._refused_one()
            self.transport = transport
            transport.abort()
            return
        super().connection_made(transport)
        self._arm(self.limits.head_timeout_s)

    def _refused_one(self) -> None:
        """Count a refused connection; log the count at most every REFUSED_LOG_EVERY_S
        (a flood must not become a flood of log lines)."""
        cls = type(self)
        cls.refused += 1
        now = self.loop.time()
        if now - cls.refused_logged_at >= REFUSED_LOG_EVERY_S:
            cls.refused_logged_at = now
            log.warning(
                "connections over the cap of %d: %d refused so far",
                self.limits.max_connections,
                cls.refused,
            )

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self not in self.connections:  # refused in connection_made
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self not in self.connections:  # refused, or gone
            return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._arm(self.limits.body_timeout_s)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and not self.pipeline:
            # Idle now: keep-alive closes it after idle_timeout_s; a head begun meanwhile
            # (which cancels keep-alive) must be complete within head_timeout_s.
            self._arm(self.limits.head_timeout_s)


def guarded_protocol(limits: SlowClientLimits) -> type[GuardedHttpProtocol]:
    """A protocol class for uvicorn.Config(http=...) with these limits."""
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), {"limits": limits})


def uvicorn_config(app: Any, host: str, port: int, limits: SlowClientLimits, **kw: Any) -> Any:
    """A uvicorn.Config for a door: the guarded protocol, its idle timeout and cap; its
    log lines (the access log's request path included) with outside text escaped."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        timeout_keep_alive=int(limits.idle_timeout_s),
        # uvicorn answers 503 to a request that finds the cap reached (open connections or
        # requests in progress): at the cap a request is told so at once, not queued.
        limit_concurrency=limits.max_connections,
        **kw,
    )
    # After the Config: it (re)configures uvicorn's logging as it is made; filters stay.
    for name in UVICORN_LOGGERS:
        escape_logger(name)
    return config


__all__ = [
    "BODY_TIMEOUT_S",
    "HEAD_TIMEOUT_S",
    "IDLE_TIMEOUT_S",
    "GuardedHttpProtocol",
    "SlowClientLimits",
    "guarded_protocol",
    "uvicorn_config",
]
