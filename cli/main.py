"""The `toolgate` command: parse, build a contract, call the library.

    toolgate up [--example NAME]       the whole gateway on the embedded default
    toolgate serve NAME                one service (validator|policy|executor|attacher|
                                       approvals|notifier|audit)
    toolgate agents add|list|revoke    one NATS identity per agent of each tenant
    toolgate call TOOL 'JSON-ARGS'     publish one call, print its ToolResult
    toolgate result CALL_ID            fetch a stored result again
    toolgate approvals list|show|approve|deny|add-approver|inbox   humans decide
    toolgate policy check|push|rollback|test   Cedar policy bundles
    toolgate audit trace|sql|replay|verify   the audit trail in ClickHouse
    toolgate schema                    JSON Schema of the wire contract
    toolgate bench [pipeline|policy|audit|audit-queries|fairness]   figures, printed

After `toolgate up` in a folder, every command there finds the gateway through
.toolgate/context.json; from elsewhere, --data-dir DIR (or $TOOLGATE_DATA_DIR)
names the folder whose context.json every command uses; flags and TOOLGATE_*
variables win over it.
Exit codes: 0 done (for `call`: result ok), 1 a clear failure (for `call`: the
result is an error), 2 bad input or configuration (a bad flag, port, call_id
or URL, a missing data dir, registry or creds file, a gateway already running
on the data dir), 3 could not reach, tell or wait for the gateway (no NATS or
ClickHouse there, creds refused, a running server not told: --offline writes
files alone, no result in time). A failure is one
line on stderr: what was tried and what to do. Services (`serve`, `up`) keep
reconnecting to NATS for as long as they run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec

from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.contracts.registry import RegistryError
from toolgate.runtime import process
from toolgate.runtime import settings as env
from toolgate.runtime.call_context import SERVICE_LOG_FORMAT, log_calls
from toolgate.runtime.creds import CredentialsError
from toolgate.runtime.outside_text import log_visibly, visible, visible_json
from toolgate.runtime.topology import DEFAULT_MAX_CALLS_PER_AGENT
from toolgate.stack.services import SERVICES

SERVICE_NAMES = tuple(SERVICES)  # one registry of services (stack/services.py)
# `toolgate up --example NAME` (toolgate.stack.supervisor.EXAMPLES).
EXAMPLES = ("orders", "refund")
NATS_SCHEMES = ("nats", "tls", "ws", "wss")


CONNECT_TIMEOUT_S = 5.0
NEVER_UP = "no toolgate up ran in this data dir yet"


class Failed(Exception):
    """A command cannot go on: `str()` is the one line to print, `code` the exit status."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def _add_nats(parser: argparse.ArgumentParser, role: str = "agent") -> None:
    parser.add_argument(
        "--nats-url",
        default=env.env_nats_url(),
        help="NATS server URL (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded in DATA_DIR; now %(default)s)",
    )
    parser.add_argument(
        "--creds",
        type=Path,
        default=env.env_nats_creds(role),
        help=f"NATS creds file (default: $TOOLGATE_NATS_CREDS, else the {role} "
        "creds `toolgate up` recorded; now %(default)s)",
    )


def _add_connect_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for NATS before giving up (default %(default)s)",
    )


def _add_runtime(parser: argparse.ArgumentParser, recorded: bool = True) -> None:
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


def _add_oidc(parser: argparse.ArgumentParser, recorded: bool = True) -> None:
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


def _oidc_args(args: argparse.Namespace) -> list[str]:
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


# ---------------------------------------------------------------- failing in one line


def check_nats_url(url: str, flag: str = "--nats-url") -> str:
    """`url` if it can name a NATS server (or, comma-separated, a cluster's nodes);
    else Failed (exit 2)."""
    for one in url.split(",") or [url]:
        parts = urlsplit(one if "://" in one else f"nats://{one}")
        try:
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError:
            parts = parts._replace(netloc="")
        if parts.scheme not in NATS_SCHEMES or not parts.hostname:
            raise Failed(f"{url!r} is not a NATS URL: expected nats://HOST:PORT ({flag})", 2)
    return url


def check_call_id(call_id: str, command: str, flag: str) -> str:
    """`call_id` if it can name a result subject; else Failed (exit 2)."""
    from toolgate.contracts.calls import is_valid_call_id

    if not is_valid_call_id(call_id):
        raise Failed(
            f"{command}: {call_id!r} is not a call_id: 1 to 128 letters, digits, _ or - "
            f"(it names the result subject; {flag})",
            2,
        )
    return call_id


