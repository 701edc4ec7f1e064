"""`toolgate up`: the whole gateway on its embedded default (nats-server, ClickHouse and
every service, supervised: stack/supervisor.py), after checking what it was given."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from toolgate.cli.common import CONNECT_TIMEOUT_S, Failed, check_nats_url, check_port
from toolgate.cli.serve import add_oidc, add_runtime, oidc_args
from toolgate.runtime import settings as env
from toolgate.runtime.topology import DEFAULT_MAX_CALLS_PER_AGENT

# `toolgate up --example NAME` (toolgate.stack.supervisor.EXAMPLES).
EXAMPLES = ("orders", "refund")


def cmd_up(args: argparse.Namespace) -> int:
    from toolgate.runtime.topology import Topology
    from toolgate.stack.clickhouse_server import ClickHouseServerError
    from toolgate.stack.nats_server import NatsServerError
    from toolgate.stack.supervisor import Stack, StackError, run_until_signalled

    if args.nats_url_given:
        check_nats_url(args.nats_url_given)
    check_up_servers(args)
    for directory in args.registry or []:
        if not directory.is_dir():
            raise Failed(f"toolgate up: no registry directory at {directory} (--registry)", 2)
    if args.oidc_issuer and not args.oidc_issuer.startswith(("https://", "http://")):
        raise Failed(f"toolgate up: {args.oidc_issuer!r} is not an http(s) URL (--oidc-issuer)", 2)
    if not 0 <= args.oidc_clock_skew <= 300:
        raise Failed("toolgate up: --oidc-clock-skew must be 0 to 300 seconds", 2)
    executor_args = ["--concurrency", str(args.concurrency)]
    stack = Stack(
        data_dir=args.data_dir,
        nats_url=args.nats_url_given,
        nats_port=args.nats_port,
        nats_cluster=args.nats_cluster,
        with_http=not args.no_metrics,
        registry_dirs=list(args.registry or env.env_registry_dirs()),
        builtin_tools=not args.no_builtin_tools,
        executor_args=executor_args,
        clickhouse_url=args.clickhouse_url_given,
        clickhouse_port=args.clickhouse_port,
        with_audit=not args.no_audit,
        topology=Topology(max_calls_per_agent=args.max_calls_per_agent),
        example=args.example,
        mcp_port=args.mcp_port,
        oidc_args=oidc_args(args),
        approval_webhooks=list(args.approval_webhook),
        approval_webhook_secret_file=args.approval_webhook_secret_file,
        approval_webhooks_file=args.approval_webhooks,
        inbox_url=args.inbox_url,
        notifier_args=["--reminder-at", str(args.approval_reminder_at)],
    )
    try:
        return run_until_signalled(stack)
    except StackError as exc:
        raise Failed(f"toolgate up: {exc}", exc.exit_code) from None
    except (NatsServerError, ClickHouseServerError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise Failed(f"toolgate up: {first} (logs in {args.data_dir})", 3) from None


def check_up_servers(args: argparse.Namespace) -> None:
    """Before `toolgate up` starts anything: no gateway runs on this data dir already, its
    ports are ports, and a ClickHouse it was given answers (else Failed, one line)."""
    from toolgate.stack.gateway_lock import running_gateway

    running = running_gateway(args.data_dir)
    if running is not None:
        raise Failed(
            f"toolgate up: a gateway already runs in {args.data_dir} (pid {running}): stop "
            "it first, or give another --data-dir",
            2,
        )
    check_port(args.nats_port, "toolgate up: --nats-port")
    if args.nats_port and args.nats_port + max(args.nats_cluster, 1) - 1 > 65535:
        raise Failed(
            f"toolgate up: --nats-cluster {args.nats_cluster} takes ports {args.nats_port} "
            f"and up, past 65535: choose a lower --nats-port (0: any free port)",
            2,
        )
    check_port(args.clickhouse_port, "toolgate up: --clickhouse-port")
    check_port(args.mcp_port, "toolgate up: --mcp-port")
    if not 0 <= args.approval_reminder_at < 1:
        raise Failed("toolgate up: --approval-reminder-at is a share: 0 (none) up to 1", 2)
    if args.inbox_url is not None and not args.inbox_url.startswith(("http://", "https://")):
        raise Failed(f"toolgate up: --inbox-url {args.inbox_url!r} is not an http(s) URL", 2)
    if args.clickhouse_url_given and not args.no_audit:
        check_clickhouse_answers(args.clickhouse_url_given)


def check_clickhouse_answers(url: str) -> None:
    """A ClickHouse given to `toolgate up` answers and takes its login; else Failed."""
    from toolgate.services.audit.connection import Store, StoreError

    store = Store(
        url,
        "--clickhouse-url",
        "check the URL, or leave --clickhouse-url out to start the embedded ClickHouse",
    )
    try:
        target = store.target()
        store.probe(target, CONNECT_TIMEOUT_S)
        try:
            target.client(with_database=False).command("SELECT 1")
        except Exception as exc:
            raise store.explain(exc, target) from None
    except StoreError as exc:
        raise Failed(f"toolgate up: {exc}", exc.exit_code) from None


def register(commands: Any) -> None:
    up = commands.add_parser("up", help="start the gateway on its embedded default")
    # Not what an earlier `toolgate up` recorded: that is the server it started itself.
    up.add_argument(
        "--nats-url",
        dest="nats_url_given",
        default=os.environ.get("TOOLGATE_NATS_URL") or None,
        help="use this NATS instead of starting one (default: $TOOLGATE_NATS_URL, "
        "else start the embedded nats-server; now %(default)s)",
    )
    up.add_argument(
        "--nats-port",
        type=int,
        default=4222,
        help="port of the embedded NATS (default %(default)s; 0: any free port)",
    )
    up.add_argument(
        "--no-metrics",
        action="store_true",
        help="services serve no /healthz and /metrics; the supervisor then only "
        "restarts services that exit (default: each service on a port of its own)",
    )
    up.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="start N routed nats-servers (ports --nats-port, +1, ...) instead of one, "
        "every stream and bucket with min(N, 3) replicas (default %(default)s)",
    )
    up.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="executor calls in flight per tool (default %(default)s)",
    )
    up.add_argument(
        "--clickhouse-url",
        dest="clickhouse_url_given",
        default=None,
        help="audit into this ClickHouse (http://host:port/database) instead of "
        "starting the embedded one (default %(default)s: the embedded one)",
    )
    up.add_argument(
        "--clickhouse-port",
        type=int,
        default=0,
        help="port of the embedded ClickHouse (default %(default)s: any free port)",
    )
    up.add_argument(
        "--no-audit",
        action="store_true",
        help="run without ClickHouse and the audit sink (default: with them)",
    )
    up.add_argument(
        "--max-calls-per-agent",
        type=int,
        default=DEFAULT_MAX_CALLS_PER_AGENT,
        help="storage quota: calls each agent may have stored within the 7-day "
        "retention; over it a call is refused before storage "
        "(default %(default)s)",
    )
    up.add_argument(
        "--mcp-port",
        type=int,
        default=0,
        help="port of the MCP front door on loopback (default %(default)s: any free port; "
        "`toolgate up` prints its URL)",
    )
    up.add_argument(
        "--example",
        choices=EXAMPLES,
        default=None,
        help="also run a worked example beside the built-in tools: its tools, "
        "data, policy bundle and agent (refund: README 'Worked example 2'; "
        "orders: 'Worked example 3'; default %(default)s)",
    )
    up.add_argument(
        "--approval-webhook",
        action="append",
        default=[],
        metavar="URL",
        help="POST a signed JSON notification here when a call starts waiting for a "
        "human, is decided or expires, and a reminder (every tenant's calls; "
        "repeatable; per tenant: --approval-webhooks)",
    )
    up.add_argument(
        "--approval-webhook-secret-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the secret the notifications are signed with (HMAC-SHA256; default: "
        "DATA_DIR/approval-webhook.secret, made on first use)",
    )
    up.add_argument(
        "--approval-webhooks",
        type=Path,
        default=None,
        metavar="FILE",
        help="webhooks per tenant, a YAML file (README: Approval notifications; "
        "default: DATA_DIR/approval-webhooks.yaml when it exists)",
    )
    up.add_argument(
        "--inbox-url",
        default=None,
        help="the inbox's base URL that notifications link to, as its approvers reach it "
        "(default: http://127.0.0.1:8090, `toolgate approvals inbox`'s own)",
    )
    up.add_argument(
        "--approval-reminder-at",
        type=float,
        default=0.5,
        metavar="SHARE",
        help="remind webhooks of a call still waiting at this share of its time to "
        "live (0: no reminder; default %(default)s)",
    )
    add_runtime(up, recorded=False)
    add_oidc(up, recorded=False)
    up.set_defaults(func=cmd_up)
