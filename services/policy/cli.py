"""`toolgate policy check DIR`, `toolgate policy push DIR` and `toolgate policy test DIR`.

check validates a bundle directory here and prints its version; push
validates it the same way, then stores it as the active bundle, which every
policy replica loads within a moment. A bundle that fails validation is
never pushed: the command prints file, line and reason and exits 2. test
replays the decisions recorded in the audit store under a bundle and prints
which would change (exit 0: none, 1: some, 2: bad bundle).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

import nats

from toolgate.services.audit.cli import add_clickhouse_url
from toolgate.services.policy.bundle import BundleError, read_bundle_dir
from toolgate.services.policy.bundle_store import (
    ACTIVE_KEY,
    POLICIES_BUCKET,
    open_bucket,
    policies_bucket_config,
    push_bundle,
)
from toolgate.services.policy.engine import CedarEngine, engine_from_files
from toolgate.services.settings import GatewaySettings, env_nats_url, env_registry_dirs


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    policy = subparsers.add_parser("policy", help="check or push a Cedar policy bundle")
    commands = policy.add_subparsers(dest="policy_command", required=True)
    check = commands.add_parser("check", help="validate a bundle directory, print its version")
    check.add_argument("directory", type=Path)
    check.set_defaults(func=cmd_check)
    push = commands.add_parser("push", help="validate a bundle and make it active everywhere")
    push.add_argument("directory", type=Path)
    push.add_argument("--nats-url", default=env_nats_url(),
                      help="NATS server URL (default: $TOOLGATE_NATS_URL or %(default)s)")
    push.set_defaults(func=cmd_push)
    test = commands.add_parser("test", help="which recorded decisions a bundle would change")
    test.add_argument("directory", type=Path)
    test.add_argument("--since", default="24h",
                      help="24h, 30m, 7d or an ISO time, UTC (default: %(default)s)")
    test.add_argument("--registry", type=Path, action="append", default=None,
                      help="tool registry directory, repeatable (default: $TOOLGATE_REGISTRY "
                           "or the built-in tools)")
    test.add_argument("--limit", type=int, default=5, help="example call_ids per kind")
    test.add_argument("--format", choices=("text", "json"), default="text")
    add_clickhouse_url(test)
    test.set_defaults(func=cmd_test)


def checked_engine(directory: Path) -> tuple[dict[str, str], CedarEngine] | None:
    try:
        files = read_bundle_dir(directory)
        return files, engine_from_files(files)
    except BundleError as exc:
        print(f"toolgate: policy bundle {directory} rejected:\n{exc}", file=sys.stderr)
        return None


def cmd_check(args: argparse.Namespace) -> int:
    checked = checked_engine(args.directory)
    if checked is None:
        return 2
    _, engine = checked
    print(f"{engine.version}  {len(engine.bundle.policies)} policies: "
          + ", ".join(engine.bundle.policies))
    return 0


async def push(nats_url: str, files: dict[str, str], version: str) -> int:
    nc = await nats.connect(nats_url)
    try:
        kv = await open_bucket(nc.jetstream(), policies_bucket_config())
        return await push_bundle(kv, files, version)
    finally:
        await nc.close()


def cmd_push(args: argparse.Namespace) -> int:
    checked = checked_engine(args.directory)
    if checked is None:
        return 2
    files, engine = checked
    revision = asyncio.run(push(args.nats_url, files, engine.version))
    print(f"pushed policy bundle {engine.version} to {POLICIES_BUCKET}/{ACTIVE_KEY} "
          f"(revision {revision})")
    return 0


def cmd_test(args: argparse.Namespace) -> int:
    from toolgate.services.audit.connection import connect
    from toolgate.services.policy.history import evaluate_history, parse_since, read_recorded

    try:
        since = parse_since(args.since)
    except ValueError:
        print(f"toolgate policy test: --since {args.since!r}: not 24h, 30m, 7d "
              "or an ISO time", file=sys.stderr)
        return 2
    checked = checked_engine(args.directory)
    if checked is None:
        return 2
    _, engine = checked
    registry = GatewaySettings(registry_dirs=tuple(args.registry or env_registry_dirs())
                               ).load_registry()
    recorded = read_recorded(connect(args.clickhouse_url), since)
    report = evaluate_history(engine.bundle, registry, recorded, since)
    if args.format == "json":
        print(json.dumps(report.to_json(args.limit), indent=2))
    else:
        print(report.text(args.limit))
    return 1 if report.changed else 0
