"""What the CLI and the web inbox use: read approval states, send votes.

Reading goes straight to the KV bucket (the same calls and arguments are in
the events stream anyway; NATS credentials guard both). Voting goes through
the approvals service, which authenticates the approver's token.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from toolgate.services.approvals import protocol
from toolgate.services.approvals.logic import ApprovalState, Decision, VoteOutcome
from toolgate.services.approvals.store import ApprovalStore, ensure_bucket


class ServiceUnavailable(RuntimeError):
    """No approvals service answered."""


def new_vote_id() -> str:
    return f"vote_{uuid.uuid4().hex}"


class ApprovalsClient:
    def __init__(self, nc: Client, store: ApprovalStore) -> None:
        self._nc = nc
        self.store = store

    @classmethod
    async def connect(cls, nats_url: str, **options: Any) -> ApprovalsClient:
        options.setdefault("max_reconnect_attempts", -1)
        options.setdefault("connect_timeout", 5)
        nc = await nats.connect(nats_url, **options)
        try:
            kv = await ensure_bucket(nc.jetstream())
        except Exception:
            await nc.close()
            raise
        return cls(nc, ApprovalStore(kv))

    async def close(self) -> None:
        await self._nc.drain()

    async def __aenter__(self) -> ApprovalsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def pending(self) -> list[ApprovalState]:
        """The open requests, soonest expiry first (including ones due but not yet swept)."""
        return await self.store.pending()

    async def get(self, call_id: str) -> ApprovalState | None:
        found = await self.store.get(call_id)
        return found[0] if found else None

    async def vote(self, call_id: str, decision: Decision, *, arguments_sha256: str,
                   reason: str, token: str, approver: str | None = None,
                   timeout: float = 5.0, attempts: int = 3) -> VoteOutcome:
        """Send one vote; a lost reply is retried with the same vote id (counted once)."""
        request = protocol.VoteRequest(
            call_id=call_id, decision=decision, arguments_sha256=arguments_sha256,
            reason=reason, token=token, approver=approver, vote_id=new_vote_id())
        payload = protocol.encode(request)
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                reply = await self._nc.request(protocol.VOTE_SUBJECT, payload, timeout=timeout)
            except NoRespondersError as exc:
                last = exc
            except NatsTimeoutError as exc:
                last = exc
            else:
                outcome = protocol.reply_decoder.decode(reply.data)
                if outcome.code != "INTERNAL" or attempt == attempts - 1:
                    return outcome
            await asyncio.sleep(0.5 * (attempt + 1))
        raise ServiceUnavailable(
            f"no approvals service answered on {protocol.VOTE_SUBJECT} ({last!r}); "
            "is `toolgate serve approvals` running?")
