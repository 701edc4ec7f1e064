"""GatewayClient: what an agent platform uses to publish calls and get results.

Only the public wire contract (v2) is used. The client connects with one
agent's creds file (`toolgate agents add TENANT AGENT` mints it); the server
then lets it publish only to `toolgate.calls.<tenant>.<agent>` and read only
`toolgate.results.<tenant>.<agent>.>`. Results are stored once, so
`result(call_id)` fetches one again after a reconnect (a JetStream direct get
by subject, scoped to this agent), and a second `call()` with the same call_id
returns the recorded result without running anything again.

Per connection, one subscription per agent (`toolgate.results.<tenant>.<agent>.>`,
opened before the first publish) carries every result and `.pending` notice;
a call waits on a future keyed by its result subject. A call whose call_id
the caller chose may be a retry whose result is stored already: for it the
client also asks for the stored result (a direct get whose reply lands on the
client's own reply subscription, nothing awaited). A call_id the client minted
in `call()` cannot have been used before, so it needs no such read. After a
reconnect, every call still waiting reads its stored result, so a result
published while the connection was down is not missed.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
from nats.aio.client import Client
from nats.js.errors import APIError, NotFoundError

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import (
    MAX_CALL_BYTES,
    REFUSED_HEADER,
    ErrorCode,
    PendingNotice,
    Principal,
    ToolCall,
    ToolError,
    ToolResult,
    answered_call,
    call_id_reused,
    failure,
)
from toolgate.contracts.registry_bundle import ToolListing
from toolgate.runtime.closing import end_connection
from toolgate.runtime.creds import connect_options, identity_of_creds
from toolgate.runtime.first_connect import FirstConnectFailed, first_connect
from toolgate.runtime.jetstream import LeanJetStream

_result_decoder = msgspec.json.Decoder(ToolResult)
_pending_decoder = msgspec.json.Decoder(PendingNotice)
_encoder = msgspec.json.Encoder()
# JetStream's answers to a call it will not store: larger than max_msg_size, or
# the agent's subject holds its quota of calls (max_msgs_per_subject, discard new).
MESSAGE_TOO_LARGE_ERR_CODE = 10054
SUBJECT_FULL_ERR_CODE = 10077
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# How long tool_listing waits for the gateway's answer.
LISTING_TIMEOUT_S = 5.0


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


class ListingUnavailable(ConnectionError):
    """The gateway did not answer this agent's tool listing request (or refused it)."""


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

_RESULTS_PREFIX_DOT = subjects.RESULTS_PREFIX + "."
_PENDING_TAIL = "." + subjects.PENDING_SUFFIX


def too_large(call_id: str, size: int) -> ToolResult:
    """The answer to a call larger than the gateway takes, given without a round trip."""
    return failure(
        call_id,
        "invalid_arguments",
        ToolError(
            code=ErrorCode.PAYLOAD_TOO_LARGE,
            message=f"call is {size} bytes; the gateway takes at most {MAX_CALL_BYTES}",
            retryable=False,
        ),
    )


