"""`toolgate policy check|push|rollback|test`.

check validates a bundle directory here and prints its version; push
validates it the same way, signs it with the operator's policy-signing key
(DATA_DIR/keys/policy-signing.key, created on first push) as the next version
number (one more than any in the bucket's history and than the one the policy
service last accepted), then stores it as the active bundle, which every
policy replica verifies and loads within a moment. Should the bucket change
between reading it and writing (another push), push refuses (exit 1) rather
than write a version that is not the newest. rollback VERSION takes that
version's content from the bucket's history and pushes it again, signed as a
new, higher version. Validation is against the bundle's schema and the tool
registry (--registry, else $TOOLGATE_REGISTRY, else what `toolgate up` recorded
in DATA_DIR, else the built-in tools): a rule that reads an argument no tool in
its scope takes is refused (services/policy/argument_names.py). A bundle that
fails validation is never pushed: the command prints each problem in one line
(file:line:column and reason) and exits 2; a bus it cannot reach or write to gets
one line and exit 3. push finds NATS the way every command does (flags,
TOOLGATE_* variables, else what `toolgate up` recorded, as admin). test
checks the bundle the same way, replays the decisions recorded in the audit
store under it, with the same registry, and prints
which would change (exit 0: none, 1: some, 2: bad input or configuration: the
bundle, the registry, --since, the ClickHouse URL or database; 3: no ClickHouse
answered), every failure in one line; it finds the audit as `toolgate audit`
does and shows its progress on stderr when it takes a while.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from toolgate.cli.audit import (
    Failed,
    OneLineParser,
    add_store_options,
    fails_in_one_line,
    since_of,
    store_of,
)
from toolgate.contracts.registry import RegistryError
from toolgate.runtime.creds import CredentialsError
from toolgate.runtime.outside_text import visible
from toolgate.runtime.settings import (
    CONTEXT_FILE,
    GatewaySettings,
    env_data_dir,
    env_nats_creds,
    env_nats_url,
    env_registry_dirs,
    read_context,
    recorded_registry,
)

# nats-py, cryptography and the policy service (cedarpy, httpx) are imported by the
# commands that use them: every `toolgate` command builds this group's parser.
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
    from nats.aio.client import Client as NATS

    from toolgate.contracts.registry import Registry
    from toolgate.services.policy.engine import CedarEngine
    from toolgate.services.policy.pushing import BucketState
    from toolgate.services.policy.signing import StoredBundle

DEFAULT_CONNECT_TIMEOUT_S = 5.0


def register(subparsers: argparse._SubParsersAction) -> None:
    policy = subparsers.add_parser("policy", help="check or push a Cedar policy bundle")
    commands = policy.add_subparsers(
        dest="policy_command", required=True, parser_class=OneLineParser
    )
    check = commands.add_parser(
        "check",
        help="validate a bundle directory against the schema and the tool registry, print "
        "its version",
    )
    check.add_argument("directory", type=Path)
    check.add_argument(
        "--data-dir",
        type=Path,
        default=env_data_dir(),
        help="whose recorded registry to check against (default: $TOOLGATE_DATA_DIR or .toolgate)",
    )
    add_registry_options(check)
    check.set_defaults(func=cmd_check)
    push = commands.add_parser("push", help="validate a bundle and make it active everywhere")
    push.add_argument("directory", type=Path)
    _add_bus_options(push)
    add_registry_options(push)
    push.set_defaults(func=cmd_push)
    rollback = commands.add_parser(
        "rollback", help="make an earlier version's content active again, as a new version"
    )
    rollback.add_argument("version", type=int, help="the version number to take the content of")
    _add_bus_options(rollback)
    rollback.set_defaults(func=cmd_rollback)
    test = commands.add_parser("test", help="which recorded decisions a bundle would change")
    test.add_argument("directory", type=Path)
    test.add_argument(
        "--since",
        default="24h",
        help="decisions since then: 90s, 30m, 24h, 7d or an ISO 8601 time "
        "(UTC unless it says; default: %(default)s)",
    )
    test.add_argument(
        "--data-dir",
        type=Path,
        default=env_data_dir(),
        help="whose recorded registry and audit to use (default: $TOOLGATE_DATA_DIR or .toolgate)",
    )
    add_registry_options(test)
    test.add_argument("--limit", type=int, default=5, help="example call_ids per kind")
    test.add_argument("--format", choices=("text", "json"), default="text")
    add_store_options(test)
    test.set_defaults(func=cmd_test)


def _add_bus_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        default=env_nats_url(),
        help="NATS server URL (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded; now %(default)s)",
    )
    parser.add_argument(
        "--creds",
        type=Path,
        default=env_nats_creds("admin"),
        help="NATS creds file (default: $TOOLGATE_NATS_CREDS, else the admin "
        "creds `toolgate up` recorded; now %(default)s)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=env_data_dir(),
        help="where keys/policy-signing.key is kept (default: $TOOLGATE_DATA_DIR or .toolgate)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for NATS before giving up (default %(default)s)",
    )


def add_registry_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--registry",
        type=Path,
        action="append",
        default=None,
        help="tool registry directory beside the built-in tools, repeatable (default: "
        "$TOOLGATE_REGISTRY, else the registry `toolgate up` recorded in DATA_DIR, else "
        "the built-in tools)",
    )
    parser.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="the --registry directories without the built-in tools (as `toolgate up "
        "--no-builtin-tools`)",
    )


def registry_of(args: argparse.Namespace) -> tuple[Registry, str]:
    """The registry a bundle is checked or replayed against, and where it came from:
    --registry, else $TOOLGATE_REGISTRY, else what `toolgate up` recorded in DATA_DIR
    (its directories, with or without the built-in tools), else the built-in tools.
    Failed (exit 2) if it does not load."""
    if args.registry:
        dirs, builtin, source = list(args.registry), True, "--registry"
    else:
        dirs, builtin = recorded_registry(args.data_dir)
        context = (args.data_dir / CONTEXT_FILE).absolute()
        source = (
            "$TOOLGATE_REGISTRY"
            if env_registry_dirs()
            else f"the registry `toolgate up` recorded in {context}"
            if read_context(args.data_dir)
            else f"the built-in tools (no --registry, nothing recorded in {context})"
        )
    builtin = builtin and not args.no_builtin_tools
    try:
        registry = GatewaySettings(registry_dirs=tuple(dirs), builtin_tools=builtin).load_registry()
    except RegistryError as exc:
        raise Failed(f"tool registry: {exc} ({source})") from None
    return registry, source


def checked_engine(
    directory: Path, registry: Registry, command: str = "check", source: str | None = None
) -> tuple[dict[str, str], CedarEngine] | None:
    """The bundle's files and engine, or None once each problem is printed (file:line:
    column and the reason, one line each): Cedar's, then each argument a policy reads that
    no tool it applies to takes. A policy that reads arguments of no tool of the registry
    (`source` says which) is named on stderr: its names were not checked."""
    from toolgate.services.policy.argument_names import unchecked_policies, unknown_arguments
    from toolgate.services.policy.bundle import BundleError, read_bundle_dir
    from toolgate.services.policy.engine import engine_from_files

    try:
        files = read_bundle_dir(directory)
        engine = engine_from_files(files)
        unknown = unknown_arguments(files, registry)
        if unknown:
            raise BundleError("\n".join(map(str, unknown)))
    except BundleError as exc:
        for problem in str(exc).splitlines() or ["?"]:
            print(
                f"toolgate policy {command}: bundle {directory} rejected: {problem}",
                file=sys.stderr,
            )
        return None
    for file, policy_id in unchecked_policies(files, registry):
        print(
            f"toolgate policy {command}: note: {file}: policy {policy_id!r} reads arguments "
            f"of no tool in {source or 'the registry'}, so their names were not checked "
            "(run it where `toolgate up` ran, or give --data-dir or --registry)",
            file=sys.stderr,
        )
    return files, engine


@fails_in_one_line("toolgate policy check")
def cmd_check(args: argparse.Namespace) -> int:
    registry, source = registry_of(args)
    checked = checked_engine(args.directory, registry, source=source)
    if checked is None:
        return 2
    _, engine = checked
    print(
        f"{engine.version}  {len(engine.bundle.policies)} policies: "
        + ", ".join(engine.bundle.policies)
    )
    return 0


class PushFailed(Exception):
    """The bus could not be reached or written to; the message is one line."""


async def connect_bus(
    nats_url: str, creds: Path | None = None, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S
) -> NATS:
    """One connection, within `connect_timeout` or PushFailed (nats-py alone would retry
    the first connect for ever, printing a traceback each time)."""
    import nats
    import nats.errors

    from toolgate.cli.common import connect_failure
    from toolgate.runtime.creds import connect_options
    from toolgate.services.audit.connection import BAD_CONFIG

    errors: list[Exception] = []

    async def remember(exc: Exception) -> None:
        errors.append(exc)

    options: dict[str, Any] = {
        "connect_timeout": connect_timeout,
        "allow_reconnect": False,
        "error_cb": remember,
        **connect_options(creds),
    }
    try:
        return await asyncio.wait_for(nats.connect(nats_url, **options), connect_timeout)
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        said = connect_failure(nats_url, errors[-1] if errors else exc)
        if said.code == BAD_CONFIG:  # refused at the default URL, nothing recorded here
            raise Failed(str(said), said.code) from None
        raise PushFailed(
            f"cannot connect to NATS at {nats_url}"
            + (f" as {creds}" if creds else "")
            + f": {_reason(errors[-1] if errors else exc)}"
        ) from None


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class PushRefused(Exception):
    """Nothing was pushed, for a reason that is not the bus's (exit 1); one line."""


