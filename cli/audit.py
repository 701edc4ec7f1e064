"""The auditor's commands, registered by the main CLI as `toolgate audit ...`.

    toolgate audit trace CALL_ID         the call's story, in order
    toolgate audit sql "SELECT ..."      read-only SQL; --format table|csv|json
    toolgate audit replay CALL_ID        decide recorded calls again under today's registry
                                         and bundle (or --since with filters); runs nothing
    toolgate audit replay --execute ...  run read_only tools again, compare their results
    toolgate audit verify                check the hash chains against their signatures
    toolgate audit schema                apply the DDL (the sink does this at start-up)

Where the audit is: --clickhouse-url, else $TOOLGATE_CLICKHOUSE_URL, else the
ClickHouse `toolgate up` recorded in DATA_DIR/context.json, else
http://127.0.0.1:8123/toolgate. --since takes 90s, 30m, 24h, 7d or an ISO 8601
time (UTC unless it says). Long runs print their progress to stderr.

Exit codes: 0 done (trace: found; replay: every decision, or with --execute every
result, the same; verify: intact), 1 a clear "no" (nothing found, a decision or
result differs or could not be compared, tampering found),
2 bad input or configuration (a flag, a URL, no such database, a missing or
bad key, a query ClickHouse refused), 3 could not reach ClickHouse or NATS.
Every failure is one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from toolgate.contracts.registry import RegistryError
from toolgate.runtime import settings as env
from toolgate.runtime.creds import CredentialsError
from toolgate.runtime.outside_text import visible
from toolgate.runtime.timespec import FORMS, TimeSpecError, parse_since
from toolgate.services.audit.connection import (
    BAD_CONFIG,
    DEFAULT_CLICKHOUSE_URL,
    DEFAULT_CONNECT_TIMEOUT_S,
    UNREACHABLE,
    ClickHouseTarget,
    Store,
    StoreError,
    env_clickhouse_url,
    login_url,
    one_line,
)

if TYPE_CHECKING:  # the commands import these when they run, not when the CLI starts
    from toolgate.cli.redecide import ActiveBundle, Recorded
    from toolgate.contracts.registry import Registry
    from toolgate.services.audit.replay import RecordedCall

READONLY = 164  # ClickHouse's error code for a write under readonly=1
ACCESS_DENIED = 497  # ... for what the user's grants do not allow (the auditor: any write)


class Failed(Exception):
    """An operator command ends here: one line on stderr, this exit code."""

    def __init__(self, message: str, exit_code: int = BAD_CONFIG) -> None:
        super().__init__(one_line(message))
        self.exit_code = exit_code


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line too (argparse would print the usage first)."""

    def error(self, message: str) -> Any:  # argparse's signature says NoReturn
        self.exit(BAD_CONFIG, f"{self.prog}: {message} (see {self.prog} --help)\n")