def _integral(value: Any) -> Any:
    """`value` with every integral float an int (7.0 -> 7), as the gateway's validator
    makes it in an "integer" field before it hashes a call's arguments."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value


class _Waiter:
    """One submit waiting for the result of `call_id`.

    `tool` and `hashes`, when the caller chose the call_id (it may name an earlier
    call): this call's tool and the hashes the gateway may give its arguments (as sent,
    and with integral floats made ints, as the validator does in integer fields). An
    answer names the call it answers (contracts/calls.py `answered_call`)."""

    __slots__ = ("call_id", "certain", "future", "hashes", "on_pending", "refused", "suspect",
                 "told", "tool")  # fmt: skip

    def __init__(
        self,
        call_id: str,
        future: asyncio.Future[ToolResult],
        on_pending: OnPending | None,
        tool: str = "",
        arguments: Any = None,
        chosen: bool = False,
    ) -> None:
        self.call_id, self.future, self.on_pending = call_id, future, on_pending
        self.told = False
        self.tool = tool
        self.hashes: frozenset[str] | None = None
        # No integral float in the arguments: the gateway's hash is the one computed here,
        # so an answer naming another hash is surely another call's.
        self.certain = True
        if chosen:
            as_sent = arguments_sha256(arguments)
            integral = arguments_sha256(_integral(arguments))
            self.hashes = frozenset((as_sent, integral))
            self.certain = as_sent == integral
        self.suspect = False  # it has seen another call's answer (uncertain: see `answer`)
        self.refused: ToolResult | None = None

    def tell(self, notice: PendingNotice) -> None:
        if self.on_pending is not None and not self.told and not self.future.done():
            self.told = True
            self.on_pending(notice)

    def mine(self, named: tuple[str, str] | None) -> bool | None:
        """Is an answer naming `named` this call's? True, False, or None (cannot tell here:
        the arguments hold an integral float outside an integer field, perhaps)."""
        if named is None or self.hashes is None:
            return True
        if named[0] == self.tool and named[1] in self.hashes:
            return True
        return False if self.certain else None

    def answer(self, result: ToolResult, named: tuple[str, str] | None, refusal: bool) -> None:
        """`result` arrived on this call_id's subject. Another call's answer is not this
        call's: this call is refused (CALL_ID_REUSED) when that is sure; when it cannot be
        told here, the gateway's verdict on the retry decides (its refusal, published
        only once the first call's result is stored; else the wait times out)."""
        if self.future.done():
            return
        verdict = self.mine(named)
        if refusal:  # the gateway refused the call `named`
            if verdict is True and named is not None and self.hashes is not None:
                self.future.set_result(result)
            elif verdict is None:
                if self.suspect:
                    self.future.set_result(result)
                else:
                    self.refused = result  # before the answer it refuses: kept
            return
        if verdict is True:
            self.future.set_result(result)
        elif verdict is False:
            self.future.set_result(call_id_reused(self.call_id, self.tool))
        else:
            self.suspect = True
            if self.refused is not None:
                self.future.set_result(self.refused)


