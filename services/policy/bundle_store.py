"""The active policy bundle in a JetStream KV bucket, watched by every policy replica.

`toolgate policy push DIR` validates a bundle and puts all its files under
one key; each replica watches that key and swaps its engine when the value
changes. The bucket keeps a short history, so an operator can see (and put
back) what was active before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import msgspec
import nats.errors
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyNotFoundError, NotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from toolgate.contracts import subjects

log = logging.getLogger("toolgate.policy")

POLICIES_BUCKET = subjects.POLICIES_BUCKET
ACTIVE_KEY = "active"
REWATCH_DELAY_S = 1.0
REFRESH_S = 30.0


class StoredBundle(msgspec.Struct, frozen=True):
    files: dict[str, str]
    # For operators reading the bucket; replicas recompute it from the files.
    version: str = ""


def policies_bucket_config(replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(bucket=POLICIES_BUCKET, history=16, storage=StorageType.FILE,
                          replicas=replicas)


async def open_bucket(js: JetStreamContext, config: KeyValueConfig) -> KeyValue:
    """The bucket, created if missing (idempotent: every replica and the CLI call it)."""
    try:
        return await js.key_value(config.bucket)
    except (NotFoundError, BadRequestError):
        try:
            return await js.create_key_value(config)
        except BadRequestError:  # another process created it meanwhile
            return await js.key_value(config.bucket)


async def push_bundle(kv: KeyValue, files: Mapping[str, str], version: str) -> int:
    return await kv.put(ACTIVE_KEY, msgspec.json.encode(StoredBundle(dict(files), version)))


async def fetch_active(kv: KeyValue) -> dict[str, str] | None:
    try:
        entry = await kv.get(ACTIVE_KEY)
    except KeyNotFoundError:  # never pushed, or deleted
        return None
    return _decode(entry.value)


async def watch_active(kv: KeyValue, on_files: Callable[[dict[str, str]], None]) -> None:
    """Call `on_files` with each pushed bundle, until cancelled.

    Also re-reads the key every REFRESH_S without news: should the watch
    die silently (a server restart, say), a replica is stale for at most that
    long. `on_files` must ignore a bundle it already runs.
    """
    while True:
        watcher = None
        try:
            watcher = await kv.watch(ACTIVE_KEY)
            while True:
                try:
                    entry = await watcher.updates(timeout=REFRESH_S)
                except nats.errors.TimeoutError:
                    files = await fetch_active(kv)
                else:
                    # None ends the initial values; a deleted key changes nothing.
                    deleted = entry is None or entry.operation in (KV_DEL, KV_PURGE)
                    files = None if deleted else _decode(entry.value)
                if files is not None:
                    on_files(files)
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


def _decode(value: bytes | None) -> dict[str, str] | None:
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=StoredBundle).files
    except msgspec.DecodeError as exc:
        log.error("the stored policy bundle is not readable, ignored: %s", exc)
        return None
