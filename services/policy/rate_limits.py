"""Rate limits per tenant, user and tool that hold across all policy replicas.

The registry's `rate_limit` (calls per per_seconds) is counted in fixed
windows: one KV key per (tenant, user, tool, window) holding the calls
(tenant.agent.call_id) admitted in it. An admission is an optimistic update
(`update(last=revision)`), so two replicas admitting at once cannot both take
the last slot: the loser re-reads and counts again. Keeping call_ids rather than a number makes a
redelivered call find itself and not count twice. Fixed windows allow up to
twice the rate across a window boundary; the keys expire with the bucket's
max age, so a per_seconds longer than WINDOW_RETENTION_S is not enforced fully.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from toolgate.contracts import subjects
from toolgate.runtime.topology import RATE_LIMIT_WINDOW_RETENTION_S, rate_limits_bucket_config

__all__ = ["rate_limits_bucket_config"]
from toolgate.contracts.calls import ErrorCode, ToolCall
from toolgate.contracts.registry import RateLimit

RATE_LIMITS_BUCKET = subjects.RATE_LIMITS_BUCKET
RATE_LIMITED = ErrorCode.RATE_LIMITED
WINDOW_RETENTION_S = RATE_LIMIT_WINDOW_RETENTION_S
MAX_UPDATE_ATTEMPTS = 50


@dataclass(frozen=True)
class RateCheck:
    admitted: bool
    count: int  # calls admitted in this window, this one included if admitted
    retry_after_s: float


def window_key(call: ToolCall, limit: RateLimit, now: float) -> tuple[str, float]:
    """The counter key of this call's window, and the seconds until the window ends."""
    window = int(now // limit.per_seconds)
    # Tenant and user ids may hold characters a KV key may not: hash them.
    owner = hashlib.sha256(
        f"{call.principal.tenant}\0{call.principal.user}\0{call.tool}".encode()
    ).hexdigest()
    return f"{owner[:32]}.{window}", (window + 1) * limit.per_seconds - now


class RateLimiter:
    def __init__(self, kv: KeyValue, clock: Callable[[], float] = time.time) -> None:
        self._kv = kv
        self._clock = clock

    async def admit(self, call: ToolCall, limit: RateLimit) -> RateCheck:
        key, retry_after_s = window_key(call, limit, self._clock())
        # A call_id is only unique per agent: another agent's call is another call.
        identity = subjects.call_key(call.principal.tenant, call.principal.agent, call.call_id)
        for _ in range(MAX_UPDATE_ATTEMPTS):
            try:
                entry = await self._kv.get(key)
                admitted, revision = _decode(entry.value), entry.revision
            except KeyNotFoundError:
                admitted, revision = [], None
            if identity in admitted:  # a redelivery: admitted before
                return RateCheck(True, len(admitted), 0.0)
            if len(admitted) >= limit.calls:
                return RateCheck(False, len(admitted), retry_after_s)
            value = msgspec.json.encode([*admitted, identity])
            try:
                if revision is None:
                    await self._kv.create(key, value)
                else:
                    await self._kv.update(key, value, last=revision)
            except KeyWrongLastSequenceError:
                continue  # another replica admitted a call meanwhile: count again
            return RateCheck(True, len(admitted) + 1, 0.0)
        raise RuntimeError(f"rate limit window {key} stayed contended; will retry")


def _decode(value: bytes | None) -> list[str]:
    return msgspec.json.decode(value, type=list[str]) if value else []