def fails_in_one_line(
    command: str,
) -> Callable[[Callable[[argparse.Namespace], int]], Callable[[argparse.Namespace], int]]:
    """Run an operator command; what it cannot do is one line on stderr and an exit code."""

    def wrap(func: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(func)
        def run(args: argparse.Namespace) -> int:
            from toolgate.client.gateway_client import ConnectFailed

            quiet_driver()
            try:
                return func(args)
            except (Failed, StoreError) as exc:
                failure: Failed | StoreError = exc
            except ConnectFailed as exc:
                failure = Failed(str(exc), UNREACHABLE)
            except CredentialsError as exc:
                failure = Failed(f"NATS creds: {exc} (--creds or $TOOLGATE_NATS_CREDS)")
            print(visible(f"{command}: {failure}"), file=sys.stderr)
            return failure.exit_code

        return run

    return wrap


def quiet_driver() -> None:
    """clickhouse-connect logs a warning line of its own for every transport error; the
    command says it once, better."""
    driver = logging.getLogger("clickhouse_connect")
    if not any(isinstance(h, logging.NullHandler) for h in driver.handlers):
        driver.addHandler(logging.NullHandler())


def since_of(text: str | None) -> datetime | None:
    """--since as a UTC datetime (None if not given), or Failed."""
    if text is None:
        return None
    try:
        return parse_since(text)
    except TimeSpecError as exc:
        raise Failed(f"--since {exc}") from None


# -- where the audit is ------------------------------------------------------------------


def add_clickhouse_url(parser: argparse.ArgumentParser) -> None:
    """For services (`toolgate serve audit`): the URL, resolved when the parser is built."""
    parser.add_argument(
        "--clickhouse-url",
        default=env_clickhouse_url(),
        help="ClickHouse HTTP URL, database as the path "
        "(default: $TOOLGATE_CLICKHOUSE_URL or %(default)s)",
    )


def add_store_options(parser: argparse.ArgumentParser) -> None:
    """For operator commands: resolved at run time, so a failure can say where it came from."""
    parser.add_argument(
        "--clickhouse-url",
        default=None,
        help="ClickHouse HTTP URL, database as the path (default: "
        "$TOOLGATE_CLICKHOUSE_URL, else the one `toolgate up` recorded "
        f"in DATA_DIR/context.json, else {DEFAULT_CLICKHOUSE_URL})",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for ClickHouse (and NATS) to answer before "
        "giving up (default %(default)s)",
    )


def data_dir_of(given: Path | None) -> tuple[Path, str]:
    """DATA_DIR and where it came from."""
    if given is not None:
        return given, "--data-dir"
    return env.env_data_dir(), env.data_dir_source()


def store_of(given: str | None, data_dir: Path | None = None, role: str = "auditor") -> Store:
    """The audit store an operator command reads: flag, variable, context file, default.

    A URL without a user logs in as `role` when it is the embedded server `toolgate up`
    recorded (its generated logins, DATA_DIR/clickhouse/logins.json)."""
    if given:
        return Store(login_url(given, role, data_dir), "--clickhouse-url", "check the URL")
    if os.environ.get("TOOLGATE_CLICKHOUSE_URL"):
        return Store(
            login_url(os.environ["TOOLGATE_CLICKHOUSE_URL"], role, data_dir),
            "$TOOLGATE_CLICKHOUSE_URL",
            "check the variable, or give --clickhouse-url",
        )
    context = ((data_dir or env.env_data_dir()) / env.CONTEXT_FILE).absolute()
    recorded = env.read_context(data_dir).get("clickhouse_url")
    if isinstance(recorded, str) and recorded:
        return Store(
            login_url(recorded, role, data_dir),
            f"{context}, written by `toolgate up`",
            "is that `toolgate up` still running? Otherwise give --clickhouse-url "
            "or $TOOLGATE_CLICKHOUSE_URL",
        )
    return Store(
        DEFAULT_CLICKHOUSE_URL,
        f"the default: no --clickhouse-url, no $TOOLGATE_CLICKHOUSE_URL, no ClickHouse "
        f"recorded in {context}",
        "run `toolgate up` in this folder first, or give --clickhouse-url or "
        "$TOOLGATE_CLICKHOUSE_URL",
    )


# -- the commands --------------------------------------------------------------------------


def register(subparsers: argparse._SubParsersAction) -> None:
    audit = subparsers.add_parser(
        "audit",
        help="trace, query, verify and replay the audit",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = audit.add_subparsers(dest="audit_command", required=True, parser_class=OneLineParser)

    trace = commands.add_parser("trace", help="one call's story, in order")
    trace.add_argument("call_id")
    for name in ("tenant", "agent"):
        trace.add_argument(
            f"--{name}", default=None, help=f"only the call of this {name} (a call_id is per agent)"
        )
    add_store_options(trace)
    trace.set_defaults(func=cmd_trace)

    sql = commands.add_parser("sql", help="run a read-only query")
    sql.add_argument("query")
    sql.add_argument("--format", choices=("table", "csv", "json"), default="table")
    add_store_options(sql)
    sql.set_defaults(func=cmd_sql)

    replay = commands.add_parser(
        "replay",
        help="decide recorded calls again (nothing runs); --execute: run read_only tools again",
    )
    replay.add_argument("call_id", nargs="?", default=None)
    replay.add_argument(
        "--since",
        default=None,
        help=f"replay calls requested since then: {FORMS} (UTC unless it says)",
    )
    for name in ("tool", "tenant", "agent", "user"):
        replay.add_argument(f"--{name}", default=None, help=f"only calls of this {name}")
    replay.add_argument("--status", default=None, help="only calls that ended with this status")
    replay.add_argument(
        "--limit",
        type=int,
        default=20,
        help="at most this many calls, the latest (default %(default)s)",
    )
    replay.add_argument("--include-replays", action="store_true")
    replay.add_argument(
        "--execute",
        action="store_true",
        help="run the tools again as new calls through the gateway and compare results; "
        "only tools declared read_only: true in today's registry (any other is refused, "
        "exit 2, before anything is sent)",
    )
    replay.add_argument(
        "--registry",
        type=Path,
        action="append",
        default=None,
        help="today's tool registry directory beside the built-in tools, repeatable "
        "(default: $TOOLGATE_REGISTRY, else the one `toolgate up` recorded in "
        "DATA_DIR/context.json, else the built-in tools)",
    )
    replay.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="the --registry directories without the built-in tools (as `toolgate up "
        "--no-builtin-tools`)",
    )
    replay.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the gateway's state directory: its context.json and the policy-signing "
        "public key (default: $TOOLGATE_DATA_DIR or .toolgate)",
    )
    replay.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="with --execute: seconds to wait for each call's result (default %(default)s)",
    )
    replay.add_argument(
        "--nats-url",
        default=None,
        help="the running gateway, whose policies bucket holds today's bundle (default: "
        "$TOOLGATE_NATS_URL, else the one `toolgate up` recorded in DATA_DIR, else "
        f"{env.DEFAULT_NATS_URL})",
    )
    replay.add_argument(
        "--creds",
        type=Path,
        default=None,
        help="on a locked bus: the operator's (admin) creds, which may read the active "
        "bundle; with --execute also the creds of the agent whose calls are re-run "
        "(default: $TOOLGATE_NATS_CREDS, else the admin creds `toolgate up` recorded in "
        "DATA_DIR)",
    )
    add_store_options(replay)
    replay.set_defaults(func=cmd_replay)

    verify = commands.add_parser("verify", help="detect altered, deleted or inserted rows")
    verify.add_argument(
        "--public-key",
        type=Path,
        default=None,
        help="the audit seal public key (default: DATA_DIR/keys/audit-seal.pub)",
    )
    verify.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="the gateway's state directory: its seal key and context.json "
        "(default: $TOOLGATE_DATA_DIR or .toolgate)",
    )
    verify.add_argument(
        "--nats-url",
        default=None,
        help="where the seal stream is (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded)",
    )
    verify.add_argument(
        "--creds",
        type=Path,
        default=None,
        help="creds that may read the seal stream (default: the admin creds "
        "`toolgate up` recorded)",
    )
    verify.add_argument(
        "--without-seals",
        action="store_true",
        help="check ClickHouse alone (a chain deleted with all its checkpoints then goes unseen)",
    )
    add_store_options(verify)
    verify.set_defaults(func=cmd_verify)

    lag = commands.add_parser(
        "lag", help="how far behind the audit sink is (the oldest unwritten message)"
    )
    lag.add_argument(
        "--nats-url",
        default=env.env_nats_url(),
        help="the running gateway (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded; now %(default)s)",
    )
    lag.add_argument(
        "--creds",
        type=Path,
        default=env.env_nats_creds("admin"),
        help="the operator's creds (default: $TOOLGATE_NATS_CREDS, else the admin creds "
        "`toolgate up` recorded)",
    )
    lag.add_argument("--connect-timeout", type=float, default=DEFAULT_CONNECT_TIMEOUT_S)
    lag.set_defaults(func=cmd_lag)

    schema = commands.add_parser("schema", help="apply the versioned DDL")
    schema.add_argument("--ddl-set", choices=("single", "cluster"), default="single")
    schema.add_argument("--cluster", default="", help="cluster name for the cluster DDL set")
    add_store_options(schema)
    schema.set_defaults(func=cmd_schema)


