"""`toolgate tools push|list`: the tool registry the gateway serves.

toolgate tools push DIR     validate DIR's tool files (*.yaml, as a --registry DIR holds
                            them) with the built-in tools the gateway serves, sign them with
                            the operator's registry-signing key (DATA_DIR/keys/registry-
                            signing.key, created on first push) as the next version number,
                            and store them as the active registry: every service and the MCP
                            front door move to it within a moment, without a restart
                            (runtime/served_registry.py). Forward only, like policy bundles.
toolgate tools list         what is served: version, who pushed it and when, the tools.

Exit codes: 0 done; 1 nothing pushed (the bucket changed meanwhile); 2 bad input (the
directory, a tool file, the key); 3 NATS could not be reached or written to.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import json
import os
import sys
from pathlib import Path
from typing import Any

import nats.errors
from nats.js.errors import Error as JetStreamError
from nats.js.errors import KeyWrongLastSequenceError

from toolgate.cli.audit import Failed, fails_in_one_line
from toolgate.contracts import subjects
from toolgate.contracts.registry import Registry, RegistryError
from toolgate.contracts.registry_bundle import (
    MAX_BUNDLE_BYTES,
    read_registry_dir,
    registry_from_files,
)
from toolgate.runtime import bundle_versions
from toolgate.runtime.bundle_bucket import ACTIVE_KEY, fetch_active
from toolgate.runtime.outside_text import visible
from toolgate.runtime.served_registry import PUSHED_FROM, REGISTRY_BUNDLE, served_bundle
from toolgate.runtime.settings import env_data_dir, env_nats_creds, env_nats_url, recorded_registry
from toolgate.runtime.signed_bundles import (
    BundleRefused,
    StoredBundle,
    ensure_signing_key,
    load_verify_key,
)
from toolgate.runtime.topology import registry_accepted_bucket_config, registry_bucket_config

UNREACHABLE = 3
DEFAULT_CONNECT_TIMEOUT_S = 5.0


def register(actions: Any) -> None:
    """`push` and `list` under `toolgate tools`."""
    push = actions.add_parser(
        "push", help="sign a registry directory and serve it everywhere, without a restart"
    )
    push.add_argument("directory", type=Path, help="the tool files (*.yaml) to serve")
    push.add_argument(
        "--by", default=None, help="who pushes, for the record (default: the login name)"
    )
    push.add_argument(
        "--no-builtin-tools",
        action="store_true",
        help="check it as served without the built-in tools (default: as `toolgate up` recorded)",
    )
    _add_bus_options(push)
    push.set_defaults(func=cmd_push)
    listing = actions.add_parser("list", help="the registry the gateway serves: version, tools")
    listing.add_argument("--format", choices=("text", "json"), default="text")
    _add_bus_options(listing)
    listing.set_defaults(func=cmd_list)


def _add_bus_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        default=env_nats_url(),
        help="NATS server URL (default: $TOOLGATE_NATS_URL, else the one `toolgate up` "
        "recorded; now %(default)s)",
    )
    parser.add_argument(
        "--creds",
        type=Path,
        default=env_nats_creds("admin"),
        help="NATS creds file (default: $TOOLGATE_NATS_CREDS, else the admin creds "
        "`toolgate up` recorded; now %(default)s)",
    )
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=env_data_dir(),
        help="where keys/registry-signing.key is kept (default: $TOOLGATE_DATA_DIR or .toolgate)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT_S,
        help="seconds to wait for NATS before giving up (default %(default)s)",
    )


def checked_registry(args: argparse.Namespace) -> tuple[dict[str, str], Registry]:
    """DIR's files and the registry the services would build of them (Failed, exit 2)."""
    builtin = recorded_registry(args.data_dir)[1] and not args.no_builtin_tools
    try:
        files = read_registry_dir(args.directory)
        registry = registry_from_files(files, builtin)
    except (RegistryError, OSError) as exc:
        raise Failed(f"registry {args.directory} refused: {exc}") from None
    if sum(len(text.encode()) for text in files.values()) > MAX_BUNDLE_BYTES:
        raise Failed(f"registry {args.directory} is larger than {MAX_BUNDLE_BYTES} bytes")
    from toolgate.services.executor.logic import resolve_function

    # Imported as the services import it: they run as `python -m` in the folder where
    # `toolgate up` ran, so a module saved there (the README's my_tools.py) is found;
    # the `toolgate` script has only its own bin folder on sys.path.
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        for spec in registry:
            if spec.function is not None:
                try:
                    resolve_function(spec)
                except Exception as exc:
                    raise Failed(
                        f"registry {args.directory} refused: tool {spec.name}: function "
                        f"{spec.function} cannot be imported here (from {here} or the "
                        f"installed packages): {exc}"
                    ) from None
    finally:
        if added:
            sys.path.remove(here)
    return files, registry


