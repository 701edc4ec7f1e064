"""`toolgate policy check DIR` and `toolgate policy push DIR`.

check validates a bundle directory here and prints its version; push
validates it the same way, then stores it as the active bundle, which every
policy replica loads within a moment. A bundle that fails validation is
never pushed: the command prints file, line and reason and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import nats

from toolgate.services.policy.bundle import BundleError, read_bundle_dir
from toolgate.services.policy.bundle_store import (
    ACTIVE_KEY,
    POLICIES_BUCKET,
    open_bucket,
    policies_bucket_config,
    push_bundle,
)
from toolgate.services.policy.engine import CedarEngine, engine_from_files
from toolgate.services.settings import env_nats_url


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
