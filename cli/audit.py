"""The auditor's commands, registered by the main CLI as `toolgate audit ...`.

    toolgate audit trace CALL_ID         the call's story, in order
    toolgate audit sql "SELECT ..."      read-only SQL; --format table|csv|json
    toolgate audit replay CALL_ID        run recorded calls again (or --since with filters)
    toolgate audit verify                check the hash chains against their signatures
    toolgate audit schema                apply the DDL (the sink does this at start-up)

Every command that talks to ClickHouse takes --clickhouse-url
(default $TOOLGATE_CLICKHOUSE_URL or http://127.0.0.1:8123/toolgate).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path

from toolgate.runtime import settings as env
from toolgate.services.audit.connection import ClickHouseTarget, env_clickhouse_url


def add_clickhouse_url(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clickhouse-url", default=env_clickhouse_url(),
                        help="ClickHouse HTTP URL, database as the path "
                             "(default: $TOOLGATE_CLICKHOUSE_URL or %(default)s)")


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    audit = subparsers.add_parser("audit", help="trace, query, verify and replay the audit",
                                  description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = audit.add_subparsers(dest="audit_command", required=True)

    trace = commands.add_parser("trace", help="one call's story, in order")
    trace.add_argument("call_id")
    for name in ("tenant", "agent"):
        trace.add_argument(f"--{name}", default=None,
                           help=f"only the call of this {name} (a call_id is per agent)")
    add_clickhouse_url(trace)
    trace.set_defaults(func=cmd_trace)

    sql = commands.add_parser("sql", help="run a read-only query")
    sql.add_argument("query")
    sql.add_argument("--format", choices=("table", "csv", "json"), default="table")
    add_clickhouse_url(sql)
    sql.set_defaults(func=cmd_sql)

    replay = commands.add_parser("replay", help="drive recorded calls through a gateway again")
    replay.add_argument("call_id", nargs="?", default=None)
    replay.add_argument("--since", type=_utc_time, default=None,
                        help="replay calls requested since this ISO time (UTC)")
    for name in ("tool", "tenant", "agent", "user"):
        replay.add_argument(f"--{name}", default=None, help=f"only calls of this {name}")
    replay.add_argument("--status", default=None, help="only calls that ended with this status")
    replay.add_argument("--limit", type=int, default=20)
    replay.add_argument("--include-replays", action="store_true")
    replay.add_argument("--timeout", type=float, default=60.0)
    replay.add_argument("--nats-url", default=env.env_nats_url(),
                        help="the running gateway (default: $TOOLGATE_NATS_URL or %(default)s)")
    replay.add_argument("--creds", type=Path, default=env.env_nats_creds("admin"),
                        help="on a locked bus: the operator's (admin) creds, or the creds of "
                             "the agent whose calls are replayed (default: "
                             "$TOOLGATE_NATS_CREDS)")
    add_clickhouse_url(replay)
    replay.set_defaults(func=cmd_replay)

    verify = commands.add_parser("verify", help="detect altered, deleted or inserted rows")
    verify.add_argument("--public-key", type=Path, default=None,
                        help="the audit seal public key (default: DATA_DIR/keys/audit-seal.pub)")
    verify.add_argument("--data-dir", type=Path, default=env.env_data_dir())
    add_clickhouse_url(verify)
    verify.set_defaults(func=cmd_verify)

    schema = commands.add_parser("schema", help="apply the versioned DDL")
    schema.add_argument("--ddl-set", choices=("single", "cluster"), default="single")
    schema.add_argument("--cluster", default="", help="cluster name for the cluster DDL set")
    add_clickhouse_url(schema)
    schema.set_defaults(func=cmd_schema)


def _utc_time(text: str) -> datetime:
    value = datetime.fromisoformat(text)
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _client(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    return ClickHouseTarget.from_url(args.clickhouse_url).client()


def cmd_trace(args: argparse.Namespace) -> int:
    from toolgate.services.audit.trace import format_trace, read_call_events, senders, story

    rows = read_call_events(_client(args), args.call_id, tenant=args.tenant, agent=args.agent)
    several = senders(rows)
    if len(several) > 1:
        print(f"toolgate audit trace: call_id {args.call_id} was used by "
              f"{', '.join(f'{t}.{a}' for t, a in several)}: give --tenant and --agent",
              file=sys.stderr)
        return 2
    steps = story(rows)
    print(format_trace(args.call_id, steps))
    return 0 if steps else 1


def cmd_sql(args: argparse.Namespace) -> int:
    from clickhouse_connect.driver.exceptions import DatabaseError

    from toolgate.services.audit.sql_console import render, run_readonly

    try:
        columns, rows = run_readonly(_client(args), args.query)
    except DatabaseError as exc:
        print(f"toolgate audit sql: {exc}", file=sys.stderr)
        return 2
    print(render(columns, rows, args.format))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from toolgate.services.audit.replay import find_recorded, replay, side_by_side

    if not args.call_id and args.since is None:
        print("toolgate audit replay: give a CALL_ID or --since", file=sys.stderr)
        return 2
    recorded = find_recorded(_client(args), call_id=args.call_id, since=args.since,
                             tool=args.tool, tenant=args.tenant, agent=args.agent,
                             user=args.user,
                             status=args.status, include_replays=args.include_replays,
                             limit=args.limit)
    if not recorded:
        print("no recorded call matches", file=sys.stderr)
        return 1
    outcomes = asyncio.run(replay(args.nats_url, recorded, args.creds, timeout=args.timeout))
    for outcome in outcomes:
        print(side_by_side(outcome), end="\n\n")
    return 0 if all(o.same for o in outcomes) else 1


def cmd_verify(args: argparse.Namespace) -> int:
    from toolgate.services.audit.chain import load_seal_public_key
    from toolgate.services.audit.verify import verify_store

    key = load_seal_public_key(args.public_key or args.data_dir / "keys")
    report = verify_store(_client(args), key)
    for finding in report.findings:
        print(finding.line())
    verdict = "OK" if report.ok else f"TAMPERED ({len(report.tampered)} finding(s))"
    print(f"{verdict}: {report.rows} rows in {report.chains} chain(s), "
          f"{report.checkpoints} checkpoint(s)")
    return 0 if report.ok else 1


def cmd_schema(args: argparse.Namespace) -> int:
    from toolgate.services.audit.schema import apply_schema

    target = ClickHouseTarget.from_url(args.clickhouse_url)
    ran = apply_schema(target, args.ddl_set, args.cluster)
    print(f"{target.display()}: applied {ran or 'nothing new'}")
    return 0
