"""The active policy bundle in a JetStream KV bucket, watched by every policy replica.

`toolgate policy push DIR` validates and signs a bundle and puts all its
files under one key; each replica watches that key and hands every new
revision to the service, which verifies the signature and the bundle before
it swaps its engine (services/policy/signing.py, app.py). This module only
moves bytes: it never decides whether a value may be used. The bucket keeps
a short history, so an operator can see what was active before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from toolgate.contracts import subjects
from toolgate.runtime.topology import policies_bucket_config

__all__ = ["policies_bucket_config"]
from toolgate.services.policy.signing import StoredBundle

log = logging.getLogger("toolgate.policy")

POLICIES_BUCKET = subjects.POLICIES_BUCKET
ACTIVE_KEY = "active"
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


async def push_bundle(kv: KeyValue, bundle: StoredBundle) -> int:
    return await kv.put(ACTIVE_KEY, msgspec.json.encode(bundle))


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


async def watch_active(kv: KeyValue, on_entry: Callable[[ActiveEntry], None]) -> None:
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
                    entry = await watcher.updates(timeout=REFRESH_S)
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
                    on_entry(found)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("policy bundle watch failed, watching again: %r", exc)
        finally:
            if watcher is not None:
                try:
                    await watcher.stop()
                except Exception as exc:  # the connection may be gone already
                    log.debug("stopping the bundle watcher: %r", exc)
        await asyncio.sleep(REWATCH_DELAY_S)