def _open(args: argparse.Namespace, data_dir: Path | None = None) -> tuple[Store, Any]:
    store = store_of(args.clickhouse_url, data_dir)
    return store, store.open(args.connect_timeout)


def _check_timeout(args: argparse.Namespace) -> None:
    if not args.connect_timeout > 0:
        raise Failed(f"--connect-timeout {args.connect_timeout:g}: give a number of seconds > 0")


def _check_nats_url(url: str) -> None:
    """A URL that cannot name a NATS server is bad input (2), not an unreachable server."""
    parts = urlsplit(url if "://" in url else f"nats://{url}")
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        port_ok = False
    if parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname or not port_ok:
        raise Failed(f"--nats-url {url!r} is not a NATS URL: give nats://HOST:PORT")


@fails_in_one_line("toolgate audit trace")
def cmd_trace(args: argparse.Namespace) -> int:
    from toolgate.services.audit.trace import format_trace, read_call_events, senders, story

    _check_timeout(args)
    store, client = _open(args)
    with store.errors():
        rows = read_call_events(client, args.call_id, tenant=args.tenant, agent=args.agent)
    several = senders(rows)
    if len(several) > 1:
        raise Failed(
            f"call_id {args.call_id} was used by "
            f"{', '.join(f'{t}.{a}' for t, a in several)} (each its own call): "
            "give --tenant and --agent"
        )
    steps = story(rows)
    print(format_trace(args.call_id, steps))
    return 0 if steps else 1


