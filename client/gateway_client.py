"""GatewayClient: what an agent platform uses to publish calls and get results.

Only the public wire contract (v2) is used. The client connects with one
agent's creds file (`toolgate agents add TENANT AGENT` mints it); the server
then lets it publish only to `toolgate.calls.<tenant>.<agent>` and read only
`toolgate.results.<tenant>.<agent>.>`. Results are stored once, so
`result(call_id)` fetches one again after a reconnect (a JetStream direct get
by subject, scoped to this agent), and a second `call()` with the same call_id
returns the recorded result without running anything again.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.js.errors import APIError, NotFoundError

from toolgate.contracts import subjects
from toolgate.contracts.calls import (
    MAX_CALL_BYTES,
    ErrorCode,
    PendingNotice,
    Principal,
    ToolCall,
    ToolError,
    ToolResult,
    failure,
)
from toolgate.runtime.creds import connect_options, identity_of_creds, nats_servers

_result_decoder = msgspec.json.Decoder(ToolResult)
_pending_decoder = msgspec.json.Decoder(PendingNotice)
_encoder = msgspec.json.Encoder()
# JetStream's answers to a call it will not store: larger than max_msg_size, or
# the agent's subject holds its quota of calls (max_msgs_per_subject, discard new).
MESSAGE_TOO_LARGE_ERR_CODE = 10054
SUBJECT_FULL_ERR_CODE = 10077
DEFAULT_CONNECT_TIMEOUT_S = 5.0


class ResultTimeout(TimeoutError):
    """No result arrived in time. The call may still finish: fetch it later by call_id."""


class ConnectFailed(ConnectionError):
    """No NATS answered in time, or it refused the credentials."""

    def __init__(self, url: str, cause: Exception) -> None:
        text = str(cause) or type(cause).__name__
        if "authorization" in text.lower() or "authentication" in text.lower():
            what = f"authorization refused at {url}: wrong, revoked or missing creds (--creds)"
        else:
            what = f"no NATS at {url}: is toolgate up running? (--nats-url) [{text}]"
        super().__init__(what)


class IdentityUnknown(ValueError):
    """The client does not know which agent it is: connect with an agent's creds file."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


def _decode_result(data: bytes, call_id: str) -> ToolResult | None:
    """A well-formed ToolResult for `call_id`, or None: nothing else is accepted."""
    try:
        result = _result_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return result if result.call_id == call_id else None


def _decode_pending(data: bytes, call_id: str) -> PendingNotice | None:
    """A well-formed PendingNotice for `call_id`, or None."""
    try:
        notice = _pending_decoder.decode(data)
    except msgspec.DecodeError:
        return None
    return notice if notice.call_id == call_id else None


# Told when a call waits for a human (its `.pending` notice); at most once per call.
OnPending = Callable[[PendingNotice], object]


