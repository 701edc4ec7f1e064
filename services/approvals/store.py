"""Approval state in the JetStream KV bucket `toolgate_approvals`, keyed by call_id.

Every change is an optimistic update (`kv.update(key, value, last=revision)`):
two replicas that change one call at once cannot both win; the loser reads
the new state and applies its change again (or finds nothing left to do).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Final

import msgspec
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import (
    BadRequestError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
    NotFoundError,
)
from nats.js.kv import KeyValue

from toolgate.contracts import subjects
from toolgate.services.approvals.logic import ApprovalState

APPROVALS_BUCKET: Final = subjects.APPROVALS_BUCKET
RETENTION_S: Final = 7 * 24 * 3600.0
MAX_VALUE_BYTES: Final = 8 * 1024 * 1024
MAX_CONFLICT_RETRIES: Final = 20

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ApprovalState)


class ConflictError(RuntimeError):
    """The state kept changing under us; give up this attempt (it is retried)."""


def bucket_config(replicas: int = 1, retention_s: float = RETENTION_S) -> KeyValueConfig:
    # States live as long as the events of their calls, so a late vote or a
    # redelivered request still finds the decision (single use).
    return KeyValueConfig(bucket=APPROVALS_BUCKET, history=1, ttl=retention_s,
                          storage=StorageType.FILE, replicas=replicas,
                          max_value_size=MAX_VALUE_BYTES)


async def ensure_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """Open the bucket, creating it if missing (idempotent; safe when replicas race)."""
    try:
        return await js.key_value(APPROVALS_BUCKET)
    except (NotFoundError, BadRequestError):
        pass
    try:
        return await js.create_key_value(bucket_config(replicas))
    except BadRequestError:
        return await js.key_value(APPROVALS_BUCKET)  # another process created it first


def encode_state(state: ApprovalState) -> bytes:
    return _encoder.encode(state)


def decode_state(data: bytes) -> ApprovalState:
    return _decoder.decode(data)


class ApprovalStore:
    def __init__(self, kv: KeyValue) -> None:
        self._kv = kv

    async def get(self, call_id: str) -> tuple[ApprovalState, int] | None:
        try:
            entry = await self._kv.get(call_id)
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None or entry.revision is None:
            return None
        return decode_state(entry.value), entry.revision

    async def create(self, state: ApprovalState) -> tuple[ApprovalState, int]:
        """Store a new state; if one exists (a redelivered request) return that one."""
        for _ in range(MAX_CONFLICT_RETRIES):
            try:
                revision = await self._kv.create(state.call_id, encode_state(state))
                return state, revision
            except KeyWrongLastSequenceError:
                found = await self.get(state.call_id)
                if found is not None:
                    return found
        raise ConflictError(f"cannot create the approval state of {state.call_id}")

    async def update(self, state: ApprovalState, revision: int) -> int | None:
        """Write `state` if the stored revision is still `revision`; None if it is not."""
        try:
            return await self._kv.update(state.call_id, encode_state(state), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def change(self, call_id: str,
                     step: Callable[[ApprovalState], ApprovalState | None]
                     ) -> tuple[ApprovalState, int] | None:
        """Read-modify-write with retry on conflict. `step` returns the new state, or
        None for no change. Returns the latest state and revision; None if no state."""
        for _ in range(MAX_CONFLICT_RETRIES):
            found = await self.get(call_id)
            if found is None:
                return None
            state, revision = found
            new = step(state)
            if new is None or new == state:
                return state, revision
            written = await self.update(new, revision)
            if written is not None:
                return new, written
            await asyncio.sleep(0)
        raise ConflictError(f"the approval state of {call_id} kept changing")

    async def snapshot(self, timeout: float = 10.0) -> list[tuple[ApprovalState, int]]:
        """Every stored state (latest revision of each key), in one pass over the bucket."""
        # A short inactive threshold: the server drops this watcher's consumer soon
        # after we stop it, so frequent sweeps do not pile up idle consumers.
        watcher = await self._kv.watchall(ignore_deletes=True, inactive_threshold=10.0)
        states: list[tuple[ApprovalState, int]] = []
        try:
            while True:
                entry = await watcher.updates(timeout=timeout)
                if entry is None:
                    break
                if entry.value and entry.revision is not None:
                    try:
                        states.append((decode_state(entry.value), entry.revision))
                    except msgspec.DecodeError:
                        continue  # not ours to judge here; `get` will fail loudly on it
        finally:
            await watcher.stop()
        return states

    async def pending(self, now: datetime | None = None) -> list[ApprovalState]:
        states = [s for s, _ in await self.snapshot() if s.is_open]
        if now is not None:
            states = [s for s in states if now < s.expires_at]
        return sorted(states, key=lambda s: (s.expires_at, s.call_id))

