"""Which stored message first claimed each (tenant, agent, call_id): a KV bucket.

A call is identified by who sent it and its call_id. The first stored
message with a given identity claims it; a later one (a retry, whatever its
Nats-Msg-Id) is a duplicate that must not run again: the agent gets the
result of the first. The same call_id from another agent is another key.
"""

from __future__ import annotations

from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue


class CallIdClaims:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def claim(self, key: str, message_id: str) -> bool:
        """True if `message_id` owns `key` (it claimed it now, or did on an earlier delivery)."""
        try:
            await self._kv.create(key, message_id.encode())
            return True
        except KeyWrongLastSequenceError:
            entry = await self._kv.get(key)
            return entry.value is not None and entry.value.decode() == message_id