def check_port(port: int, flag: str) -> int:
    """`port` if a server can listen on it (0: any free port); else Failed (exit 2)."""
    if not 0 <= port <= 65535:
        raise Failed(f"{flag} {port} is not a TCP port: 1 to 65535, or 0 for any free port", 2)
    return port


def check_creds(path: Path | None, flag: str = "--creds") -> Path | None:
    """`path` if it is a readable NATS creds file (or None); else Failed (exit 2)."""
    if path is None:
        return None
    from toolgate.runtime.creds import read_creds

    try:
        read_creds(Path(path).read_text())
    except IsADirectoryError:
        raise Failed(f"{path} is a directory, not a NATS creds file ({flag})", 2) from None
    except FileNotFoundError:
        raise Failed(
            f"no creds file at {path} ({flag}; `toolgate agents list` shows the agents' creds)", 2
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Failed(f"cannot read the creds file {path}: {exc} ({flag})", 2) from None
    except ValueError:
        raise Failed(
            f"{path} is not a NATS creds file (user JWT and nkey seed) ({flag})", 2
        ) from None
    return Path(path)


def nats_url_source(url: str) -> str:
    """Where --nats-url came from, for a message that says what was tried."""
    if os.environ.get("TOOLGATE_NATS_URL") == url:
        return "$TOOLGATE_NATS_URL"
    recorded = env.read_context().get("nats_url")
    if recorded == url:
        return f"recorded by `toolgate up` in {_context_path()}"
    if url == env.DEFAULT_NATS_URL and recorded is None:
        return f"the default: no `toolgate up` recorded one in {_context_path()}"
    return "--nats-url"


def _context_path() -> Path:
    """DATA_DIR/context.json: where every default of this command line came from."""
    return env.env_data_dir() / env.CONTEXT_FILE


def _nobody_up_here(url: str) -> Failed:
    """Refused at the default URL with no context: another gateway's NATS (or not toolgate's)."""
    return Failed(
        f"authorization refused at {url}: no `toolgate up` is recorded in "
        f"{_context_path()}, so the NATS at {url} belongs to another gateway or is not "
        "toolgate's: run this from the folder where that gateway's `toolgate up` ran, or "
        "give --data-dir DIR (or --nats-url and --creds)",
        2,
    )


def connect_failure(url: str, cause: BaseException | str) -> Failed:
    """The one line for a NATS that is not there or says no, exit 3."""
    text = str(cause) or type(cause).__name__
    lowered = text.lower()
    if "authorization" in lowered or "authentication" in lowered or "revoked" in lowered:
        if not env.read_context() and nats_url_source(url).startswith("the default"):
            return _nobody_up_here(url)
        return Failed(
            f"authorization refused at {url}: wrong, revoked or missing creds (--creds)", 3
        )
    if "permissions violation" in lowered:
        return Failed(
            f"permission denied at {url}: {text.removeprefix('nats: ')} (these "
            "creds may not do this: --creds)",
            3,
        )
    if isinstance(cause, TimeoutError) or lowered in ("timeouterror", "nats: timeout"):
        reason = "nothing answered as NATS in time"
    elif "refused" in lowered or "connect call failed" in lowered:
        reason = "connection refused"
    elif "name or service not known" in lowered or "nodename nor servname" in lowered:
        reason = "unknown host"
    else:
        reason = text.removeprefix("nats: ")
    return Failed(
        f"no NATS at {url} ({reason}; URL from {nats_url_source(url)}): is "
        "toolgate up running? (--nats-url)",
        3,
    )


async def connect_nats(url: str, creds: Path | None, timeout: float, **options: Any) -> Any:
    """One NATS connection within `timeout`, or Failed: for a command that runs once."""
    import nats
    import nats.errors

    from toolgate.runtime.creds import connect_options, nats_servers

    errors: list[Exception] = []

    async def remember(exc: Exception) -> None:  # instead of nats-py's tracebacks
        errors.append(exc)

    options = {
        "connect_timeout": timeout,
        "allow_reconnect": False,
        "error_cb": remember,
        **connect_options(creds),
        **options,
    }
    try:
        return await asyncio.wait_for(nats.connect(nats_servers(url), **options), timeout)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        # A refused login often ends in a reset connection: the refusal is the news.
        refusal = [
            e for e in errors if "authoriz" in str(e).lower() or "authentic" in str(e).lower()
        ]
        raise connect_failure(
            url, refusal[-1] if refusal else errors[-1] if errors else exc
        ) from None


class _OneLineNatsErrors(logging.Filter):
    """A long-running service logs a NATS it cannot reach as one line, not a traceback
    per attempt (it keeps reconnecting); the same line at most every 30 s."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        import nats.errors

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (OSError, TimeoutError, nats.errors.Error)):
            return True
        line = f"{connect_failure(self.url, exc)}; reconnecting"
        now = time.monotonic()
        if now - self.last.get(line, -1e9) < 30:
            return False
        self.last[line] = now
        record.msg, record.args, record.exc_info, record.exc_text = line, None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_nats_tracebacks(url: str) -> None:
    one_line = _OneLineNatsErrors(url)
    for handler in logging.getLogger().handlers:
        handler.addFilter(one_line)


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
        oidc_args=_oidc_args(args),
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


def _connect_client(args: argparse.Namespace, command: str) -> Any:
    """A GatewayClient as the agent of --creds within --connect-timeout (then it reconnects
    for as long as the command runs), or Failed in one line."""
    from toolgate.client.gateway_client import GatewayClient
    from toolgate.runtime.creds import identity_of_creds

    check_nats_url(args.nats_url)
    check_creds(args.creds)

    async def connect() -> Any:
        nc = await connect_nats(
            args.nats_url,
            args.creds,
            args.connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        identity = identity_of_creds(args.creds) if args.creds is not None else None
        if identity is None and args.creds is not None:
            await nc.close()
            raise Failed(
                f"{args.creds} is not an agent's creds (no tenant and agent in it): "
                "use one `toolgate agents add TENANT AGENT` printed (--creds)",
                2,
            )
        return GatewayClient(nc, identity)

    return connect


def _call_problem(exc: BaseException, url: str, what: str) -> Failed | None:
    """A NATS error while a connected command works, as one line (None: not one of those)."""
    import nats.errors
    from nats.js.errors import APIError

    if isinstance(exc, (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError)):
        return Failed(
            f"{what} at {url}: no answer from the gateway's streams (is toolgate up "
            "complete? may these creds do this?)",
            3,
        )
    if isinstance(exc, APIError):
        return Failed(
            f"{what} at {url}: the server said {exc.description or exc} (code {exc.err_code})", 3
        )
    if isinstance(exc, (nats.errors.Error, OSError)):
        return connect_failure(url, exc)
    return None


def cmd_call(args: argparse.Namespace) -> int:
    from toolgate.client.gateway_client import ResultTimeout, new_call_id
    from toolgate.contracts.calls import PendingNotice

    try:
        arguments = json.loads(args.arguments)
    except json.JSONDecodeError as exc:
        raise Failed(f"toolgate call: arguments are not JSON: {exc}", 2) from None
    if not isinstance(arguments, dict):
        raise Failed("toolgate call: arguments must be a JSON object", 2)
    if args.call_id is not None:
        check_call_id(args.call_id, "toolgate call", "--call-id")
    user_token = None
    if args.user_token_file is not None:
        try:
            user_token = args.user_token_file.read_text().strip()
        except OSError as exc:
            raise Failed(
                f"toolgate call: cannot read {args.user_token_file}: {exc.strerror or exc} "
                "(--user-token-file)",
                2,
            ) from None
        if not user_token:
            raise Failed(f"toolgate call: {args.user_token_file} is empty (--user-token-file)", 2)
    if args.user is None:  # with a user token, the gateway takes the user from its sub
        args.user = "" if user_token else "u-cli"
    connect = _connect_client(args, "call")
    # On a locked bus the creds say which tenant and agent this is; --tenant and
    # --agent only matter on an unlocked one.
    call = ToolCall(
        call_id=args.call_id or new_call_id(),
        tool=args.tool,
        arguments=arguments,
        principal=Principal(
            tenant=args.tenant, user=args.user, agent=args.agent, session=args.session
        ),
        task_id=args.task,
    )

    async def run() -> ToolResult:
        client = await connect()
        async with client:
            principal = (
                client.principal(args.user, args.session) if client.identity else call.principal
            )

            def waiting(notice: PendingNotice) -> None:
                key = f"{principal.tenant}.{principal.agent}.{call.call_id}"
                expires = f", until {notice.expires_at}" if notice.expires_at else ""
                print(
                    visible(
                        f"toolgate call: {call.call_id} waits for a human: {notice.message}"
                        f"{expires} (an approver: toolgate approvals approve {key})"
                    ),
                    file=sys.stderr,
                    flush=True,
                )

            try:
                return await client.submit(
                    msgspec.structs.replace(call, principal=principal),
                    timeout=args.timeout,
                    on_pending=waiting,
                    user_token=user_token,
                )
            except ResultTimeout:
                raise Failed(
                    f"toolgate call: no result for {call.call_id} within "
                    f"{args.timeout:g}s (it may still finish; fetch it with "
                    f"`toolgate result {call.call_id}`, or wait longer: --timeout)",
                    3,
                ) from None
            except Exception as exc:
                problem = _call_problem(exc, args.nats_url, f"cannot publish {call.call_id}")
                if problem is None:
                    raise
                raise problem from None

    result = asyncio.run(run())
    print(visible_json(msgspec.to_builtins(result), indent=2))
    return 0 if result.ok else 1


def cmd_result(args: argparse.Namespace) -> int:
    check_call_id(args.call_id, "toolgate result", "CALL_ID")
    connect = _connect_client(args, "result")

    async def run() -> ToolResult | None:
        client = await connect()
        async with client:
            try:
                return await client.result(args.call_id)
            except Exception as exc:
                problem = _call_problem(
                    exc, args.nats_url, f"cannot read the result of {args.call_id}"
                )
                if problem is None:
                    raise
                raise problem from None

    result = asyncio.run(run())
    if result is None:
        print(
            f"toolgate result: no result stored for {args.call_id} (yet) for this agent",
            file=sys.stderr,
        )
        return 1
    print(visible_json(msgspec.to_builtins(result), indent=2))
    return 0


def cmd_agents(args: argparse.Namespace) -> int:
    from toolgate.stack import nats_auth

    data_dir: Path = args.data_dir
    if args.action == "token":
        from toolgate.cli.mcp import cmd_agents_token

        return cmd_agents_token(args)
    if not data_dir.is_dir() and not (args.action == "add" and args.offline):
        raise Failed(
            f"toolgate agents: no gateway data dir at {data_dir} (`toolgate up` has "
            "not run here): run toolgate up first, or give --data-dir"
            + (", or --offline to mint for a later toolgate up" if args.action == "add" else ""),
            2,
        )
    if args.action == "list":
        records = nats_auth.list_agents(data_dir)
        if not records:
            print(f"no agents in {data_dir} (toolgate agents add TENANT AGENT)")
        for record in records:
            state = f"revoked {record.revoked_at}" if record.revoked_at else "active"
            creds = nats_auth.agent_creds_path(data_dir, record.tenant, record.agent)
            print(
                f"{record.tenant:<20} {record.agent:<20} {state:<28} "
                f"{creds if not record.revoked_at else '-'}"
            )
        return 0
    if not args.offline:
        check_nats_url(args.nats_url)
    try:
        if args.action == "add":
            creds, token = nats_auth.add_agent(data_dir, args.tenant, args.agent)
        else:
            token = nats_auth.revoke_agent(data_dir, args.tenant, args.agent)
            from toolgate.cli.mcp import push_front_door_account

            push_front_door_account(args, data_dir)  # the front door may no longer act for it
    except nats_auth.AgentError as exc:
        raise Failed(f"toolgate agents: {exc}", 2) from None
    told = _push_account(args, data_dir, token)
    name = f"{args.tenant}.{args.agent}"
    if args.action == "add":
        print(creds)
        if told is None:
            print(
                f"agent {name}: publishes only to toolgate.calls.{name}, reads only "
                f"toolgate.results.{name}.>; active now",
                file=sys.stderr,
            )
        elif args.offline:
            print(
                f"toolgate agents: agent {name} minted, active at the next toolgate up ({told})",
                file=sys.stderr,
            )
        else:
            raise not_told(f"agent {name} minted in {data_dir}", told)
        return 0
    if told is None:
        print(
            f"agent {name} revoked: creds deleted; the server refuses it and has cut its "
            "connections"
        )
        return 0
    if not args.offline:
        raise not_told(f"agent {name} revoked in {data_dir}, creds deleted", told)
    print(
        f"toolgate agents: agent {name} revoked in {data_dir}, creds deleted; the server "
        f"refuses it from its next start ({told})",
        file=sys.stderr,
    )
    return 0


def not_told(done: str, why: str) -> Failed:
    """The files are written, the running server was not told: exit 3 (only --offline
    means "files alone")."""
    return Failed(
        f"toolgate agents: {done}, but no running server was told ({why}); it takes "
        "effect when one is: run this again where `toolgate up` runs (--data-dir, "
        "--nats-url), or pass --offline to only write the files for the next toolgate up",
        3,
    )


def _push_account(args: argparse.Namespace, data_dir: Path, token: str) -> str | None:
    """Hand the account JWT to the running server: None once done, else why it was not."""
    from toolgate.stack import nats_auth

    if args.offline:
        return "--offline"
    system = nats_auth.creds_path(data_dir / nats_auth.CREDS_DIR, nats_auth.SYSTEM_ROLE)
    if not system.exists():
        return f"{NEVER_UP}: no system creds in {data_dir}"  # its start preloads the account

    async def push() -> None:
        # Reachable at all? (nats-py alone can wait for ever on a refused port.)
        nc = await connect_nats(args.nats_url, system, CONNECT_TIMEOUT_S)
        await nc.close()
        await asyncio.wait_for(
            nats_auth.push_account_jwts(
                args.nats_url, data_dir, [token], timeout=CONNECT_TIMEOUT_S
            ),
            3 * CONNECT_TIMEOUT_S,
        )

    try:
        asyncio.run(push())
    except nats_auth.AgentError:
        raise
    except Failed as exc:  # no server: it loads the account when it starts
        return str(exc)
    except Exception as exc:
        return str(connect_failure(args.nats_url, exc))
    return None


def cmd_schema(args: argparse.Namespace) -> int:
    from toolgate.contracts.calls import PendingNotice

    _, components = msgspec.json.schema_components(
        [ToolCall, ToolResult, PendingNotice], ref_template="#/$defs/{name}"
    )
    document = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "toolgate wire contract",
        "description": "Publish a ToolCall to toolgate.calls.<tenant>.<agent> with that agent's "
        "own NATS identity; read the ToolResult from "
        "toolgate.results.<tenant>.<agent>.<call_id> (stored once; a "
        "PendingNotice on <that>.pending while a human decides).",
        "$defs": components,
    }
    call_schema = components["ToolCall"]["properties"]["call_id"]
    call_schema.update({"pattern": "^[A-Za-z0-9_-]{1,128}$"})
    print(json.dumps(document, indent=2))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "mcp":
        from toolgate.bench.mcp import cmd_bench_mcp

        return cmd_bench_mcp(args)
    if args.target == "audit":
        from toolgate.bench.audit import cmd_bench_audit

        return cmd_bench_audit(args)
    if args.target == "audit-queries":
        from toolgate.bench.audit_queries import cmd_bench_audit_queries

        return cmd_bench_audit_queries(args)
    if args.target == "fairness":
        from toolgate.bench.fairness import run_fairness

        return run_fairness(args)
    if args.target == "policy":
        from toolgate.bench.policy import run_policy_bench

        run_policy_bench(args.calls)
        return 0
    if (
        args.rate is not None
        and args.rate <= 0
        or args.duration <= 0
        or args.calls < 0
        or args.burst < 1
        or args.rounds < 1
    ):
        print(
            "toolgate bench: --rate, --duration, --burst and --rounds must be positive, "
            "-n not negative",
            file=sys.stderr,
        )
        return 2
    if args.rate is not None and args.curve:
        print("toolgate bench: --rate or --curve, not both", file=sys.stderr)
        return 2
    if args.soak is not None and (args.soak < 1 or args.curve):
        print(
            "toolgate bench: --soak takes a positive number of calls, not --curve",
            file=sys.stderr,
        )
        return 2
    if args.nats_url:  # a running gateway: is it there at all? (one line, exit 3, if not)
        check_nats_url(args.nats_url)
        check_creds(args.creds)
        asyncio.run(_probe(args.nats_url, args.creds))
    from toolgate.bench.pipeline import run_bench

    return run_bench(args)


async def _probe(url: str, creds: Path | None) -> None:
    nc = await connect_nats(url, creds, CONNECT_TIMEOUT_S)
    await nc.close()


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="toolgate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)

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
    _add_runtime(up, recorded=False)
    _add_oidc(up, recorded=False)
    up.set_defaults(func=cmd_up)

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
    _add_runtime(serve)
    _add_oidc(serve)
    serve.set_defaults(func=cmd_serve)

    from toolgate.cli.audit import add_clickhouse_url
    from toolgate.cli.audit import register as register_audit

    add_clickhouse_url(serve)  # audit: where to write
    register_audit(commands)

    from toolgate.cli.status import register as register_status

    register_status(commands)

    from toolgate.cli.approvals import register as register_approvals
    from toolgate.cli.policy import register as register_policy

    register_approvals(commands)
    register_policy(commands)

    agents = commands.add_parser("agents", help="mint, list and revoke agent identities")
    agent_actions = agents.add_subparsers(dest="action", required=True)
    for action, text in (
        ("add", "mint one agent's NATS identity; prints its creds path"),
        ("revoke", "refuse an agent's creds and cut its connections"),
        ("token", "print a new bearer token of an agent for the MCP front door"),
    ):
        command = agent_actions.add_parser(action, help=text)
        command.add_argument("tenant", help="tenant name (letters, digits, - _; at most 64)")
        command.add_argument("agent", help="agent name (letters, digits, - _; at most 64)")
        command.add_argument(
            "--offline",
            action="store_true",
            help="only write the files; do not tell a running server (default: tell it)",
        )
        command.add_argument(
            "--nats-url",
            default=env.env_nats_url(),
            help="the running server to tell (default: $TOOLGATE_NATS_URL, "
            "else the one `toolgate up` recorded; now %(default)s)",
        )
    agent_actions.add_parser("list", help="every agent, active or revoked")
    from toolgate.cli.mcp import add_serve_flags
    from toolgate.cli.mcp import register as register_mcp

    for command in agent_actions.choices.values():
        command.add_argument(
            "--data-dir",
            type=Path,
            default=env.env_data_dir(),
            help="the gateway's state directory (default: $TOOLGATE_DATA_DIR, else %(default)s)",
        )
    agents.set_defaults(func=cmd_agents)
    register_mcp(commands)
    add_serve_flags(serve)

    call = commands.add_parser("call", help="publish one call and print its ToolResult")
    call.add_argument("tool", help="a tool name from the registry")
    call.add_argument("arguments", help="the arguments as a JSON object")
    call.add_argument(
        "--user",
        default=None,
        help="the end user (default: u-cli; with --user-token-file, the token's sub)",
    )
    call.add_argument(
        "--user-token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a file holding the end user's access token, sent as `Authorization: Bearer` "
        "(a gateway with --oidc-issuer needs it; a file, so it is not on the command line)",
    )
    call.add_argument("--session", default="s-cli", help="the session (default %(default)s)")
    call.add_argument(
        "--agent",
        default="researcher",
        help="unlocked bus only: the agent (on a locked bus the creds say; default %(default)s)",
    )
    call.add_argument(
        "--tenant",
        default="default",
        help="unlocked bus only: the tenant (on a locked bus the creds say; default %(default)s)",
    )
    call.add_argument("--task", default=None, help="the task id (default %(default)s)")
    call.add_argument(
        "--call-id",
        default=None,
        help="the call's id, a subject-safe token (default: a new unique id)",
    )
    call.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the result (default %(default)s)",
    )
    _add_nats(call)
    _add_connect_timeout(call)
    call.set_defaults(func=cmd_call)

    result = commands.add_parser("result", help="fetch the stored result of a call")
    result.add_argument("call_id", help="the call_id of one of this agent's calls")
    _add_nats(result)
    _add_connect_timeout(result)
    result.set_defaults(func=cmd_result)

    schema = commands.add_parser("schema", help="print the JSON Schema of the wire contract")
    schema.set_defaults(func=cmd_schema)

    bench = commands.add_parser(
        "bench", help="measure the gateway as an agent sees it, next to the raw bus"
    )
    bench.add_argument(
        "target",
        nargs="?",
        choices=["pipeline", "policy", "audit", "audit-queries", "mcp", "fairness"],
        default="pipeline",
    )
    bench.add_argument(
        "-n",
        "--calls",
        type=int,
        default=500,
        help="calls sent one at a time, per client (default %(default)s)",
    )
    bench.add_argument(
        "--burst",
        type=int,
        default=1000,
        help="calls published at once, per client (default %(default)s)",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the clients and the floor this many times, interleaved, "
        "and print medians (a shared machine drifts; default %(default)s)",
    )
    bench.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop instead: publish this many calls/s on a fixed schedule "
        "for --duration seconds, whatever earlier calls do",
    )
    bench.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="seconds of each open-loop run (default %(default)s)",
    )
    bench.add_argument(
        "--curve",
        action="store_true",
        help="measure the burst throughput, then hold 25/50/75/90%% of it "
        "open loop (--duration each) and print a table",
    )
    bench.add_argument(
        "--soak",
        type=int,
        default=None,
        metavar="CALLS",
        help="a soak: CALLS calls open loop at --rate (default: 60%% of the burst "
        "throughput, measured first); prints every process's RSS at the start and the "
        "end, the consumers' backlog, and the latency of the first and last 10,000 calls",
    )
    bench.add_argument(
        "--nats-url",
        default=env.env_nats_url_or_none(),
        help="a running gateway (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded here, else start a private one in a temp "
        "dir as `toolgate up` runs it)",
    )
    bench.add_argument(
        "--creds",
        type=Path,
        default=env.env_nats_creds("admin"),
        help="with --nats-url on a locked bus: the operator's (admin) "
        "credentials, for the floor and drain checks (default: "
        "$TOOLGATE_NATS_CREDS, else the admin creds `toolgate up` recorded)",
    )
    bench.add_argument(
        "--agent-creds",
        type=Path,
        default=None,
        help="with --nats-url: the agent the calls come from (default: the "
        "agent creds `toolgate up` recorded, else --creds)",
    )
    from toolgate.bench.audit import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def data_dir_given(argv: list[str]) -> Path | None:
    """The `--data-dir` of a command line (the last one, as argparse takes it), or None.

    Read before the parser is built: its defaults (NATS URL, creds, ClickHouse URL,
    registry) come from that folder's context.json, whichever command it is."""
    given: str | None = None
    for i, word in enumerate(argv):
        if word == "--":
            break
        if word == "--data-dir" and i + 1 < len(argv):
            given = argv[i + 1]
        elif word.startswith("--data-dir="):
            given = word.partition("=")[2]
    return Path(given) if given else None


def _add_data_dir_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every command takes --data-dir: the folder whose context.json it reads (main()
    reads it before the defaults); commands that keep state there declare it themselves."""
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subcommands:
        for command in subcommands[0].choices.values():
            _add_data_dir_everywhere(command)
    elif "--data-dir" not in parser._option_string_actions:
        parser.add_argument(
            "--data-dir",
            type=Path,
            default=env.env_data_dir(),
            help="the folder where `toolgate up` ran, whose context.json (NATS URL, "
            "creds) this command uses (default: $TOOLGATE_DATA_DIR, else %(default)s)",
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env.use_data_dir(data_dir_given(argv))  # before any default is read from the context
    try:
        return _run(argv)
    finally:
        # A command's --data-dir ends with it (main() is also called in-process, by
        # tests and by embedding programs: the next caller starts from the default).
        env.use_data_dir(None)


def _run(argv: list[str]) -> int:
    parser = build_parser()
    _add_data_dir_everywhere(parser)
    args = parser.parse_args(argv)
    if args.command not in ("serve", "up"):
        # One-shot commands say what went wrong in one line: no nats-py tracebacks.
        logging.getLogger("nats").addHandler(logging.NullHandler())
        logging.getLogger("nats").propagate = False
    try:
        return int(args.func(args))
    except Failed as exc:
        print(visible(str(exc), keep_newlines=True), file=sys.stderr)
        return exc.code
    except RegistryError as exc:
        print(f"toolgate: registry error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except CredentialsError as exc:
        print(f"toolgate: {exc} (--creds)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `toolgate ... | head`: the reader had enough
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # no flush error at exit
        return 141
    except Exception as exc:  # a bug, or a failure nobody foresaw: still one line
        if os.environ.get("TOOLGATE_DEBUG"):
            raise
        print(
            f"toolgate {args.command}: unexpected {type(exc).__name__}: {_one_line(exc)} "
            "(TOOLGATE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _one_line(exc: BaseException) -> str:
    return visible(" ".join(str(exc).split())) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