def grant_executor(data_dir: Path, names: list[str]) -> None:
    """On a locked bus: the executor's creds grant the pushed tools' durables (re-issued
    now, read by the connection it opens for them); nothing to do on an open bus."""
    from toolgate.stack import nats_auth

    if not (Path(data_dir) / nats_auth.CREDS_DIR / "executor.creds").exists():
        return
    dirs, builtin = recorded_registry(data_dir)
    local = Registry({})
    try:
        from toolgate.contracts.registry import load_registry, tool_dirs

        local = load_registry(*tool_dirs(dirs, builtin))
    except RegistryError:
        pass  # the local registry is the gateway's business; the pushed names suffice
    nats_auth.record_pushed_tools(data_dir, names)
    nats_auth.create_credentials(data_dir, tools=local.names())


async def _push(args: argparse.Namespace, files: dict[str, str], version: str) -> tuple[int, Any]:
    from toolgate.cli.policy import PushFailed, connect_bus

    nc = await connect_bus(args.nats_url, args.creds, args.connect_timeout)
    try:
        js = nc.jetstream()
        try:
            state = await bundle_versions.read_state(
                js, registry_bucket_config(), registry_accepted_bucket_config()
            )
        except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
            raise PushFailed(f"cannot read {subjects.REGISTRY_BUCKET}: {exc!r}") from None
        try:
            private_key, created = ensure_signing_key(REGISTRY_BUNDLE, Path(args.data_dir) / "keys")
        except (OSError, ValueError) as exc:
            raise Failed(f"the registry-signing key in {args.data_dir}/keys: {exc}") from None
        if created:
            print(
                f"created the registry-signing key {args.data_dir}/keys/"
                f"{REGISTRY_BUNDLE.private_key_file} (keep it secret; services trust its .pub)",
                file=sys.stderr,
            )
        who = args.by or getpass.getuser()
        source = PUSHED_FROM.format(directory=args.directory_resolved, who=who)
        try:
            return await bundle_versions.push_next_version(
                REGISTRY_BUNDLE, state, files, version, source, private_key
            )
        except KeyWrongLastSequenceError:
            raise Failed(
                f"{subjects.REGISTRY_BUCKET}/{ACTIVE_KEY} changed while this command read it "
                "(another push?): nothing written; run it again to push on top of the newest",
                1,
            ) from None
        except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
            raise PushFailed(
                f"cannot store the registry in {subjects.REGISTRY_BUCKET}: {exc!r}"
            ) from None
    finally:
        await nc.close()


@fails_in_one_line("toolgate tools push")
def cmd_push(args: argparse.Namespace) -> int:
    from toolgate.cli.policy import PushFailed

    files, registry = checked_registry(args)
    args.directory_resolved = Path(args.directory).resolve()
    grant_executor(args.data_dir, registry.names())
    try:
        revision, bundle = asyncio.run(_push(args, files, registry.version))
    except PushFailed as exc:
        raise Failed(str(exc), UNREACHABLE) from None
    print(
        f"pushed registry {registry.version} ({len(registry)} tools) as version "
        f"{bundle.number} to {subjects.REGISTRY_BUCKET}/{ACTIVE_KEY} (revision {revision}, "
        f"signed by key {bundle.key_id}): services serve it within a moment"
    )
    return 0


async def _read(args: argparse.Namespace) -> tuple[Any, StoredBundle | None]:
    from toolgate.cli.policy import PushFailed, connect_bus

    nc = await connect_bus(args.nats_url, args.creds, args.connect_timeout)
    try:
        state = await bundle_versions.read_state(
            nc.jetstream(), registry_bucket_config(), registry_accepted_bucket_config()
        )
        return await fetch_active(state.kv), state.accepted
    except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
        raise PushFailed(f"cannot read {subjects.REGISTRY_BUCKET}: {exc!r}") from None
    finally:
        await nc.close()


@fails_in_one_line("toolgate tools list")
def cmd_list(args: argparse.Namespace) -> int:
    from toolgate.cli.policy import PushFailed

    try:
        entry, accepted = asyncio.run(_read(args))
    except PushFailed as exc:
        raise Failed(str(exc), UNREACHABLE) from None
    dirs, builtin = recorded_registry(args.data_dir)
    keys_dir = Path(args.data_dir) / "keys"
    try:
        public_key = load_verify_key(REGISTRY_BUNDLE, keys_dir)
    except BundleRefused as exc:
        stored, refused = (accepted, str(exc)) if entry is not None else (None, None)
    else:
        stored, refused = served_bundle(entry, accepted, public_key)
    try:
        if stored is not None:
            registry = registry_from_files(stored.files, builtin)
        else:
            from toolgate.contracts.registry import load_registry, tool_dirs

            registry = load_registry(*tool_dirs(dirs, builtin))
    except RegistryError as exc:
        raise Failed(f"the served registry does not load here: {exc}", 1) from None
    report = listing_report(registry, stored, refused)
    if args.format == "json":
        print(json.dumps(report, indent=2))
        return 0
    print(visible(listing_text(report), keep_newlines=True))
    return 0