class GatewayClient:
    def __init__(self, nc: Client, identity: tuple[str, str] | None = None) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        # (tenant, agent) this connection speaks for; None on an unlocked bus.
        self.identity = identity

    @classmethod
    async def connect(
        cls,
        nats_url: str,
        creds: Path | str | None = None,
        *,
        identity: tuple[str, str] | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
        **options: Any,
    ) -> GatewayClient:
        """Connect as one agent: `creds` is its creds file (DATA_DIR/creds/agents/T.A.creds).

        Fails within `connect_timeout` if no server answers or the creds are refused.
        `identity` (tenant, agent) is read from the creds; give it only on an
        unlocked bus, where nobody enforces it.
        """
        if creds is not None:
            identity = identity_of_creds(creds) or identity
        errors: list[Exception] = []

        async def remember(exc: Exception) -> None:  # instead of nats-py's tracebacks
            errors.append(exc)

        options = {
            "connect_timeout": connect_timeout,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "error_cb": remember,
            **connect_options(creds),
            **options,
        }
        try:
            # Once connected, it reconnects forever; the first connect has a deadline.
            nc = await asyncio.wait_for(
                nats.connect(nats_servers(nats_url), **options), connect_timeout
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise ConnectFailed(nats_url, errors[-1] if errors else exc) from None
        return cls(nc, identity)

    async def close(self) -> None:
        await self._nc.drain()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def principal(self, user: str, session: str) -> Principal:
        """The principal of a call by this agent, for `user` in `session`."""
        tenant, agent = self._identity()
        return Principal(tenant=tenant, user=user, agent=agent, session=session)

    def _identity(self, call: ToolCall | None = None) -> tuple[str, str]:
        if self.identity is not None:
            return self.identity
        if call is not None:  # an unlocked bus: the caller's word is all there is
            return call.principal.tenant, call.principal.agent
        raise IdentityUnknown("connect with an agent's creds file to know which agent you are")

    async def publish(self, call: ToolCall) -> ToolResult | None:
        """Store `call` (with a publish ack). Returns a result at once only if it was refused
        before storage (too large); else None, and the result arrives on the results subject.
        """
        tenant, agent = self._identity(call)
        body = _encoder.encode(call)
        try:
            await self._js.publish(
                subjects.calls_subject(tenant, agent), body, stream=subjects.CALLS_STREAM
            )
        except APIError as exc:
            if exc.err_code == MESSAGE_TOO_LARGE_ERR_CODE:
                return failure(
                    call.call_id,
                    "invalid_arguments",
                    ToolError(
                        code=ErrorCode.PAYLOAD_TOO_LARGE,
                        message=f"call is {len(body)} bytes; the gateway stores at most "
                        f"{MAX_CALL_BYTES}",
                        retryable=False,
                    ),
                )
            if exc.err_code == SUBJECT_FULL_ERR_CODE:
                return failure(
                    call.call_id,
                    "denied",
                    ToolError(
                        code=ErrorCode.QUOTA_EXCEEDED,
                        message=f"agent {tenant}.{agent} has stored its quota of calls; older "
                        "ones expire with the retention, or the operator raises it",
                        retryable=True,
                    ),
                )
            raise
        return None

    async def submit(
        self, call: ToolCall, timeout: float = 30.0, *, on_pending: OnPending | None = None
    ) -> ToolResult:
        """Publish `call` and wait for its one ToolResult.

        `on_pending(notice)` is called once if the call waits for a human first
        (the `.pending` notice on its result subject), so a caller can say so.
        """
        tenant, agent = self._identity(call)
        waiting: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()
        told: list[PendingNotice] = []

        def tell(notice: PendingNotice | None) -> None:
            if notice is not None and on_pending is not None and not told and not waiting.done():
                told.append(notice)
                on_pending(notice)

        async def on_result(msg: Any) -> None:
            result = _decode_result(msg.data, call.call_id)
            if result is not None and not waiting.done():
                waiting.set_result(result)

        async def on_notice(msg: Any) -> None:
            tell(_decode_pending(msg.data, call.call_id))

        # Subscribe before publishing, so a fast result is not missed.
        subject = subjects.results_subject(tenant, agent, call.call_id)
        sub = await self._nc.subscribe(subject, cb=on_result)
        notices = None
        if on_pending is not None:
            notices = await self._nc.subscribe(
                subjects.pending_subject(tenant, agent, call.call_id), cb=on_notice
            )
        try:
            refused = await self.publish(call)
            if refused is not None:
                return refused
            # A call_id used before already has its result stored (the gateway
            # answers a retry with the first call's result): take it from there.
            stored = await self._stored(tenant, agent, call.call_id)
            if stored is not None and not waiting.done():
                waiting.set_result(stored)
            elif on_pending is not None:  # it may have been waiting since an earlier try
                tell(await self._stored_notice(tenant, agent, call.call_id))
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), timeout)
            except TimeoutError:
                raise ResultTimeout(
                    f"no result for {call.call_id} within {timeout}s; "
                    "fetch it later with result(call_id)"
                ) from None
        finally:
            await sub.unsubscribe()
            if notices is not None:
                await notices.unsubscribe()

    async def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        *,
        principal: Principal | None = None,
        user: str = "",
        session: str = "",
        task_id: str | None = None,
        context: dict[str, Any] | None = None,
        call_id: str | None = None,
        timeout: float = 30.0,
        on_pending: OnPending | None = None,
    ) -> ToolResult:
        """One call. Give `user` and `session` (this agent's tenant and name are added),
        or a whole `principal` (whose tenant and agent must be this agent's)."""
        return await self.submit(
            ToolCall(
                call_id=call_id or new_call_id(),
                tool=tool,
                arguments=arguments,
                principal=principal or self.principal(user, session),
                task_id=task_id,
                context=context or {},
            ),
            timeout=timeout,
            on_pending=on_pending,
        )

    async def call_many(self, calls: Sequence[ToolCall], timeout: float = 30.0) -> list[ToolResult]:
        """Several tool calls of one model response, concurrently; results in call order."""
        return list(await asyncio.gather(*(self.submit(c, timeout) for c in calls)))

    async def result(self, call_id: str) -> ToolResult | None:
        """The stored result of `call_id` (of this agent), or None if it has none (yet)."""
        return await self._stored(*self._identity(), call_id)

    async def _stored(self, tenant: str, agent: str, call_id: str) -> ToolResult | None:
        try:
            msg = await self._js.get_last_msg(
                subjects.RESULTS_STREAM,
                subjects.results_subject(tenant, agent, call_id),
                direct=True,
            )
        except NotFoundError:
            return None
        return _decode_result(msg.data or b"", call_id)

    async def _stored_notice(self, tenant: str, agent: str, call_id: str) -> PendingNotice | None:
        try:
            msg = await self._js.get_last_msg(
                subjects.RESULTS_STREAM,
                subjects.pending_subject(tenant, agent, call_id),
                direct=True,
            )
        except NotFoundError:
            return None
        return _decode_pending(msg.data or b"", call_id)
