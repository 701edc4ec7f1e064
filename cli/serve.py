"""`toolgate serve NAME`: one service of the gateway (validator, policy, executor,
attacher, approvals, notifier, audit, mcp), on NATS for as long as it runs; and the flags
every service is started with (`toolgate up` starts each one with them: see cli/up.py)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

from toolgate.cli.audit import add_clickhouse_url
from toolgate.cli.common import (
    CONNECT_TIMEOUT_S,
    Failed,
    check_creds,
    check_nats_url,
    connect_failure,
    connect_nats,
    quiet_nats_tracebacks,
)
from toolgate.cli.mcp import add_serve_flags
from toolgate.runtime import settings as env
from toolgate.runtime.call_context import SERVICE_LOG_FORMAT, log_calls
from toolgate.runtime.outside_text import log_visibly
from toolgate.stack.services import SERVICES

SERVICE_NAMES = tuple(SERVICES)  # one registry of services (stack/services.py)


def add_runtime(parser: argparse.ArgumentParser, recorded: bool = True) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=env.env_data_dir(),
        help="state directory: keys, tool data, embedded servers "
        "(default: $TOOLGATE_DATA_DIR, else %(default)s)",
    )
    # $TOOLGATE_REGISTRY, else (serve) the directories `toolgate up` started its services with.
    registry, builtin = env.recorded_registry() if recorded else (env.env_registry_dirs(), True)
    parser.add_argument(
        "--registry",
        type=Path,
        action="append",
        default=None,
        help="directory of tool YAML files, beside the built-in tools; repeatable (default: "
        "$TOOLGATE_REGISTRY"
        + (", else what `toolgate up` recorded" if recorded else "")
        + ", else none; now "
        + (":".join(map(str, registry)) or "none")
        + ("" if builtin else ", without the built-in tools")
        + "). A tool name may not repeat: a directory cannot redefine a built-in tool",
    )
    parser.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="serve only the tools of the --registry directories, not the built-in "
        "search_sources, fetch_document, save_evidence and echo",
    )
    parser.set_defaults(registry_default=registry, builtin_default=builtin)


def add_oidc(parser: argparse.ArgumentParser, recorded: bool = True) -> None:
    """End users verified by OIDC (README "End users verified (OIDC)"): `up` and `serve`."""
    known = (env.read_context().get("oidc") or {}) if recorded else {}
    given = {
        "issuer": os.environ.get("TOOLGATE_OIDC_ISSUER") or known.get("issuer"),
        "audience": os.environ.get("TOOLGATE_OIDC_AUDIENCE") or known.get("audience"),
        "tenant_claim": known.get("tenant_claim") or "tenant",
        "agent_claim": known.get("agent_claim") or "agent",
        "clock_skew": known.get("clock_skew") or "60",
    }
    parser.add_argument(
        "--oidc-issuer",
        default=given["issuer"],
        metavar="URL",
        help="verify end users: a call to a tool that acts for a user must carry the "
        "user's access token from this OpenID provider (NATS header `Authorization: "
        "Bearer <JWT>`); the MCP front door accepts its access tokens too (default: "
        "$TOOLGATE_OIDC_ISSUER"
        + (", else what `toolgate up` recorded" if recorded else "")
        + "; now %(default)s)",
    )
    parser.add_argument(
        "--oidc-audience",
        default=given["audience"],
        metavar="AUD",
        help="the audience a user's token must name (default: $TOOLGATE_OIDC_AUDIENCE; "
        "now %(default)s: not checked)",
    )
    parser.add_argument(
        "--oidc-tenant-claim",
        default=given["tenant_claim"],
        metavar="NAME",
        help="the token claim naming the user's tenant; it must be the agent's tenant "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--oidc-agent-claim",
        default=given["agent_claim"],
        metavar="NAME",
        help="MCP front door: the access-token claim naming the agent (default %(default)s)",
    )
    parser.add_argument(
        "--oidc-clock-skew",
        type=float,
        default=float(given["clock_skew"] or 60),
        metavar="S",
        help="seconds of clock skew allowed on a token's expiry, 0 to 300 (default %(default)s)",
    )


def oidc_args(args: argparse.Namespace) -> list[str]:
    """The --oidc-* flags a service is started with (none without an issuer)."""
    if not args.oidc_issuer:
        return []
    found = ["--oidc-issuer", args.oidc_issuer]
    if args.oidc_audience:
        found += ["--oidc-audience", args.oidc_audience]
    return found + [
        "--oidc-tenant-claim",
        args.oidc_tenant_claim,
        "--oidc-agent-claim",
        args.oidc_agent_claim,
        "--oidc-clock-skew",
        f"{args.oidc_clock_skew:g}",
    ]


def _settings(args: argparse.Namespace) -> env.GatewaySettings:
    return env.GatewaySettings(
        nats_url=args.nats_url,
        nats_creds=args.creds,
        data_dir=args.data_dir,
        registry_dirs=tuple(args.registry or args.registry_default),
        builtin_tools=_builtin_tools(args),
        oidc_issuer=getattr(args, "oidc_issuer", None) or None,
        oidc_audience=getattr(args, "oidc_audience", None) or None,
        oidc_tenant_claim=getattr(args, "oidc_tenant_claim", None) or "tenant",
        oidc_agent_claim=getattr(args, "oidc_agent_claim", None) or "agent",
        oidc_clock_skew_s=getattr(args, "oidc_clock_skew", 60.0),
    )


def _builtin_tools(args: argparse.Namespace) -> bool:
    """Whether the built-in tools are served: not with --no-builtin-tools, nor when the
    registry comes from a `toolgate up` that ran without them (and no --registry is given)."""
    return not args.no_builtin_tools and (args.registry is not None or args.builtin_default)


def _wait_for_nats(url: str, creds: Path | None) -> None:
    """A service waits for its NATS for as long as it takes, saying so in one line (every
    30 s at most), then (on an open bus) creates the streams and buckets."""
    from toolgate.runtime.topology import apply_topology

    log = logging.getLogger("toolgate")
    said: dict[str, float] = {}
    while True:
        try:
            asyncio.run(_once(url, creds, None if creds else apply_topology))
            return
        except Failed as exc:
            line = f"{exc}; trying again"
            if time.monotonic() - said.get(line, -1e9) >= 30:
                said[line] = time.monotonic()
                log.warning("%s", line)
            time.sleep(2)


async def _once(url: str, creds: Path | None, apply: Any) -> None:
    nc = await connect_nats(url, creds, CONNECT_TIMEOUT_S)
    await nc.close()
    if apply is not None:  # on a locked bus the operator (admin) applied it
        try:
            await asyncio.wait_for(
                apply(
                    url, allow_reconnect=False, error_cb=_ignore, connect_timeout=CONNECT_TIMEOUT_S
                ),
                30,
            )
        except Exception as exc:
            raise connect_failure(url, exc) from None


async def _ignore(exc: Exception) -> None:
    pass


def cmd_serve(args: argparse.Namespace) -> int:
    if args.creds is None:  # this service's own role, as `toolgate up` recorded it
        # (the front door's role is mcp_front: an account of its own, see infra/nats)
        args.creds = env.env_nats_creds(SERVICES[args.name].role)
    check_nats_url(args.nats_url)
    check_creds(args.creds)
    if args.name == "policy" and args.policy is None:
        recorded = env.read_context().get("policy_dir")
        args.policy = Path(recorded) if isinstance(recorded, str) else None
    settings = _settings(args)
    settings.load_registry()  # a bad registry ends it now, not after NATS is found
    args.notifier_webhooks = _notifier_webhooks(args) if args.name == "notifier" else []
    logging.basicConfig(level=logging.INFO, format=SERVICE_LOG_FORMAT.format(service=args.name))
    log_visibly()  # log lines quote calls, users and upstream errors: shown escaped
    log_calls()  # a line logged while a call's message is handled names the call
    quiet_nats_tracebacks(settings.nats_url)
    _wait_for_nats(settings.nats_url, settings.nats_creds)
    from toolgate.runtime import telemetry

    # Metrics when there is an endpoint to serve them; traces when an OTLP endpoint is set.
    telemetry.configure(args.name, metrics=args.http_port is not None)
    build = SERVICES[args.name].build
    if build is None:  # the MCP front door: not a stage app
        from toolgate.cli.mcp import serve_mcp

        return serve_mcp(args, settings)
    app = build(settings, args)
    from toolgate.runtime import process  # faststream: only a service loads it

    process.tune_gc_for_a_service()
    run = app.run()
    if args.http_port is not None:  # health and metrics beside the service
        from toolgate.cli.status import monitor_for
        from toolgate.runtime.health import serving

        broker = app.broker
        monitor = monitor_for(
            args.name,
            lambda: getattr(broker, "_connection", None),  # the service's own NATS client
            [t for t in (args.tools or "").split(",") if t] or settings.load_registry().names(),
            args.health_grace,
            clickhouse_url=getattr(args, "clickhouse_url", None),
        )
        run = serving(monitor, run, args.http_port, args.http_host)
    process.run_service(run)
    return 0


def _notifier_webhooks(args: argparse.Namespace) -> list[Any]:
    """The notifier's webhooks, their secrets read once, now (else Failed, exit 2)."""
    from toolgate.services.notifier.webhooks import WebhookConfigError, load_webhooks

    try:
        return load_webhooks(args.webhooks)
    except WebhookConfigError as exc:
        raise Failed(f"toolgate serve notifier: {exc} (--webhooks)", 2) from None