async def push_versioned(
    args: argparse.Namespace, make: Callable[[BucketState, Ed25519PublicKey], Pushing]
) -> tuple[int, StoredBundle, Pushing, bool]:
    """Connect, read the bucket, sign what `make` says as the next version, write it:
    (revision, bundle, what, key created now)."""
    import nats.errors
    from nats.js.errors import Error as JetStreamError
    from nats.js.errors import KeyWrongLastSequenceError

    from toolgate.services.policy.bundle_store import ACTIVE_KEY, POLICIES_BUCKET
    from toolgate.services.policy.pushing import push_next_version, read_state
    from toolgate.services.policy.signing import ensure_signing_key

    keys_dir = Path(args.data_dir) / "keys"
    nc = await connect_bus(args.nats_url, args.creds, args.connect_timeout)
    try:
        try:
            state = await read_state(nc.jetstream())
        except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
            raise PushFailed(_bus_refused("read", nc, exc)) from None
        # Created only once a bus answers: a mistyped URL leaves no key behind.
        private_key, created = ensure_signing_key(keys_dir)
        what = make(state, private_key.public_key())
        try:
            revision, bundle = await push_next_version(state, what.files, what.source, private_key)
        except KeyWrongLastSequenceError:
            raise PushRefused(
                f"{POLICIES_BUCKET}/{ACTIVE_KEY} changed while this command read it (another "
                "push?): nothing written; run it again to push on top of the newest"
            ) from None
        except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
            raise PushFailed(_bus_refused("store the bundle in", nc, exc)) from None
        return revision, bundle, what, created
    finally:
        await nc.close()


