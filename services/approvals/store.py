"""Approval state in the JetStream KV bucket `toolgate_approvals`, keyed by the
call key `tenant.agent.call_id` (a call_id is unique only per agent).

Keys start with the tenant, so what one tenant's approver may see is read
with a key filter (`acme.*.*`): another tenant's states are never even loaded.
Listing reads the keys present from the stream's per-subject state (stream
info with a subject filter), then gets each: unlike a KV watcher (whose
"no more pending" marker can overtake a message already on its way in
nats-py), it cannot come back empty while states exist.

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
from toolgate.services.approvals.logic import ApprovalState, Approver

APPROVALS_BUCKET: Final = subjects.APPROVALS_BUCKET
RETENTION_S: Final = 7 * 24 * 3600.0
MAX_VALUE_BYTES: Final = 8 * 1024 * 1024
MAX_CONFLICT_RETRIES: Final = 20
KV_STREAM: Final = f"KV_{APPROVALS_BUCKET}"
KV_SUBJECT_PREFIX: Final = f"$KV.{APPROVALS_BUCKET}."
MAX_PARALLEL_GETS: Final = 32

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(ApprovalState)


class ConflictError(RuntimeError):
    """The state kept changing under us; give up this attempt (it is retried)."""


def bucket_config(replicas: int = 1, retention_s: float = RETENTION_S) -> KeyValueConfig:
    # States live as long as the events of their calls, so a late vote or a
    # redelivered request still finds the decision (single use).
    return KeyValueConfig(
        bucket=APPROVALS_BUCKET,
        history=1,
        ttl=retention_s,
        storage=StorageType.FILE,
        replicas=replicas,
        max_value_size=MAX_VALUE_BYTES,
    )


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


def key_filters(approver: Approver, call_id: str = "*") -> list[str]:
    """KV key filters for the calls `approver` may see (with `call_id`: only those
    calls of that id). No tenants: no filters, nothing is read."""
    if approver.all_tenants:
        return [f"*.*.{call_id}"]
    return [
        f"{tenant}.*.{call_id}"
        for tenant in sorted(set(approver.tenants))
        if subjects.is_identity_token(tenant)
    ]


class ApprovalStore:
    def __init__(self, kv: KeyValue, js: JetStreamContext) -> None:
        self._kv = kv
        self._js = js

    @classmethod
    async def open(cls, js: JetStreamContext) -> ApprovalStore:
        return cls(await ensure_bucket(js), js)

    async def get(self, key: str) -> tuple[ApprovalState, int] | None:
        try:
            entry = await self._kv.get(key)
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None or entry.revision is None:
            return None
        state = decode_state(entry.value)
        if state.key != key:  # not a state of this call (a record of another schema)
            return None
        return state, entry.revision

    async def create(self, state: ApprovalState) -> tuple[ApprovalState, int]:
        """Store a new state; if one exists (a redelivered request) return that one."""
        for _ in range(MAX_CONFLICT_RETRIES):
            try:
                revision = await self._kv.create(state.key, encode_state(state))
                return state, revision
            except KeyWrongLastSequenceError:
                found = await self.get(state.key)
                if found is not None:
                    return found
        raise ConflictError(f"cannot create the approval state of {state.key}")

    async def update(self, state: ApprovalState, revision: int) -> int | None:
        """Write `state` if the stored revision is still `revision`; None if it is not."""
        try:
            return await self._kv.update(state.key, encode_state(state), last=revision)
        except KeyWrongLastSequenceError:
            return None

    async def change(
        self, key: str, step: Callable[[ApprovalState], ApprovalState | None]
    ) -> tuple[ApprovalState, int] | None:
        """Read-modify-write with retry on conflict. `step` returns the new state, or
        None for no change. Returns the latest state and revision; None if no state."""
        for _ in range(MAX_CONFLICT_RETRIES):
            found = await self.get(key)
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
        raise ConflictError(f"the approval state of {key} kept changing")

    async def keys(self, pattern: str = "*.*.*") -> list[str]:
        """The keys stored that match `pattern` (a KV key filter)."""
        info = await self._js.stream_info(KV_STREAM, subjects_filter=KV_SUBJECT_PREFIX + pattern)
        return sorted(subject[len(KV_SUBJECT_PREFIX) :] for subject in (info.state.subjects or {}))

    async def snapshot(self, keys: str = "*.*.*") -> list[tuple[ApprovalState, int]]:
        """Every stored state whose key matches `keys`, latest revision of each."""
        limit = asyncio.Semaphore(MAX_PARALLEL_GETS)

        async def one(key: str) -> tuple[ApprovalState, int] | None:
            async with limit:
                try:
                    return await self.get(key)
                except msgspec.DecodeError:
                    return None  # not ours to judge here; `get` of that key fails loudly

        found = await asyncio.gather(*(one(key) for key in await self.keys(keys)))
        return [item for item in found if item is not None]

    async def visible_to(self, approver: Approver, call_id: str = "*") -> list[ApprovalState]:
        """The states `approver` may see (with `call_id`: of that call_id, any agent)."""
        found: dict[str, ApprovalState] = {}
        for keys in key_filters(approver, call_id):
            for state, _ in await self.snapshot(keys):
                if approver.may_vote_for(state.tenant):
                    found[state.key] = state
        return list(found.values())

    async def pending(
        self, approver: Approver | None = None, now: datetime | None = None
    ) -> list[ApprovalState]:
        """Open requests (every tenant's, or only those `approver` may see), soonest
        expiry first; with `now`, only those not yet due."""
        if approver is None:
            candidates = [s for s, _ in await self.snapshot()]
        else:
            candidates = await self.visible_to(approver)
        states = [s for s in candidates if s.is_open]
        if now is not None:
            states = [s for s in states if now < s.expires_at]
        return sorted(states, key=lambda s: (s.expires_at, s.key))