def listing_report(
    registry: Registry, stored: StoredBundle | None, refused: str | None
) -> dict[str, Any]:
    """What `tools list` shows, as data (pure)."""
    return {
        "version": stored.number if stored is not None else 0,
        "registry": registry.version,
        "source": stored.source if stored is not None else "local: nothing pushed yet",
        "signed_at": stored.signed_at if stored is not None else None,
        "key_id": stored.key_id if stored is not None else None,
        "newest_write_refused": refused,
        "tools": [
            {
                "name": spec.name,
                "risk": spec.risk,
                "read_only": spec.read_only,
                "requires_approval": spec.requires_approval,
                "allowed_agents": list(spec.allowed_agents),
                "kind": "mcp" if spec.mcp else "http" if spec.http else "function",
            }
            for spec in registry
        ],
    }


def listing_text(report: dict[str, Any]) -> str:
    lines = [
        f"version {report['version']} ({report['source']}"
        + (
            f", signed at {report['signed_at']} by key {report['key_id']}"
            if report["key_id"]
            else ""
        )
        + f"), registry {report['registry']}, {len(report['tools'])} tools"
    ]
    if report["newest_write_refused"]:
        lines.append(f"the bucket's newest write is refused: {report['newest_write_refused']}")
    width = max((len(tool["name"]) for tool in report["tools"]), default=4)
    for tool in sorted(report["tools"], key=lambda t: t["name"]):
        flags = [tool["kind"], tool["risk"]]
        if tool["read_only"]:
            flags.append("read-only")
        if tool["requires_approval"]:
            flags.append("approval")
        agents = ",".join(tool["allowed_agents"])
        lines.append(f"  {tool['name']:<{width}}  {' '.join(flags)}  agents: {agents}")
    return "\n".join(lines)


class AcceptanceNotRecorded(Exception):
    """The audit did not take a pin acceptance (exit 3); the message is one line."""


def record_acceptance(
    data_dir: Path,
    name: str,
    upstream: Any,
    accepted_sha256: str,
    who: str,
    changed: list[str],
    path: Path,
    stamp: str,
) -> str:
    """Publish `toolgate tools accept`'s PinAccepted event on the gateway's events stream
    (as the operator), whence the audit writes it to ClickHouse; where it went.
    AcceptanceNotRecorded if no gateway of this data dir answers (then nothing is pinned)."""
    import os
    from datetime import UTC, datetime

    from toolgate.cli.policy import PushFailed, connect_bus
    from toolgate.contracts.events import PinAccepted, derive_event_id, encode_event
    from toolgate.runtime.settings import read_context

    context = read_context(data_dir)
    url = os.environ.get("TOOLGATE_NATS_URL") or context.get("nats_url")
    creds = os.environ.get("TOOLGATE_NATS_CREDS") or (context.get("creds") or {}).get("admin")
    if not url:
        raise AcceptanceNotRecorded(
            f"cannot record the acceptance in the audit: no gateway recorded in {data_dir} "
            "(run it beside `toolgate up`, or set $TOOLGATE_NATS_URL): nothing pinned"
        )
    event = PinAccepted(
        event_id=derive_event_id(f"{name}:{upstream.definition_sha256}:{accepted_sha256}", stamp),
        call_id="",
        occurred_at=datetime.now(UTC),
        service="operator",
        tool=name,
        approver=who,
        server=upstream.server,
        upstream_tool=upstream.tool,
        previous_sha256=upstream.definition_sha256,
        accepted_sha256=accepted_sha256,
        fields_updated=changed,
        file=str(path),
    )

    async def publish() -> None:
        nc = await connect_bus(url, Path(creds) if creds else None, DEFAULT_CONNECT_TIMEOUT_S)
        try:
            await nc.jetstream().publish(
                subjects.subject_of(event),
                encode_event(event),
                stream=subjects.EVENTS_STREAM,
                headers={"Nats-Msg-Id": event.event_id},
            )
        finally:
            await nc.close()

    try:
        asyncio.run(publish())
    except (PushFailed, TimeoutError, nats.errors.Error, JetStreamError) as exc:
        raise AcceptanceNotRecorded(
            f"cannot record the acceptance in the audit: {exc}: nothing pinned"
        ) from None
    return f"the audit (event PinAccepted {event.event_id} on {subjects.EVENTS_STREAM})"
