"""Per-call outcome records in a JetStream KV bucket: the executor's memory.

Before a tool runs, a `started` record is created under the call's key
(tenant.agent.call_id; create
fails if any record exists, so two workers cannot both start one call).
After it runs, the terminal event is stored as a `done` record *before* it
is published. A redelivered or re-published call finds the record and
replays the stored outcome instead of running the tool again.
"""

from __future__ import annotations

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from toolgate.services.executor.logic import OutcomeRecord

__all__ = ["OutcomeRecord", "OutcomeStore"]


class OutcomeStore:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def get(self, key: str) -> tuple[OutcomeRecord, int] | None:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return msgspec.msgpack.decode(entry.value, type=OutcomeRecord), entry.revision or 0

    async def claim(self, key: str, record: OutcomeRecord) -> bool:
        """Create the `started` record; False if a record already exists."""
        try:
            await self._kv.create(key, msgspec.msgpack.encode(record))
        except KeyWrongLastSequenceError:
            return False
        return True

    async def reclaim(self, key: str, record: OutcomeRecord, revision: int) -> bool:
        """Replace an interrupted `started` record, if nobody changed it meanwhile."""
        try:
            await self._kv.update(key, msgspec.msgpack.encode(record), last=revision)
        except KeyWrongLastSequenceError:
            return False
        return True

    async def finish(self, key: str, record: OutcomeRecord) -> None:
        await self._kv.put(key, msgspec.msgpack.encode(record))