@dataclass(frozen=True)
class Pushing:
    files: dict[str, str]
    source: str
    of_version: int = 0  # a rollback: the version whose content this is


def _bus_refused(what: str, nc: NATS, exc: BaseException) -> str:
    from toolgate.services.policy.bundle_store import POLICIES_BUCKET

    return (
        f"cannot {what} {POLICIES_BUCKET} at "
        f"{nc.connected_url.netloc if nc.connected_url else '?'}: "
        f"{_reason(exc)} (pushing takes the operator's admin creds)"
    )


def _run_push(
    command: str, args: argparse.Namespace, make: Callable[[BucketState, Ed25519PublicKey], Pushing]
) -> tuple[int, StoredBundle, Pushing] | int:
    """push_versioned as a command: its result, or the exit status after one line."""
    from toolgate.services.policy.signing import PRIVATE_KEY_FILE

    keys_dir = Path(args.data_dir) / "keys"
    try:
        revision, bundle, what, created = asyncio.run(push_versioned(args, make))
    except (PushFailed, CredentialsError) as exc:
        print(f"toolgate policy {command}: {exc}", file=sys.stderr)
        return 3
    except PushRefused as exc:
        print(f"toolgate policy {command}: {exc}", file=sys.stderr)
        return 1
    except Failed as exc:
        print(f"toolgate policy {command}: {exc}", file=sys.stderr)
        return exc.exit_code
    except (OSError, ValueError) as exc:
        print(
            f"toolgate policy {command}: the policy-signing key in {keys_dir}: {_reason(exc)}",
            file=sys.stderr,
        )
        return 2
    if created:
        print(
            f"created the policy-signing key {keys_dir / PRIVATE_KEY_FILE} (keep it secret; "
            "policy replicas trust its .pub)",
            file=sys.stderr,
        )
    return revision, bundle, what


