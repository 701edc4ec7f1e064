"""Real servers and whole gateways for tests: nothing here is a mock.

Each test gets its own data directory and its own nats-server on a free
loopback port, so stream names never collide between tests.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import yaml
from nats.js.errors import NotFoundError

from toolgate.client.gateway_client import GatewayClient
from toolgate.contracts import subjects
from toolgate.contracts.events import (
    CallAuthorized,
    Event,
    decode_event,
    encode_event,
)
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR
from toolgate.runtime import emits
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.runtime.topology import handlers
from toolgate.stack.nats_auth import add_agent, push_account_jwts
from toolgate.stack.processes import free_port
from toolgate.stack.services import NOTIFIER, PIPELINE
from toolgate.stack.supervisor import ServiceProcess, Stack

REPO_ROOT = Path(__file__).resolve().parent.parent
# A stage that publishes what its row of the handler table does not list fails its
# work in every test (and the services the tests start: they inherit the environment).
os.environ.setdefault(emits.STRICT_ENV, "1")
TEST_TOOLS_DIR = REPO_ROOT / "tests" / "tools" / "registry"


def make_test_registry(target: Path, fetch_allowed_hosts: list[str] | None = None) -> Path:
    """The built-in tools plus the faulty test tools; fetch_document may reach loopback."""
    target.mkdir(parents=True, exist_ok=True)
    for source in [*BUILTIN_TOOLS_DIR.glob("*.yaml"), *TEST_TOOLS_DIR.glob("*.yaml")]:
        shutil.copy(source, target / source.name)
    fetch = target / "fetch_document.yaml"
    spec = yaml.safe_load(fetch.read_text())
    spec["settings"]["allowed_hosts"] = fetch_allowed_hosts or ["127.0.0.1"]
    spec["settings"]["allow_private_addresses"] = True
    fetch.write_text(yaml.safe_dump(spec))
    # The fault tests send hundreds of save_evidence calls from one user.
    evidence = target / "save_evidence.yaml"
    spec = yaml.safe_load(evidence.read_text())
    spec.pop("rate_limit", None)
    evidence.write_text(yaml.safe_dump(spec))
    return target


def durables(
    tool_names: list[str], with_audit: bool = False, with_notifier: bool = True
) -> list[tuple[str, str]]:
    """(stream, durable) of every consumer, from the handler table (runtime/topology.py);
    with_notifier=False: not the notifier's (a gateway that runs none)."""
    return [
        (h.stream, h.durable)
        for h in handlers(tool_names, with_audit)
        if with_notifier or h.service != NOTIFIER
    ]


