"""A service's HTTP endpoint (`toolgate serve NAME --http-port N`): health and metrics.

- `GET /healthz` (liveness): 200 while every dependency (NATS; for the audit
  also ClickHouse) answered within the grace period, else 503 with the
  reasons. A service that lost NATS for longer than that is restarted (by
  `toolgate up`'s supervisor, or by Kubernetes), which is also what unsticks
  one whose connection is wedged.
- `GET /readyz` (readiness): 200 while every dependency answers now.
- `GET /metrics`: the Prometheus text of runtime/telemetry.py, plus the
  pending and ack-pending count of each of this service's durable consumers,
  read from JetStream every few seconds (and approvals waiting, for the
  approvals service; audit lag, for the audit).

The server runs on the service's own event loop, so a loop that stops
turning stops answering, and fails its probe too. `toolgate up`'s supervisor
polls the same `/healthz`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import urllib.request
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from toolgate.runtime import telemetry

log = logging.getLogger("toolgate.health")

DEFAULT_GRACE_S = 30.0
NATS_CHECK_S = 1.0
CLICKHOUSE_CHECK_S = 2.0
CONSUMERS_CHECK_S = 5.0


# ---------------------------------------------------------------- the verdict (pure)


@dataclass
class Dependency:
    """One thing a service needs, and when it last answered (monotonic seconds)."""

    name: str
    last_ok: float | None = None
    ok_now: bool = False
    # Another dependency this one is not tried before (the audit sink connects to NATS
    # once ClickHouse has answered): while that one never has, this one is not blamed.
    waits_for: str | None = None


def _waiting(dep: Dependency, dependencies: list[Dependency]) -> bool:
    return dep.last_ok is None and any(
        other.name == dep.waits_for and other.last_ok is None for other in dependencies
    )


def alive(
    now: float, started_at: float, dependencies: list[Dependency], grace_s: float
) -> tuple[bool, list[str]]:
    """Liveness: every dependency answered within `grace_s` (counted from the start
    for one that never has). Returns (alive, why not)."""
    reasons = []
    for dep in dependencies:
        if _waiting(dep, dependencies):
            continue
        since = dep.last_ok if dep.last_ok is not None else started_at
        if now - since > grace_s:
            what = "never answered" if dep.last_ok is None else f"lost for {now - since:.0f} s"
            reasons.append(f"{dep.name} {what} (grace {grace_s:g} s)")
    return not reasons, reasons


def ready(dependencies: list[Dependency]) -> tuple[bool, list[str]]:
    reasons = [
        f"{dep.name} not tried until {dep.waits_for} answers"
        if _waiting(dep, dependencies)
        else f"{dep.name} not answering"
        for dep in dependencies
        if not dep.ok_now
    ]
    return not reasons, reasons


# ---------------------------------------------------------------- the monitor (I/O)


Gauge = Callable[[Any], Awaitable[None]]


@dataclass
class HealthMonitor:
    service: str
    connection: Callable[[], Any]  # the service's NATS client (None until connected)
    grace_s: float = DEFAULT_GRACE_S
    clickhouse_url: str | None = None
    durables: list[tuple[str, str]] = field(default_factory=list)  # (stream, durable)
    # More gauges this service keeps up to date, each given the NATS client.
    gauges: list[Gauge] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.nats = Dependency("nats")
        self.dependencies = [self.nats]
        self.clickhouse: Dependency | None = None
        if self.clickhouse_url:
            # The audit sink writes its genesis seal before it connects to NATS.
            self.clickhouse = Dependency("clickhouse")
            self.nats.waits_for = "clickhouse"
            self.dependencies.insert(0, self.clickhouse)
        self._tasks: list[asyncio.Task[None]] = []
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> int:
        self._tasks.append(asyncio.create_task(self._watch_nats()))
        if self.clickhouse is not None:
            self._tasks.append(asyncio.create_task(self._watch_clickhouse()))
        if telemetry.metrics() is not None:
            self._tasks.append(asyncio.create_task(self._watch_consumers()))
        self._server = await asyncio.start_server(self._answer, host, port)
        bound = int(self._server.sockets[0].getsockname()[1])
        log.info("health and metrics on http://%s:%s (/healthz /readyz /metrics)", host, bound)
        return bound

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def verdicts(self) -> dict[str, Any]:
        live, why = alive(time.monotonic(), self.started_at, self.dependencies, self.grace_s)
        is_ready, not_ready = ready(self.dependencies)
        return {"service": self.service, "alive": live, "ready": is_ready, "why": why + not_ready}

    def _mark(self, dep: Dependency, ok: bool) -> None:
        dep.ok_now = ok
        if ok:
            dep.last_ok = time.monotonic()
        metrics = telemetry.metrics()
        if metrics is not None:
            metrics.up.labels(dep.name).set(1 if ok else 0)

    async def _watch_nats(self) -> None:
        while True:
            nc = self.connection()
            self._mark(self.nats, bool(nc is not None and nc.is_connected))
            await asyncio.sleep(NATS_CHECK_S)

    async def _watch_clickhouse(self) -> None:
        assert self.clickhouse is not None and self.clickhouse_url
        ping = clickhouse_ping_url(self.clickhouse_url)
        while True:
            ok = await asyncio.to_thread(_http_ok, ping)
            self._mark(self.clickhouse, ok)
            await asyncio.sleep(CLICKHOUSE_CHECK_S)

    async def _watch_consumers(self) -> None:
        metrics = telemetry.metrics()
        assert metrics is not None
        while True:
            nc = self.connection()
            if nc is not None and nc.is_connected:
                lag = 0
                for stream, durable in self.durables:
                    try:
                        info = await nc.jsm().consumer_info(stream, durable, timeout=2)
                    except Exception:  # not created yet, or NATS busy: next round
                        continue
                    metrics.pending.labels(stream, durable).set(info.num_pending or 0)
                    metrics.ack_pending.labels(stream, durable).set(info.num_ack_pending or 0)
                    metrics.redelivered.labels(stream, durable).set(info.num_redelivered or 0)
                    lag += (info.num_pending or 0) + (info.num_ack_pending or 0)
                if self.service == "audit":
                    metrics.audit_lag.set(lag)
                for gauge in self.gauges:
                    with contextlib.suppress(Exception):
                        await gauge(nc)
            await asyncio.sleep(CONSUMERS_CHECK_S)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readline(), 5)
            while (await asyncio.wait_for(reader.readline(), 5)) not in (b"\r\n", b"\n", b""):
                pass  # headers: nothing here needs them
            parts = request.decode("latin-1").split()
            path = parts[1].split("?")[0] if len(parts) >= 2 else ""
            status, body, kind = self._route(path)
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _route(self, path: str) -> tuple[str, bytes, str]:
        if path == "/metrics":
            return "200 OK", telemetry.scrape(), "text/plain; version=0.0.4; charset=utf-8"
        if path in ("/healthz", "/readyz"):
            verdicts = self.verdicts()
            ok = verdicts["alive"] if path == "/healthz" else verdicts["ready"]
            status = "200 OK" if ok else "503 Service Unavailable"
            return status, json.dumps(verdicts).encode(), "application/json"
        return "404 Not Found", b"not found\n", "text/plain"


def clickhouse_ping_url(clickhouse_url: str) -> str:
    """ClickHouse's own liveness URL (`/ping`, no login) of an `http://host:port/db` URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(clickhouse_url)
    host = parts.hostname or "127.0.0.1"
    return f"{parts.scheme or 'http'}://{host}:{parts.port or 8123}/ping"


def _http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (OSError, ValueError):
        return False


def probe(url: str, timeout: float = 2.0) -> dict[str, Any] | None:
    """GET a service's /healthz: its verdicts (None: nothing answered)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            found = json.loads(answer.read())
    except urllib.error.HTTPError as refused:  # 503: it answered, and says why
        try:
            found = json.loads(refused.read())
        except ValueError:
            return None
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) else None


async def serving(
    monitor: HealthMonitor, run: Coroutine[Any, Any, None], port: int, host: str = "0.0.0.0"
) -> None:
    """Run the service (`run`, its app) with its health and metrics endpoint beside it."""
    await monitor.start(host, port)
    try:
        await run
    finally:
        await monitor.stop()
        telemetry.reset()  # flush batched spans
