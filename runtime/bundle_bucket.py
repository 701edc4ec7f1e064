"""A signed bundle's bucket: the active key every reader watches, and a high-water mark.

An operator's push (`toolgate policy push`, `toolgate tools push`) puts all of a
bundle's files under one key (`active`) of a JetStream KV bucket; every reader
watches that key and hands each new revision to its service, which verifies the
signature and the content before it swaps what it uses (runtime/signed_bundles.py).
This module only moves bytes: it never decides whether a value may be used. The
bucket keeps a short history, so an operator can see what was active before.

The high-water mark, the last bundle accepted, lives in a bucket of its own that
only the accepting role writes, so a writer of the active key cannot make an older
bundle active again while the readers are down.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NoKeysError,
    NotFoundError,
)
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from toolgate.runtime.signed_bundles import StoredBundle

log = logging.getLogger("toolgate.bundles")

ACTIVE_KEY = "active"
ACCEPTED_KEY = "bundle"
REWATCH_DELAY_S = 1.0
REFRESH_S = 30.0


@dataclass(frozen=True)
class ActiveEntry:
    """One revision of the active key, as stored (not yet verified)."""

    revision: int
    value: bytes | None
    deleted: bool = False


async def open_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """The bucket, created if missing (idempotent: every replica and the CLI call it)."""
    try:
        return await js.key_value(config.bucket)
    except (NotFoundError, BadRequestError):
        try:
            return await js.create_key_value(config)
        except BadRequestError:  # another process created it meanwhile
            return await js.key_value(config.bucket)


async def push_bundle(kv: KeyValue, bundle: StoredBundle, last_revision: int | None = None) -> int:
    """Store `bundle` as the active one; its revision. With `last_revision`, only if the
    key's newest revision is still that one (0: the key was never written), else
    KeyWrongLastSequenceError: someone wrote it meanwhile."""
    value = msgspec.json.encode(bundle)
    if last_revision is None:
        return await kv.put(ACTIVE_KEY, value)
    return await kv.update(ACTIVE_KEY, value, last=last_revision)


async def active_history(kv: KeyValue) -> list[ActiveEntry]:
    """Every revision of the active key the bucket still keeps, oldest first."""
    try:
        entries = await kv.history(ACTIVE_KEY)
    except NoKeysError:
        return []
    return [
        ActiveEntry(
            revision=entry.revision or 0,
            value=entry.value,
            deleted=entry.operation in (KV_DEL, KV_PURGE),
        )
        for entry in entries
    ]


async def fetch_accepted(kv: KeyValue) -> bytes | None:
    """The policy service's record of the last bundle it accepted; None: none yet."""
    try:
        entry = await kv.get(ACCEPTED_KEY)
    except KeyNotFoundError:
        return None
    return entry.value


async def record_accepted(kv: KeyValue, bundle: StoredBundle) -> None:
    """Raise the high-water mark to `bundle` unless it is as high already (replicas race:
    a compare-and-set, so the mark never goes down)."""
    value = msgspec.json.encode(bundle)
    for _ in range(10):
        try:
            entry = await kv.get(ACCEPTED_KEY)
        except KeyNotFoundError as missing:
            last = missing.entry.revision if missing.entry is not None else 0
        else:
            try:
                current = msgspec.json.decode(entry.value or b"", type=StoredBundle)
            except (msgspec.DecodeError, RecursionError):
                current = None  # unreadable: replaced by a good record
            if current is not None and current.number >= bundle.number:
                return
            last = entry.revision
        try:
            await kv.update(ACCEPTED_KEY, value, last=last or 0)
            return
        except KeyWrongLastSequenceError:
            continue  # another replica recorded meanwhile: look again
    raise RuntimeError("the accepted-bundle record kept changing under this replica")


async def fetch_active(kv: KeyValue) -> ActiveEntry | None:
    """The active key's latest revision; None if nothing was ever pushed.

    A deleted or purged key is an entry with `deleted` set: it is not "never
    pushed", and the service must not take it for a reason to fall back.
    """
    try:
        entry = await kv.get(ACTIVE_KEY)
    except KeyNotFoundError as missing:
        if missing.entry is None:
            return None
        return ActiveEntry(revision=missing.entry.revision or 0, value=None, deleted=True)
    return ActiveEntry(revision=entry.revision or 0, value=entry.value)


async def watch_active(
    kv: KeyValue, on_entry: Callable[[ActiveEntry], Awaitable[None]], what: str = "bundle"
) -> None:
    """Call `on_entry` with each revision of the active key, until cancelled.

    Also re-reads the key every REFRESH_S without news: should the watch
    die silently (a server restart, say), a replica is stale for at most that
    long. `on_entry` sees a revision more than once and must ignore those it
    has already judged.
    """
    while True:
        watcher = None
        try:
            watcher = await kv.watch(ACTIVE_KEY)
            while True:
                found: ActiveEntry | None
                try:
                    entry = await watcher.updates(timeout=REFRESH_S)  # type: ignore[no-untyped-call]
                except nats.errors.TimeoutError:
                    found = await fetch_active(kv)
                else:
                    # None ends the initial values.
                    found = (
                        None
                        if entry is None
                        else ActiveEntry(
                            revision=entry.revision or 0,
                            value=entry.value,
                            deleted=entry.operation in (KV_DEL, KV_PURGE),
                        )
                    )
                if found is not None:
                    await on_entry(found)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s watch failed, watching again: %r", what, exc)
        finally:
            if watcher is not None:
                try:
                    await watcher.stop()  # type: ignore[no-untyped-call]
                except Exception as exc:  # the connection may be gone already
                    log.debug("stopping the bundle watcher: %r", exc)
        await asyncio.sleep(REWATCH_DELAY_S)


class BundleUnreadable(RuntimeError):
    """The active key or the high-water mark could not be read: a service refuses to
    start on that, never takes it for "nothing pushed"."""


class Following:
    """A bucket's active key, followed by a running service (`follow`): a watch task."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task: asyncio.Task[None] | None = task

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


async def follow(
    js: JetStreamContext,
    active: KeyValueConfig,
    accepted: KeyValueConfig,
    begin: Callable[[ActiveEntry | None, bytes | None, KeyValue], Awaitable[None]],
    on_entry: Callable[[ActiveEntry], Awaitable[None]],
    what: str,
) -> Following:
    """How a service follows a signed bundle (the policy service's, the served registry):
    read the active key and the high-water mark, `begin(entry, accepted, accepted_kv)`
    (the service takes what to serve, and records it), then hand each later revision to
    `on_entry` until stopped (`watch_active`).

    BundleUnreadable if either bucket cannot be read; whatever `begin` raises (the
    service refuses to start) is raised before anything is watched.
    """
    try:
        kv = await open_bucket(js, active)
        entry = await fetch_active(kv)
        accepted_kv = await open_bucket(js, accepted)
        accepted_value = await fetch_accepted(accepted_kv)
    except Exception as exc:  # unreadable is refused too, never read as "none"
        raise BundleUnreadable(
            f"cannot read {active.bucket}/{ACTIVE_KEY} or {accepted.bucket}: {exc!r}"
        ) from exc
    await begin(entry, accepted_value, accepted_kv)
    return Following(asyncio.create_task(watch_active(kv, on_entry, what), name=f"watch-{what}"))
