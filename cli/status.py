"""`toolgate status`: the gateway at a glance, and each service's health/metrics wiring.

What it prints is what the services' `/metrics` say, read from the same
places: each durable consumer's pending and ack-pending count (per stage, and
per tool for the executors), approvals waiting for a human, dead letters,
the audit's lag (messages stored in NATS and not yet in ClickHouse),
whether each service `toolgate up` started answers its `/healthz`, and the
policy bundle the policy service decides under (version, where it came from,
who signed it; services/policy/versions.py).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from toolgate.contracts import subjects
from toolgate.runtime import settings as env
from toolgate.runtime.health import HealthMonitor, probe
from toolgate.runtime.topology import handlers, rows_of

CONNECT_TIMEOUT_S = 5.0


async def pending_approvals(js: Any) -> int:
    """Approvals whose call waits for a human (state `pending` in the approvals bucket)."""
    from toolgate.services.approvals.store import ApprovalStore

    store = await ApprovalStore.open(js)
    return sum(1 for state, _ in await store.snapshot() if state.status == "pending")


async def dead_letters(js: Any) -> int:
    info = await js.stream_info(
        subjects.EVENTS_STREAM, subjects_filter=f"{subjects.EVENTS_PREFIX}.MessageDeadLettered.>"
    )
    return sum((info.state.subjects or {}).values())


def monitor_for(
    service: str,
    connection: Any,
    tools: list[str],
    grace_s: float,
    clickhouse_url: str | None = None,
) -> HealthMonitor:
    """The health monitor of one service: its dependencies, its durables, its gauges."""
    from toolgate.runtime import telemetry

    durables = [(h.stream, h.durable) for h in rows_of(service, tools)]
    durables = list(dict.fromkeys(durables))
    gauges: list[Callable[[Any], Awaitable[None]]] = []
    if service == "approvals":

        async def approvals_pending(nc: Any) -> None:
            metrics = telemetry.metrics()
            if metrics is not None:
                metrics.approvals_pending.set(await pending_approvals(nc.jetstream()))

        gauges.append(approvals_pending)
    return HealthMonitor(
        service=service,
        connection=connection,
        grace_s=grace_s,
        clickhouse_url=clickhouse_url if service == "audit" else None,
        durables=durables,
        gauges=gauges,
    )


# ---------------------------------------------------------------- the status (pure rendering)


@dataclass
class ConsumerLag:
    service: str
    stream: str
    durable: str
    pending: int | None  # None: the durable does not exist (its service never started)
    ack_pending: int | None


@dataclass
class Status:
    nats_url: str
    services: dict[str, str] = field(default_factory=dict)  # name -> one-word state + detail
    consumers: list[ConsumerLag] = field(default_factory=list)
    approvals_waiting: int | None = None
    dead_letters: int | None = None
    policy: str = ""  # versions.active_line

    @property
    def audit_lag(self) -> int | None:
        audit = [c for c in self.consumers if c.service == "audit" and c.pending is not None]
        if not audit:
            return None
        return sum((c.pending or 0) + (c.ack_pending or 0) for c in audit)


def render(status: Status) -> str:
    def number(value: int | None) -> str:
        return "-" if value is None else str(value)

    lines = [f"toolgate at {status.nats_url}"]
    if status.policy:
        lines.append(f"policy bundle: {status.policy}")
    lines += ["", "services"]
    if not status.services:
        lines.append(
            "  (none recorded: no `toolgate up` in this folder, or it ran with --no-metrics)"
        )
    for name, state in status.services.items():
        lines.append(f"  {name:<12} {state}")
    lines += ["", "lag per stage and tool (pending = not yet delivered; ack pending = in hand)"]
    lines.append(f"  {'durable':<30} {'stream':<16} {'pending':>8} {'ack pending':>12}")
    for c in status.consumers:
        missing = "  (no such durable yet)" if c.pending is None else ""
        lines.append(
            f"  {c.durable:<30} {c.stream:<16} {number(c.pending):>8} "
            f"{number(c.ack_pending):>12}{missing}"
        )
    lines += [
        "",
        f"approvals waiting: {number(status.approvals_waiting)}",
        f"dead letters:      {number(status.dead_letters)}",
        f"audit lag:         {number(status.audit_lag)} messages not yet in ClickHouse",
    ]
    return "\n".join(lines)


async def policy_line(js: Any, data_dir: Path, context: dict[str, Any]) -> str:
    """The bundle policy replicas decide under, as `toolgate up` prints it."""
    from toolgate.services.policy import versions
    from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, bundle_version, read_bundle_dir
    from toolgate.services.policy.pushing import read_state
    from toolgate.services.policy.signing import BundleRefused, load_verify_key

    state = await read_state(js)
    try:
        public_key = load_verify_key(Path(data_dir) / "keys")
    except BundleRefused:
        public_key = None
    local_dir = context.get("policy_dir")
    try:
        local_version = bundle_version(
            read_bundle_dir(Path(local_dir) if isinstance(local_dir, str) else DEFAULT_BUNDLE_DIR)
        )
    except Exception:  # the folder went away since `toolgate up`
        local_version = "?"
    source = context.get("policy_source") or "built-in default"
    return versions.active_line(
        state.written, state.accepted, public_key, local_version, str(source)
    )


async def gather(
    nc: Any,
    tools: list[str],
    http: dict[str, str],
    data_dir: Path | None = None,
    context: dict[str, Any] | None = None,
) -> Status:
    from nats.js.errors import NotFoundError

    status = Status(nats_url="")
    if data_dir is not None:
        try:
            status.policy = await policy_line(nc.jetstream(), data_dir, context or {})
        except Exception as exc:  # status shows what it can
            status.policy = f"unknown: {type(exc).__name__}: {' '.join(str(exc).split())}"
    jsm = nc.jsm()
    seen = set()
    for h in handlers(tools, with_audit=True):
        if (h.stream, h.durable) in seen:
            continue
        seen.add((h.stream, h.durable))
        try:
            info = await jsm.consumer_info(h.stream, h.durable)
            lag = ConsumerLag(
                h.service, h.stream, h.durable, info.num_pending or 0, info.num_ack_pending or 0
            )
        except NotFoundError:
            lag = ConsumerLag(h.service, h.stream, h.durable, None, None)
        status.consumers.append(lag)
    js = nc.jetstream()
    try:
        status.approvals_waiting = await pending_approvals(js)
    except Exception:  # no bucket yet
        status.approvals_waiting = None
    try:
        status.dead_letters = await dead_letters(js)
    except Exception:
        status.dead_letters = None
    for name, url in http.items():
        verdict = await asyncio.to_thread(probe, f"{url}/healthz")
        if verdict is None:
            status.services[name] = f"down: no answer at {url}/healthz"
        elif verdict.get("alive"):
            status.services[name] = f"up     {url}/metrics"
        else:
            status.services[name] = "failing: " + "; ".join(verdict.get("why") or [])
    return status


def cmd_status(args: argparse.Namespace) -> int:
    from toolgate.cli.common import check_creds, check_nats_url, connect_nats

    check_nats_url(args.nats_url)
    check_creds(args.creds)
    context = env.read_context(args.data_dir)
    tools = env.GatewaySettings(
        registry_dirs=tuple(Path(d) for d in context.get("registry_dirs") or []),
        builtin_tools=context.get("builtin_tools") is not False,
    ).load_registry()

    async def run() -> Status:
        nc = await connect_nats(args.nats_url, args.creds, args.connect_timeout)
        try:
            status = await gather(
                nc, tools.names(), dict(context.get("http") or {}), args.data_dir, context
            )
        finally:
            await nc.close()
        status.nats_url = args.nats_url
        return status

    print(render(asyncio.run(run())))
    return 0


def register(commands: Any) -> None:
    status = commands.add_parser(
        "status", help="the gateway at a glance: services, lag per stage and tool, approvals"
    )
    status.add_argument(
        "--nats-url",
        default=env.env_nats_url(),
        help="NATS URL (default: $TOOLGATE_NATS_URL, else the one `toolgate up` recorded; "
        "now %(default)s)",
    )
    status.add_argument(
        "--creds",
        type=Path,
        default=env.env_nats_creds("admin"),
        help="the operator's (admin) creds (default: the ones `toolgate up` recorded; "
        "now %(default)s)",
    )
    status.add_argument(
        "--data-dir",
        type=Path,
        default=env.env_data_dir(),
        help="where `toolgate up` keeps its state (default %(default)s)",
    )
    status.add_argument(
        "--connect-timeout",
        type=float,
        default=CONNECT_TIMEOUT_S,
        help="seconds to wait for NATS (default %(default)s)",
    )
    status.set_defaults(func=cmd_status)