def cmd_push(args: argparse.Namespace) -> int:
    from toolgate.services.policy import versions
    from toolgate.services.policy.bundle_store import ACTIVE_KEY, POLICIES_BUCKET

    try:
        registry, source = registry_of(args)
    except Failed as exc:
        print(f"toolgate policy push: {exc}", file=sys.stderr)
        return 2
    checked = checked_engine(args.directory, registry, "push", source)
    if checked is None:
        return 2
    files, engine = checked
    source = versions.PUSHED_FROM.format(directory=Path(args.directory).resolve())
    done = _run_push("push", args, lambda _state, _key: Pushing(files, source))
    if isinstance(done, int):
        return done
    revision, bundle, _ = done
    print(
        f"pushed policy bundle {engine.version} as version {bundle.number} to "
        f"{POLICIES_BUCKET}/{ACTIVE_KEY} (revision {revision}, signed by key {bundle.key_id})"
    )
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from toolgate.services.policy import versions
    from toolgate.services.policy.bundle import BundleError, bundle_version
    from toolgate.services.policy.bundle_store import (
        ACTIVE_KEY,
        POLICIES_BUCKET,
        policies_bucket_config,
    )
    from toolgate.services.policy.engine import engine_from_files

    wanted = args.version
    if wanted < 1:
        print(
            f"toolgate policy rollback: {wanted}: give a pushed version number (1 or more)",
            file=sys.stderr,
        )
        return 2

    def content_of(state: BucketState, public_key: Ed25519PublicKey) -> Pushing:
        found = versions.find_version(state.written, wanted, public_key)
        if found is None:
            kept = sorted(
                {stored.number for _, stored in versions.verified(state.written, public_key)}
            )
            raise Failed(
                f"no version {wanted} signed by this data dir's key in the history of "
                f"{POLICIES_BUCKET}/{ACTIVE_KEY} (it keeps the last "
                f"{policies_bucket_config().history} writes; versions there: "
                f"{', '.join(map(str, kept)) or 'none'})",
                1,
            )
        try:
            engine_from_files(found.files)
        except BundleError as exc:
            problems = str(exc).splitlines() or ["?"]
            raise Failed(f"version {wanted} does not load any more: {problems[0]}", 1) from None
        return Pushing(found.files, versions.ROLLBACK.format(number=wanted), wanted)

    done = _run_push("rollback", args, content_of)
    if isinstance(done, int):
        return done
    revision, bundle, what = done
    print(
        f"version {bundle.number} (content of {what.of_version}) active: "
        f"{POLICIES_BUCKET}/{ACTIVE_KEY} revision {revision}, bundle "
        f"{bundle_version(bundle.files)}, signed by key {bundle.key_id}"
    )
    return 0


@fails_in_one_line("toolgate policy test")
def cmd_test(args: argparse.Namespace) -> int:
    from toolgate.cli.policy_history import evaluate_history, read_recorded
    from toolgate.services.audit.progress import Progress
    from toolgate.services.policy.argument_names import unknown_arguments
    from toolgate.services.policy.bundle import BundleError, read_bundle_dir
    from toolgate.services.policy.engine import engine_from_files

    since = since_of(args.since)
    assert since is not None  # --since has a default
    if args.limit < 0:
        raise Failed(f"--limit {args.limit}: give 0 or more")
    if not args.connect_timeout > 0:
        raise Failed(f"--connect-timeout {args.connect_timeout:g}: give a number of seconds > 0")
    registry, _ = registry_of(args)
    try:
        files = read_bundle_dir(args.directory)
        engine = engine_from_files(files)
        unknown = unknown_arguments(files, registry)  # as check and push refuse them
        if unknown:
            raise BundleError("\n".join(map(str, unknown)))
    except BundleError as exc:
        problems = str(exc).splitlines() or ["?"]
        raise Failed(
            f"policy bundle {args.directory} rejected ({len(problems)} problem(s), "
            f"first: {problems[0]}): `toolgate policy check {args.directory}` lists "
            "them"
        ) from None
    store = store_of(args.clickhouse_url, args.data_dir)
    client = store.open(args.connect_timeout)
    with store.errors():
        recorded = read_recorded(client, since)
    progress = Progress("toolgate policy test", "decisions replayed", len(recorded))
    report = evaluate_history(engine.bundle, registry, recorded, since, progress)
    progress.finish()
    if args.format == "json":
        print(json.dumps(report.to_json(args.limit), indent=2))
    else:
        print(visible(report.text(args.limit), keep_newlines=True))  # names from the audit
    return 1 if report.changed else 0