def add_notifier_flags(serve: argparse.ArgumentParser) -> None:
    """`toolgate serve notifier`'s own flags (services/notifier)."""
    from toolgate.services.notifier import logic
    from toolgate.services.notifier.sender import DEFAULT_TIMEOUT_S

    serve.add_argument(
        "--webhooks",
        type=Path,
        default=None,
        help="notifier: the webhooks file (`toolgate up` writes DATA_DIR/notifier/"
        "webhooks.yaml; default %(default)s: no webhooks)",
    )
    serve.add_argument(
        "--inbox-url",
        default=logic.DEFAULT_INBOX_URL,
        help="notifier: the inbox's base URL; a notification links to "
        "URL/calls/TENANT.AGENT.CALL_ID (default %(default)s)",
    )
    serve.add_argument(
        "--reminder-at",
        type=float,
        default=logic.DEFAULT_REMINDER_SHARE,
        metavar="SHARE",
        help="notifier: remind at this share of a request's time to live, if it still "
        "waits (0: no reminder; default %(default)s)",
    )
    serve.add_argument(
        "--retry-base",
        type=float,
        default=logic.DEFAULT_RETRY_BASE_S,
        help="notifier: seconds before the first retry of a failed delivery (default %(default)s)",
    )
    serve.add_argument(
        "--give-up-after",
        type=float,
        default=logic.DEFAULT_GIVE_UP_AFTER_S,
        help="notifier: seconds after which an undelivered notification is given up "
        "(a dead letter; default %(default)s)",
    )
    serve.add_argument(
        "--webhook-timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        help="notifier: seconds one delivery attempt may take (default %(default)s)",
    )