@dataclass
class Gateway:
    """A whole gateway, every service its own process, as `toolgate up` runs it."""

    data_dir: Path
    # make_test_registry's copies of the built-in tools (edited) and the test tools:
    # served instead of the built-in ones (`toolgate up --no-builtin-tools`).
    registry_dir: Path
    # The audit (embedded ClickHouse + audit sink): off unless a test asks for it.
    with_audit: bool = False
    # The MCP front door (`toolgate serve mcp`): off unless a test asks for it; the
    # door's process costs a gateway about 2.6 CPU-s to start, and most tests never
    # knock on it.
    with_mcp: bool = False
    # The notifier (approval webhooks): off unless a test asks for it. It decides
    # nothing and, without webhooks, sends nothing; its process is about 1.2 CPU-s of
    # every test gateway, and only the notification tests hear from it.
    with_notifier: bool = False
    # Each service's /healthz and /metrics (`--http-port`): off unless a test reads them
    # (or runs `toolgate status`, which asks them). Serving them is about 0.15 CPU-s of
    # each service's start and, idle, a sixth of a gateway's CPU (each service checks
    # its NATS every second and its durables every five).
    with_http: bool = False
    # More Stack settings: the notifier's webhooks (approval_webhooks, ...), a policy_dir.
    options: dict[str, Any] = field(default_factory=dict)
    stack: Stack = field(init=False)

    def __post_init__(self) -> None:
        # Service processes import the test tools from tests/.
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        self.stack = Stack(
            data_dir=self.data_dir,
            registry_dirs=[self.registry_dir],
            builtin_tools=False,
            executor_args=["--concurrency", "16"],
            with_audit=self.with_audit,
            with_mcp=self.with_mcp,
            with_notifier=self.with_notifier,
            with_http=self.with_http,
            **self.options,
        )

    @property
    def url(self) -> str:
        return self.stack.url

    @property
    def admin(self) -> dict[str, Any]:
        """nats.connect options of the operator: tests inject and inspect as admin."""
        return connect_options(self.stack.creds_of("admin"))

    async def connect(self, role: str = "admin") -> nats.aio.client.Client:
        return await nats.connect(
            nats_servers(self.url), **connect_options(self.stack.creds_of(role))
        )

    async def events(self) -> list[Event]:
        return await read_events(self.url, **self.admin)

    def start(self, timeout: float = 60.0) -> Gateway:
        try:
            self.stack.start()
            asyncio.run(self.wait_ready(timeout))
        except BaseException:
            self.stop()  # a gateway that failed to start leaves no process behind
            raise
        return self

    def stop(self) -> None:
        self.stack.stop()

    def service(self, name: str) -> ServiceProcess:
        return next(s for s in self.stack.services if s.name == name)

    def tool_names(self) -> list[str]:
        return sorted(p.stem for p in self.registry_dir.glob("*.yaml"))

    def durables(self) -> list[tuple[str, str]]:
        """(stream, durable) of every consumer this gateway's services run."""
        return durables(self.tool_names(), self.with_audit, self.with_notifier)

    async def wait_ready(self, timeout: float = 60.0) -> None:
        """Ready when every service's durable consumer exists on the server."""
        deadline = time.monotonic() + timeout
        nc = await self.connect()
        try:
            jsm = nc.jsm()
            for stream, durable in self.durables():
                while True:
                    try:
                        await jsm.consumer_info(stream, durable)
                        break
                    # (a cluster may not answer while it forms the consumer's group)
                    except (NotFoundError, nats.errors.TimeoutError):
                        self._check_services_alive()
                        if time.monotonic() > deadline:
                            raise TimeoutError(f"consumer {durable} never appeared") from None
                        await asyncio.sleep(0.1)
        finally:
            await nc.close()

    async def settled(self, stream: str, durable: str) -> bool:
        """True once durable `durable` has been handed and has acked everything in `stream`
        it filters: whatever it does with a message stored before this call is done."""
        nc = await self.connect()
        try:
            info = await nc.jsm().consumer_info(stream, durable)
        finally:
            await nc.close()
        return info.num_pending == 0 and info.num_ack_pending == 0

    def _check_services_alive(self) -> None:
        for service in self.stack.services:
            if service.alive():
                continue
            said = service.log_path.read_text()[-3000:]
            if "address already in use" in said and service.restarts < 3:
                # Its health port was drawn by another listener in the moment between the
                # draw and the bind (gateways started side by side): a new one, as `up` does.
                service.restarts += 1
                service.move_http_port(free_port())
                service.start()
                continue
            raise RuntimeError(f"{service.name} died: {said}")

    async def agent_creds(self, tenant: str = "acme", agent: str = "researcher") -> Path:
        """The creds of one agent identity, minted (and told to the server) on first use."""
        creds, token = add_agent(self.data_dir, tenant, agent)
        await push_account_jwts(self.url, self.data_dir, [token])
        return creds

    async def client(self, tenant: str = "acme", agent: str = "researcher") -> GatewayClient:
        """A GatewayClient logged in as agent `agent` of tenant `tenant` (its own account)."""
        return await GatewayClient.connect(self.url, await self.agent_creds(tenant, agent))

    def audit_url(self, role: str = "auditor") -> str:
        """The audit database's URL, logging in as `role` (admin, writer, auditor)."""
        from toolgate.services.audit.connection import login_url

        return login_url(self.stack.audit_url, role, self.data_dir)

    def audit_client(self, role: str = "admin"):  # type: ignore[no-untyped-def]
        """A clickhouse-connect client on the gateway's audit database (the admin's: tests
        tamper with it)."""
        from toolgate.services.audit.connection import connect

        return connect(self.audit_url(role))

    def all_alive(self) -> bool:
        return all(s.alive() for s in self.stack.services if s.name in PIPELINE)


async def publish_event(url: str, event: Event, **options: Any) -> None:
    """Put one event on the events stream as its producer would (with a publish ack)."""
    nc = await nats.connect(nats_servers(url), **options)
    try:
        await nc.jetstream().publish(
            subjects.subject_of(event),
            encode_event(event),
            stream=subjects.EVENTS_STREAM,
            headers={"Nats-Msg-Id": event.event_id},
        )
    finally:
        await nc.close()


async def read_events(nats_url: str, **options: Any) -> list[Event]:
    """Every event in the events stream, in stream order (`options`: nats.connect's)."""
    nc = await nats.connect(nats_servers(nats_url), **options)
    try:
        jsm = nc.jsm()
        info = await jsm.stream_info(subjects.EVENTS_STREAM)
        events = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await jsm.get_msg(subjects.EVENTS_STREAM, seq)
            except NotFoundError:
                continue
            assert msg.data is not None
            events.append(decode_event(msg.data))
        return events
    finally:
        await nc.close()


def events_of(events: list[Event], call_id: str) -> list[Event]:
    return [e for e in events if e.call_id == call_id]


def count_types(events: list[Event]) -> Counter[str]:
    """Distinct events by type, deduplicated by event_id as the audit reads them."""
    unique = {e.event_id: e for e in events}
    return Counter(type(e).__name__ for e in unique.values())


__all__ = ["CallAuthorized", "Gateway", "make_test_registry", "read_events", "events_of"]


async def flushed(nc: nats.NATS) -> None:
    """Everything this connection sent (its SUBs too) has reached the server.

    One `flush()` is not enough in nats-py 2.16: it writes its PING straight
    to the socket, ahead of commands still queued for the flusher task, so the
    PONG can come back before a just-made subscription is registered (a
    publish from another connection then misses it, ~2% of tries). The second
    PING goes out after the first flush emptied the queue.
    """
    await nc.flush()
    await nc.flush()