@fails_in_one_line("toolgate audit sql")
def cmd_sql(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

    from toolgate.services.audit.connection import server_text
    from toolgate.services.audit.sql_console import render, run_readonly

    _check_timeout(args)
    if not args.query.strip():
        raise Failed('give a query, e.g. "SELECT tool, count() FROM calls GROUP BY tool"')
    store, client = _open(args)
    try:
        columns, rows = run_readonly(client, args.query)
    except OperationalError as exc:
        raise store.explain(exc) from None
    except DatabaseError as exc:
        readonly = " (audit sql is read-only)" if exc.code in (READONLY, ACCESS_DENIED) else ""
        raise Failed(f"ClickHouse refused the query{readonly}: {server_text(exc)}") from None
    print(render(columns, rows, args.format))
    return 0


@fails_in_one_line("toolgate audit replay")
def cmd_replay(args: argparse.Namespace) -> int:
    """Re-decide (default) or, with --execute, re-run read_only tools; see redecide.py."""
    from toolgate.cli.redecide import read_recorded
    from toolgate.runtime.settings import GatewaySettings, recorded_registry
    from toolgate.services.audit.replay import find_recorded

    since = since_of(args.since)
    if not args.call_id and since is None:
        raise Failed("give a CALL_ID or --since (e.g. --since 1h)")
    if args.limit < 1:
        raise Failed(f"--limit {args.limit}: give at least 1")
    if not args.timeout > 0:
        raise Failed(f"--timeout {args.timeout:g}: give a number of seconds > 0")
    _check_timeout(args)
    data_dir = args.data_dir or env.env_data_dir()
    args.nats_url, args.creds = _operator_bus(args.nats_url, args.creds, data_dir)
    _check_nats_url(args.nats_url)
    # Today's registry: --registry (beside the built-in tools), else what `up` recorded.
    recorded_dirs, builtin = recorded_registry(data_dir)
    registry_dirs = tuple(args.registry or recorded_dirs)
    builtin = (builtin or bool(args.registry)) and not args.no_builtin_tools
    try:
        registry = GatewaySettings(
            registry_dirs=registry_dirs, builtin_tools=builtin
        ).load_registry()
    except RegistryError as exc:
        raise Failed(f"tool registry: {exc} (--registry or $TOOLGATE_REGISTRY)") from None
    store, client = _open(args, args.data_dir)
    with store.errors():
        recorded = find_recorded(
            client,
            call_id=args.call_id,
            since=since,
            tool=args.tool,
            tenant=args.tenant,
            agent=args.agent,
            user=args.user,
            status=args.status,
            include_replays=args.include_replays,
            limit=args.limit,
        )
    if not recorded:
        asked = (
            f"call_id {args.call_id}"
            if args.call_id
            else f"calls since {since:%Y-%m-%d %H:%M:%S} UTC"
        )
        print(
            f"toolgate audit replay: no recorded call matches ({asked} and the filters) in "
            f"{store.target().display()}",
            file=sys.stderr,
        )
        return 1
    registry_text = ":".join(map(str, registry_dirs)) or "the built-in tools"
    if args.execute:
        return _execute(args, recorded, registry, registry_text)
    with store.errors():
        decided = read_recorded(client, call_ids=sorted({r.call_id for r in recorded}))
    return _redecide(args, recorded, decided, registry, registry_text, data_dir)


def _operator_bus(url: str | None, creds: Path | None, data_dir: Path) -> tuple[str, Path | None]:
    """The flags, else the TOOLGATE_* variables, else what `toolgate up` recorded in
    DATA_DIR (the admin creds), else the default URL and no creds."""
    context = env.read_context(data_dir)
    url = url or os.environ.get("TOOLGATE_NATS_URL") or context.get("nats_url")
    if creds is None and os.environ.get("TOOLGATE_NATS_CREDS"):
        creds = Path(os.environ["TOOLGATE_NATS_CREDS"])
    recorded = (context.get("creds") or {}).get("admin")
    if creds is None and isinstance(recorded, str) and Path(recorded).exists():
        creds = Path(recorded)
    return url or env.DEFAULT_NATS_URL, creds


def _redecide(
    args: argparse.Namespace,
    recorded: list[RecordedCall],
    decided: list[Recorded],
    registry: Registry,
    registry_text: str,
    data_dir: Path,
) -> int:
    """Every recorded call through validation, policy and the approval rule, here."""
    from toolgate.cli.redecide import RecordedClock, redecide
    from toolgate.contracts.calls import MAX_CALL_BYTES
    from toolgate.services.audit.progress import Progress
    from toolgate.services.policy.engine import CedarEngine
    from toolgate.services.validator.logic import CallChecker, Identity

    bundle = _active_bundle(args, data_dir)
    clock = RecordedClock()
    engine = CedarEngine(bundle.engine.bundle, clock=clock)  # today's bundle, the recorded time
    checker = CallChecker(registry, MAX_CALL_BYTES)
    decisions = {(d.tenant, d.agent, d.call_id): d for d in decided}
    progress = Progress("toolgate audit replay", "calls re-decided", len(recorded))
    outcomes = []
    for r in progress.counted(recorded):
        then = decisions.get((r.tenant, r.agent, r.call_id))
        tool = r.call.tool if r.call is not None else then.tool if then is not None else ""
        outcomes.append(
            redecide(
                r.published,
                r.why_not,
                Identity(r.tenant, r.agent),
                then,
                checker,
                engine,
                clock,
                r.call_id,
                tool,
            )
        )
    progress.finish()
    print(
        f"decision comparison: {len(outcomes)} recorded call(s) decided again under today's "
        f"registry ({registry_text}) and today's policy bundle {engine.version} "
        f"({bundle.source}); nothing was published, no tool ran\n"
    )
    for outcome in outcomes:
        print(outcome.text(engine.version), end="\n\n")
    same = sum(1 for o in outcomes if o.same)
    differ = sum(1 for o in outcomes if o.same is False)
    print(
        f"{same} same decision(s), {differ} different, {len(outcomes) - same - differ} not compared"
    )
    return 0 if same == len(outcomes) else 1


def _active_bundle(args: argparse.Namespace, data_dir: Path) -> ActiveBundle:
    """Today's active bundle, read from the running gateway's policies bucket."""
    import nats.errors
    from nats.js.errors import Error as JetStreamError

    from toolgate.cli.common import Failed as NoNats
    from toolgate.cli.common import connect_nats
    from toolgate.cli.redecide import load_active_bundle
    from toolgate.runtime.creds import identity_of_creds
    from toolgate.services.policy.app import PolicyStateError
    from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, BundleError
    from toolgate.services.policy.bundle_store import ACTIVE_KEY, POLICIES_BUCKET

    agent = identity_of_creds(args.creds) if args.creds is not None else None
    if agent is not None:
        raise Failed(
            f"--creds {args.creds} speak for agent {agent[0]}.{agent[1]}, and re-deciding reads "
            f"today's policy bundle ({POLICIES_BUCKET}), which takes the operator's (admin) "
            "creds, the default where `toolgate up` ran (an agent's creds may re-run its own "
            "read_only calls: --execute)"
        )
    recorded = env.read_context(data_dir).get("policy_dir")
    local = Path(recorded) if isinstance(recorded, str) and recorded else DEFAULT_BUNDLE_DIR

    async def load() -> ActiveBundle:
        nc = await connect_nats(args.nats_url, args.creds, args.connect_timeout)
        try:
            js = nc.jetstream(timeout=args.connect_timeout)
            return await load_active_bundle(js, data_dir / "keys", local)
        finally:
            await nc.close()

    try:
        return asyncio.run(load())
    except NoNats as exc:
        raise Failed(str(exc), exc.code) from None
    except PolicyStateError as exc:
        raise Failed(
            "today's active policy bundle would not be used by a policy service: "
            + exc.reason.removeprefix("policy service not starting: ")
        ) from None
    except BundleError as exc:
        raise Failed(
            f"the local policy bundle {local} (used while none was pushed) is not valid: "
            + "; ".join(str(exc).splitlines())
        ) from None
    except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        denied = "permission" in text.lower()
        raise Failed(
            f"cannot read today's policy bundle ({POLICIES_BUCKET}/{ACTIVE_KEY}) at "
            f"{args.nats_url}: {text} (it takes the operator's creds: --creds, default the "
            "admin creds `toolgate up` recorded)",
            BAD_CONFIG if denied else UNREACHABLE,
        ) from None


def _execute(
    args: argparse.Namespace, recorded: list[RecordedCall], registry: Registry, registry_text: str
) -> int:
    """--execute: read_only tools only, refused before anything is sent."""
    from toolgate.services.audit.progress import Progress
    from toolgate.services.audit.replay import replay, side_by_side

    tools = sorted({r.call.tool for r in recorded if r.call is not None})
    refused = [t for t in tools if not getattr(registry.get(t), "read_only", False)]
    if refused:
        raise Failed(
            f"--execute runs tools again, and {', '.join(refused)} "
            f"{'is' if len(refused) == 1 else 'are'} not declared read_only: true in today's "
            f"registry ({registry_text}): nothing was sent; without --execute the calls are "
            "re-decided and no tool runs"
        )
    print(
        f"result comparison: {len(recorded)} recorded call(s) of read_only tools run again "
        f"as new calls through the gateway at {args.nats_url}\n"
    )
    progress = Progress("toolgate audit replay", "calls re-executed", len(recorded))
    outcomes = asyncio.run(
        replay(
            args.nats_url,
            recorded,
            args.creds,
            timeout=args.timeout,
            connect_timeout=args.connect_timeout,
            progress=progress,
        )
    )
    progress.finish()
    for outcome in outcomes:
        print(visible(side_by_side(outcome), keep_newlines=True), end="\n\n")
    return 0 if all(o.same for o in outcomes) else 1


@fails_in_one_line("toolgate audit verify")
def cmd_verify(args: argparse.Namespace) -> int:
    from toolgate.services.audit.chain import SEAL_PUBLIC_FILE, load_seal_public_key
    from toolgate.services.audit.verify import verify_store

    _check_timeout(args)
    data_dir, source = data_dir_of(args.data_dir)
    if args.public_key is not None:
        path, where = args.public_key, "--public-key"
    else:
        path, where = data_dir / "keys" / SEAL_PUBLIC_FILE, f"in DATA_DIR {data_dir}, {source}"
    if not path.is_file():
        raise Failed(
            f"no audit seal public key at {path.absolute()} ({where}): run it in the "
            "folder where `toolgate up` ran, or give --data-dir DIR or --public-key "
            "FILE (the audit sink writes DATA_DIR/keys/audit-seal.pub)"
        )
    try:
        key = load_seal_public_key(path)
    except (ValueError, OSError) as exc:
        raise Failed(
            f"{path} ({where}) is not a readable Ed25519 public key in PEM "
            f"({str(exc).split('. See ')[0] or type(exc).__name__})"
        ) from None
    store, client = _open(args, data_dir if args.data_dir is not None else None)
    with store.errors():  # the audit tables are there (else: one line, exit 2) before NATS
        client.query("SELECT 1 FROM event_log LIMIT 1")
    seals = None
    if not args.without_seals:
        from toolgate.services.audit.seals import SealsUnavailable, read_seals

        context = env.read_context(data_dir)
        recorded_creds = (context.get("creds") or {}).get("admin")
        nats_url = args.nats_url or os.environ.get("TOOLGATE_NATS_URL") or context.get("nats_url")
        nats_url = nats_url or env.DEFAULT_NATS_URL
        creds = args.creds or (Path(recorded_creds) if recorded_creds else None)
        try:
            seals, bad = asyncio.run(read_seals(nats_url, creds, args.connect_timeout))
        except SealsUnavailable as exc:
            raise Failed(
                f"cannot read the audit seals in JetStream ({exc}): give --nats-url and "
                "--creds (the operator's), or --without-seals to check ClickHouse alone",
                UNREACHABLE,
            ) from None
        if bad:
            print(f"WARNING: {bad} message(s) in the seal stream are not seals", file=sys.stderr)
    with store.errors():
        report = verify_store(client, key, seals)
    for finding in report.findings:
        print(visible(finding.line()))  # ids and writers a forged row may carry
    verdict = "OK" if report.ok else f"TAMPERED ({len(report.tampered)} finding(s))"
    against = f", {len(seals)} seal(s) in JetStream" if seals is not None else ", seals not checked"
    print(
        f"{verdict}: {report.rows} rows in {report.chains} chain(s), "
        f"{report.checkpoints} checkpoint(s){against}"
    )
    return 0 if report.ok else 1


@fails_in_one_line("toolgate audit lag")
def cmd_lag(args: argparse.Namespace) -> int:
    """One line per source stream; exit 1 when the sink is past the warning threshold."""
    from toolgate.services.audit.lag import WARN_AFTER_S, audit_lag
    from toolgate.services.audit.seals import SealsUnavailable, connected

    _check_timeout(args)
    _check_nats_url(args.nats_url)

    async def measure() -> list[Any]:
        async with connected(args.nats_url, args.creds, args.connect_timeout) as nc:
            return await audit_lag(nc)

    try:
        lags = asyncio.run(measure())
    except SealsUnavailable as exc:
        raise Failed(f"{exc}: is toolgate up running? (--nats-url, --creds)", UNREACHABLE) from None
    for lag in lags:
        print(lag.line())
    return 1 if any(lag.oldest_unwritten_s > WARN_AFTER_S for lag in lags) else 0


@fails_in_one_line("toolgate audit schema")
def cmd_schema(args: argparse.Namespace) -> int:
    from toolgate.services.audit.schema import SchemaError, apply_schema

    _check_timeout(args)
    store = store_of(args.clickhouse_url, role="admin")
    target: ClickHouseTarget = store.target()
    store.probe(target, args.connect_timeout)  # the database may not exist yet: no open()
    try:
        with store.errors():
            ran = apply_schema(target, args.ddl_set, args.cluster)
    except SchemaError as exc:
        raise Failed(str(exc)) from None
    print(f"{target.display()}: applied {ran or 'nothing new'}")
    return 0