def register(commands: Any) -> None:
    serve = commands.add_parser("serve", help="run one service")
    serve.add_argument("name", choices=SERVICE_NAMES, help="the service to run")
    serve.add_argument(
        "--tools",
        default="",
        help="executor: comma-separated tools (default: every tool of the registry)",
    )
    serve.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="executor: calls in flight per tool (default %(default)s)",
    )
    serve.add_argument(
        "--sweep-interval",
        type=float,
        default=5.0,
        help="approvals: seconds between expiry sweeps (default %(default)s)",
    )
    add_notifier_flags(serve)
    serve.add_argument(
        "--policy",
        type=Path,
        default=None,
        help="policy: bundle directory to start with; a pushed bundle wins "
        "(default: the one `toolgate up` started with, else the built-in "
        "one)",
    )
    serve.add_argument(
        "--nats-url",
        default=env.env_nats_url(),
        help="NATS server URL (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded in DATA_DIR; now %(default)s)",
    )
    serve.add_argument(
        "--creds",
        type=Path,
        default=None,
        help="NATS creds file (default: $TOOLGATE_NATS_CREDS, else the creds "
        "`toolgate up` recorded for service NAME, else none: an open bus)",
    )
    serve.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve /healthz, /readyz and Prometheus /metrics on this port (0: any free "
        "port; default %(default)s: none)",
    )
    serve.add_argument(
        "--http-host",
        default="127.0.0.1",
        help="address of that endpoint (default %(default)s; 0.0.0.0 in a container)",
    )
    serve.add_argument(
        "--health-grace",
        type=float,
        default=30.0,
        help="/healthz fails once NATS (or, for the audit, ClickHouse) has not answered "
        "for this many seconds (default %(default)s)",
    )
    add_runtime(serve)
    add_oidc(serve)
    serve.set_defaults(func=cmd_serve)
    add_clickhouse_url(serve)  # audit: where to write
    add_serve_flags(serve)  # mcp: the front door's own