class GatewayClient:
    def __init__(self, nc: Client, identity: tuple[str, str] | None = None) -> None:
        self._nc = nc
        # Publish acks on one reply subscription, decoded with msgspec (the services' own).
        self._js = LeanJetStream(nc)
        # (tenant, agent) this connection speaks for; None on an unlocked bus.
        self.identity = identity
        # Submits waiting, by result subject (one call_id may have several submits).
        self._waiting: dict[str, list[_Waiter]] = {}
        # Agents whose results subscription is open (one, unless the bus is unlocked).
        self._listening: set[tuple[str, str]] = set()
        self._listen_lock = asyncio.Lock()
        # Where direct gets of stored results reply: `<inbox>.<stored subject minus prefix>`.
        self._replies: str | None = None

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

        async def quiet(exc: Exception) -> None:  # instead of nats-py's tracebacks
            pass

        made: list[GatewayClient] = []
        theirs = options.pop("reconnected_cb", None)

        async def reconnected() -> None:  # results published while down: read them stored
            if made:
                await made[0]._recover()
            if theirs is not None:
                await theirs()

        options = {
            "connect_timeout": connect_timeout,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "error_cb": quiet,
            **connect_options(creds),
            **options,
            "reconnected_cb": reconnected,
        }
        try:
            nc = await first_connect(nats_url, options, connect_timeout)
        except FirstConnectFailed as failed:
            raise ConnectFailed(nats_url, failed.cause) from None
        made.append(cls(nc, identity))
        return made[0]

    async def close(self) -> None:
        """Drained if connected, else closed at once: the client ends here, its
        reconnect loop with it (runtime/closing.py)."""
        await end_connection(self._nc)

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

    async def publish(self, call: ToolCall, *, user_token: str | None = None) -> ToolResult | None:
        """Store `call` (with a publish ack). Returns a result at once only if it is refused
        before storage (too large: not even sent); else None, and the result arrives on the
        results subject.

        `user_token`: the end user's access token (a gateway started with
        `--oidc-issuer` requires it for tools that act for a user). It travels in the
        NATS header `Authorization: Bearer <token>`, never in the payload.
        """
        tenant, agent = self._identity(call)
        body = _encoder.encode(call)
        if len(body) > MAX_CALL_BYTES:  # the gateway would refuse it: not sent, not stored
            return too_large(call.call_id, len(body))
        try:
            await self._js.publish(
                subjects.calls_subject(tenant, agent),
                body,
                stream=subjects.CALLS_STREAM,
                headers={"Authorization": f"Bearer {user_token}"} if user_token else None,
            )
        except APIError as exc:
            if exc.err_code == MESSAGE_TOO_LARGE_ERR_CODE:  # a stream with a smaller limit
                return too_large(call.call_id, len(body))
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
        self,
        call: ToolCall,
        timeout: float = 30.0,
        *,
        on_pending: OnPending | None = None,
        fresh: bool = False,
        user_token: str | None = None,
    ) -> ToolResult:
        """Publish `call` and wait for its one ToolResult.

        The call_id may have been used before (a retry): its stored result is
        the answer then. `on_pending(notice)` is called once if the call waits
        for a human first (the `.pending` notice on its result subject, live or
        stored), so a caller can say so. `fresh=True` says the caller minted the
        call_id just now (`new_call_id()`), so no result can be stored for it:
        the read of the store (a request to the server per call) is skipped.
        """
        return await self._submit(call, timeout, on_pending, fresh=fresh, user_token=user_token)

    async def _submit(
        self,
        call: ToolCall,
        timeout: float,
        on_pending: OnPending | None,
        *,
        fresh: bool,
        user_token: str | None = None,
    ) -> ToolResult:
        """`fresh`: this client minted the call_id just now, so nothing can be stored for it."""
        tenant, agent = self._identity(call)
        if (tenant, agent) not in self._listening:
            await self._listen(tenant, agent)
        key = subjects.results_subject(tenant, agent, call.call_id)
        # A call_id the caller chose may name an earlier call: its answer must name this one.
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(call.call_id, future, on_pending, call.tool, call.arguments, not fresh)
        waiters = self._waiting.get(key)
        if waiters is None:
            waiters = self._waiting[key] = [waiter]
        else:
            waiters.append(waiter)
        try:
            # The subscription was sent before this publish on the same connection,
            # so the server has it before the call exists: no live result is missed.
            refused = await self.publish(call, user_token=user_token)
            if refused is not None:
                return refused
            if not fresh:  # a retry's result, or its notice, may be stored already
                # The notice too: one of another call under this call_id refuses this one.
                await self._read_stored(key, pending=True)
            try:
                return await asyncio.wait_for(waiter.future, timeout)
            except TimeoutError:
                raise ResultTimeout(
                    f"no result for {call.call_id} within {timeout}s; "
                    "fetch it later with result(call_id)"
                ) from None
        finally:
            waiters.remove(waiter)
            if not waiters and self._waiting.get(key) is waiters:
                del self._waiting[key]

    async def _listen(self, tenant: str, agent: str) -> None:
        """Open this agent's results subscription (once)."""
        async with self._listen_lock:
            if (tenant, agent) in self._listening:
                return
            prefix = subjects.agent_results_prefix(tenant, agent)
            await self._nc.subscribe(f"{prefix}.>", cb=self._on_live)
            self._listening.add((tenant, agent))

    async def _on_live(self, msg: Any) -> None:
        self._deliver(msg.subject, msg.data, msg.headers)

    async def _on_stored(self, msg: Any) -> None:
        """A direct get's reply: the stored message, or a status (404: nothing stored yet)."""
        if not msg.data or (msg.headers and msg.headers.get("Status")):
            return
        assert self._replies is not None
        self._deliver(
            _RESULTS_PREFIX_DOT + msg.subject[len(self._replies) + 1 :], msg.data, msg.headers
        )

    def _deliver(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        """A message on a result subject (live or stored) to the submits waiting for it."""
        waiters = self._waiting.get(subject)
        named = answered_call(headers)
        if waiters is not None:
            result = _decode_result(data, waiters[0].call_id)
            if result is not None:
                refusal = bool(headers and headers.get(REFUSED_HEADER))
                for waiter in list(waiters):
                    waiter.answer(result, named, refusal)
            return
        if subject.endswith(_PENDING_TAIL):
            waiters = self._waiting.get(subject[: -len(_PENDING_TAIL)])
            if waiters is not None:
                notice = _decode_pending(data, waiters[0].call_id)
                if notice is not None:
                    for waiter in list(waiters):
                        verdict = waiter.mine(named)
                        if verdict is True:
                            waiter.tell(notice)
                        elif verdict is False and not waiter.future.done():
                            # another call waits for a human under this call_id
                            waiter.future.set_result(call_id_reused(waiter.call_id, waiter.tool))

    async def _read_stored(self, key: str, *, pending: bool) -> None:
        """Ask for the stored result at `key` (and its notice): the reply is delivered
        like a live message; nothing is awaited (a 404 reply is dropped)."""
        if self._replies is None:
            async with self._listen_lock:
                if self._replies is None:
                    replies = self._nc.new_inbox()
                    await self._nc.subscribe(f"{replies}.>", cb=self._on_stored)
                    self._replies = replies
        direct_get = subjects.direct_get_prefix(subjects.RESULTS_STREAM)
        tail = key[len(_RESULTS_PREFIX_DOT) :]
        await self._nc.publish(f"{direct_get}.{key}", b"", reply=f"{self._replies}.{tail}")
        if pending:
            await self._nc.publish(
                f"{direct_get}.{key}{_PENDING_TAIL}",
                b"",
                reply=f"{self._replies}.{tail}{_PENDING_TAIL}",
            )

    async def _recover(self) -> None:
        """After a reconnect: whatever was published while the connection was down is stored."""
        for key, waiters in list(self._waiting.items()):
            pending = any(w.on_pending is not None for w in waiters)
            await self._read_stored(key, pending=pending)

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
        user_token: str | None = None,
    ) -> ToolResult:
        """One call. Give `user` and `session` (this agent's tenant and name are added),
        or a whole `principal` (whose tenant and agent must be this agent's). Give
        `call_id` to retry a call: its stored result is the answer if it has one.
        `user_token`: the end user's access token (see `publish`); `user` may then be
        left empty: the gateway takes it from the token's `sub`."""
        return await self._submit(
            ToolCall(
                call_id=call_id or new_call_id(),
                tool=tool,
                arguments=arguments,
                principal=principal or self.principal(user, session),
                task_id=task_id,
                context=context or {},
            ),
            timeout,
            on_pending,
            # A call_id minted here is new: no earlier try can have stored a result.
            fresh=call_id is None,
            user_token=user_token,
        )

    async def call_many(self, calls: Sequence[ToolCall], timeout: float = 30.0) -> list[ToolResult]:
        """Several tool calls of one model response, concurrently; results in call order."""
        return list(await asyncio.gather(*(self.submit(c, timeout) for c in calls)))

    async def result(self, call_id: str) -> ToolResult | None:
        """The stored result of `call_id` (of this agent), or None if it has none (yet)."""
        return await self._stored(*self._identity(), call_id)

    async def pending(self, call_id: str) -> tuple[PendingNotice, str | None] | None:
        """The stored `.pending` notice of `call_id` (it waits, or waited, for a human) and
        when it was stored (RFC 3339, if the server says), or None."""
        tenant, agent = self._identity()
        subject = subjects.results_subject(tenant, agent, call_id) + _PENDING_TAIL
        try:
            msg = await self._js.get_last_msg(subjects.RESULTS_STREAM, subject, direct=True)
        except NotFoundError:
            return None
        notice = _decode_pending(msg.data or b"", call_id)
        if notice is None:
            return None
        stamp = msg.headers.get("Nats-Time-Stamp") if msg.headers else None
        return notice, stamp

    async def tool_listing(self, timeout: float = LISTING_TIMEOUT_S) -> ToolListing:
        """The tools this agent may call, as the gateway serves them now (its own listing,
        asked on its own subject: contracts/registry_bundle.py). ListingUnavailable if the
        gateway does not answer or refuses."""
        tenant, agent = self._identity()
        try:
            reply = await self._nc.request(
                subjects.tools_listing_subject(tenant, agent), b"", timeout=timeout
            )
            listing = msgspec.json.decode(reply.data, type=ToolListing)
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError) as exc:
            raise ListingUnavailable(
                f"no tool listing from the gateway for {tenant}.{agent}: {exc!r} (is its "
                "validator running? on a locked bus, creds minted before listings existed "
                "need `toolgate agents add` again)"
            ) from None
        if listing.error is not None or (listing.tenant, listing.agent) != (tenant, agent):
            raise ListingUnavailable(f"the gateway refused the listing: {listing.error}")
        return listing

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
