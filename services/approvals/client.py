"""What the CLI and the web inbox use: requests to the approvals service.

Approvers read and vote only through the service (protocol.py): on a locked
bus they connect with their own creds (a user of the account APPROVERS,
`toolgate approvals add-approver`; the web inbox with its own), which can
reach nothing else and read replies only on their own inbox prefix, which
`runtime.creds.connect_options` sets. Every request carries an approver
token; the service answers with the calls of that approver's tenants only.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from toolgate.runtime.closing import end_connection
from toolgate.services.approvals import protocol
from toolgate.services.approvals.logic import Decision, Refusal, VoteOutcome


class ServiceUnavailable(RuntimeError):
    """No approvals service answered."""


class Refused(RuntimeError):
    """The service answered no (bad token, unknown call, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"refused ({code}): {message}")
        self.code = code
        self.message = message


def new_vote_id() -> str:
    return f"vote_{uuid.uuid4().hex}"


class ApprovalsClient:
    def __init__(self, nc: Client, token: str | None = None) -> None:
        self._nc = nc
        self.token = token

    @classmethod
    async def connect(
        cls, nats_url: str, token: str | None = None, **options: Any
    ) -> ApprovalsClient:
        """Connect (`options`: nats.connect's, e.g. `connect_options(approver creds)`, which
        carries its inbox prefix). `token`: the approver token used when a call gives none."""
        options.setdefault("max_reconnect_attempts", -1)
        options.setdefault("connect_timeout", 5)
        return cls(await nats.connect(nats_url, **options), token)

    async def close(self) -> None:
        await end_connection(self._nc)

    async def __aenter__(self) -> ApprovalsClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _token(self, token: str | None) -> str:
        token = token or self.token
        if not token:
            raise Refused(Refusal.INVALID_TOKEN, "an approver token is needed")
        return token

    async def request(
        self,
        subject: str,
        request: msgspec.Struct,
        decoder: Any,
        *,
        timeout: float = 5.0,
        attempts: int = 3,
    ) -> Any:
        """One request/reply; retried when no service answers or it answers INTERNAL
        (every request is safe to repeat: a vote carries its vote id)."""
        payload = protocol.encode(request)
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                reply = await self._nc.request(subject, payload, timeout=timeout)
            except (NoRespondersError, NatsTimeoutError) as exc:
                last = exc
            else:
                answer = decoder.decode(reply.data)
                if answer.code != Refusal.INTERNAL or attempt == attempts - 1:
                    return answer
            if attempt < attempts - 1:
                await asyncio.sleep(0.5 * (attempt + 1))
        raise ServiceUnavailable(
            f"no approvals service answered on {subject} ({last!r}); "
            "is `toolgate serve approvals` running?"
        )

    async def whoami(self, token: str | None = None, **kw: Any) -> protocol.Identity | None:
        """Whose token this is (None: no approver's)."""
        reply = await self.request(
            protocol.WHOAMI_SUBJECT,
            protocol.WhoamiRequest(token=self._token(token)),
            protocol.whoami_reply_decoder,
            **kw,
        )
        if reply.ok:
            return reply.approver
        if reply.code == Refusal.INVALID_TOKEN:
            return None
        raise Refused(reply.code, reply.message)

    async def list_pending(self, token: str | None = None, **kw: Any) -> protocol.ListReply:
        """The whole list reply (who is asking, the calls, how many did not fit)."""
        reply: protocol.ListReply = await self.request(
            protocol.LIST_SUBJECT,
            protocol.ListRequest(token=self._token(token)),
            protocol.list_reply_decoder,
            **kw,
        )
        if not reply.ok:
            raise Refused(reply.code, reply.message)
        return reply

    async def pending(self, token: str | None = None, **kw: Any) -> list[protocol.ApprovalView]:
        """The open requests this approver may see, soonest expiry first."""
        return list((await self.list_pending(token, **kw)).calls)

    async def show(self, call: str, token: str | None = None, **kw: Any) -> protocol.ShowReply:
        """One call (`TENANT.AGENT.CALL_ID` or a bare `CALL_ID`), as the service answers."""
        return await self.request(
            protocol.SHOW_SUBJECT,
            protocol.ShowRequest(token=self._token(token), call=call),
            protocol.show_reply_decoder,
            **kw,
        )

    async def history(self, token: str | None = None, **filters: Any) -> protocol.HistoryReply:
        """Decided calls this approver may see, latest first (`filters`: HistoryRequest's
        tool, decision, approver, since, until, limit)."""
        reply: protocol.HistoryReply = await self.request(
            protocol.HISTORY_SUBJECT,
            protocol.HistoryRequest(token=self._token(token), **filters),
            protocol.history_reply_decoder,
        )
        if not reply.ok:
            raise Refused(reply.code, reply.message)
        return reply

    async def get(
        self, call: str, token: str | None = None, **kw: Any
    ) -> protocol.ApprovalView | None:
        """One call's approval; None if there is none this approver may see."""
        reply = await self.show(call, token, **kw)
        if reply.ok:
            return reply.approval
        if reply.code == Refusal.UNKNOWN_CALL:
            return None
        raise Refused(reply.code, reply.message)

    async def vote(
        self,
        call: str,
        decision: Decision,
        *,
        arguments_sha256: str,
        reason: str,
        token: str | None = None,
        approver: str | None = None,
        timeout: float = 5.0,
        attempts: int = 3,
        vote_id: str | None = None,
    ) -> VoteOutcome:
        """Send one vote; a lost reply is retried with the same vote id (counted once)."""
        request = protocol.VoteRequest(
            call=call,
            decision=decision,
            arguments_sha256=arguments_sha256,
            reason=reason,
            token=self._token(token),
            approver=approver,
            vote_id=vote_id or new_vote_id(),
        )
        return await self.request(
            protocol.VOTE_SUBJECT,
            request,
            protocol.reply_decoder,
            timeout=timeout,
            attempts=attempts,
        )
