"""A service's process: its NATS connection (a FastStream broker), its event loop, its GC.

FastStream owns each service's process: the connection (reconnects, the
locked bus's creds), start-up and shutdown hooks, signals, and the approvals
service's request/reply. The hot path does not go through it: the durable
consumers are runtime/consumers.py's, publishing is runtime/publishing.py's.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from faststream.nats import NatsBroker

from toolgate.runtime.creds import broker_options, nats_servers

log = logging.getLogger("toolgate")


class _QuietSupervisor(logging.Filter):
    """Drop FastStream's task-supervisor chatter: an INFO line each time a pull loop
    ends, and a traceback when an idle fetch times out (it is restarted at once)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text.startswith("callback for ") and text.endswith("is being executed..."):
            return False
        return not (
            text.endswith(
                "raised an exception, retrying...\n"
                "If this behavior causes issues, you can disable it via "
                "setting the FASTSTREAM_SUPERVISOR_DISABLED env to 1. Also, "
                "please consider opening issue on the repository: "
                "https://github.com/ag2ai/faststream."
            )
            and record.exc_info is not None
            and isinstance(record.exc_info[1], TimeoutError)
        )


log.addFilter(_QuietSupervisor())


def worker_name(service: str) -> str:
    return f"{service}@{socket.gethostname()}:{os.getpid()}"


def tune_gc_for_a_service() -> None:
    """Keep the cyclic GC off the hot path of a long-running service.

    Profiled under load (py-spy + GC timing): full collections walked the ~70k
    objects every service holds from start-up, about 40 ms each, some 14% of the
    validator's CPU. Freezing what exists after start-up takes it out of every
    later collection; a larger young generation makes collections rarer.
    """
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


def make_broker(nats_url: str, name: str, creds: Path | None = None) -> NatsBroker:
    # Reconnect forever: a restarted NATS server must not need restarted services.
    # apply_types=False: handlers take the raw message and decode it themselves
    # with msgspec. FastDepends' per-message injection ran sync resolvers in a
    # thread pool and cost 4x in latency and throughput (measured: one hop
    # 6.7 ms -> 1.7 ms p50, 334 -> 1185 msgs/s).
    return NatsBroker(
        nats_servers(nats_url),  # a cluster: every node's URL
        name=name,
        apply_types=False,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        logger=log,
        # Per-message "Received/Processed" lines only at DEBUG: the events
        # stream and the audit table are the record, not the service log.
        log_level=logging.DEBUG,
        # On a locked bus: log in as this service's role (nkey, and its inbox prefix).
        **broker_options(creds),
    )


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's app on uvloop: its sockets, callbacks and timers cost about
    half of asyncio's default loop per message (profiled: `write` syscalls and
    `_run_once` were 20-25% of the validator's and the attacher's samples)."""
    try:
        import uvloop
    except ImportError:  # an install without it still runs, on the default loop
        asyncio.run(main)
        return
    uvloop.run(main)
