"""LeanJetStream: nats-py's JetStream context with a leaner `publish`.

Shared by the services (through `runtime.publishing`) and by `GatewayClient` (every
platform's client, and the MCP front door's): nothing here needs FastStream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import APIError, NoStreamResponseError

from toolgate.runtime import acking


class _PubAckReply(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool = False
    error: dict[str, Any] | None = None


_pub_ack = msgspec.json.Decoder(_PubAckReply)


class LeanJetStream(JetStreamContext):
    """nats-py's JetStream context with a leaner `publish` (the one the services,
    and the KV buckets they write through it, use per message).

    nats-py's publish is a generic request: a random token per request
    (`secrets.token_hex`), `wait_for`, `json.loads` and a PubAck dataclass built
    from the answer; profiled, that was a fifth of the validator's and the
    attacher's own CPU. Here the publish acks come back on one subscription
    (this connection's inbox prefix + a counter), and are decoded with msgspec.
    Errors are nats-py's own (APIError with its err_code, TimeoutError), so
    callers and KeyValue cannot tell the difference.
    """

    def __init__(self, connection: Client) -> None:
        super().__init__(connection)
        self._replies: dict[str, asyncio.Future[Msg]] = {}
        self._reply_prefix = ""
        self._listening: asyncio.Future[None] | None = None
        self._count = 0

    async def _listen(self) -> None:
        prefix = self._nc.new_inbox() + "."
        await self._nc.subscribe(prefix + "*", cb=self._on_reply)
        self._reply_prefix = prefix

    async def _on_reply(self, msg: Msg) -> None:
        future = self._replies.get(msg.subject[len(self._reply_prefix) :])
        if future is not None and not future.done():
            future.set_result(msg)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> PubAck:
        if msg_ttl is not None:
            return await super().publish(subject, payload, timeout, stream, headers, msg_ttl)
        return await (await self.send(subject, payload, timeout, stream, headers))

    async def send(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
    ) -> Coroutine[Any, Any, PubAck]:
        """Publish now; what it returns, awaited, is the publish ack (or its error).

        Messages sent one after the other go out in that order on this connection,
        and their acks can be awaited together: several stored messages for one
        round trip (`Publisher.emit_all`). The returned coroutine must be awaited
        (its reply is forgotten then, or when it times out)."""
        if not self._reply_prefix:
            if self._listening is None:
                self._listening = asyncio.ensure_future(self._listen())
            listening = self._listening
            try:
                # Shielded: a publish cancelled here (a tool's timeout, a shutdown) must
                # not cancel the one subscription every later publish waits for.
                await asyncio.shield(listening)
            except BaseException:
                if listening.done() and self._listening is listening:
                    self._listening = None  # it failed: the next publish subscribes again
                raise
        headers = dict(headers) if headers else {}
        if stream is not None:
            headers["Nats-Expected-Stream"] = stream
        self._count += 1
        token = str(self._count)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Msg] = loop.create_future()
        self._replies[token] = reply
        # A timer on the future itself: asyncio.wait_for's extra waiter and
        # callbacks were 7-8% of the executor's and the attacher's CPU.
        timer = loop.call_later(timeout or self._timeout, _time_out, reply)
        try:
            await acking.send_held(self._nc)  # acks held on this connection: in this write
            await self._nc.publish(
                subject, payload, reply=self._reply_prefix + token, headers=headers or None
            )
        except BaseException:
            timer.cancel()
            self._replies.pop(token, None)
            raise
        return self._acked(token, reply, timer)

    async def _acked(
        self, token: str, reply: asyncio.Future[Msg], timer: asyncio.TimerHandle
    ) -> PubAck:
        try:
            msg = await reply
        finally:
            timer.cancel()
            self._replies.pop(token, None)
        if not msg.data and msg.headers and msg.headers.get("Status") == "503":
            raise NoStreamResponseError
        answer = _pub_ack.decode(msg.data)
        if answer.error is not None:
            APIError.from_error(answer.error)  # raises the matching APIError
        return PubAck(
            stream=answer.stream, seq=answer.seq, domain=answer.domain, duplicate=answer.duplicate
        )


def ack_subject_fields(reply: str | None) -> tuple[str, str, int, int] | None:
    """(stream, consumer, delivery count, stream sequence) of a delivered message, read
    from its ack subject; None if it is not one. Read here directly: nats-py's
    `Msg.metadata` parses it into several objects, 2-5% of every stage's CPU (profiled).
    The layout (ADR-15): $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<tm>.<pending>
    or, with domain and account, $JS.ACK.<domain>.<hash>.<stream>...<pending>.<token>."""
    tokens = (reply or "").split(".")
    if len(tokens) not in (9, 12) or tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    at = 2 if len(tokens) == 9 else 4
    return tokens[at], tokens[at + 1], int(tokens[at + 2]), int(tokens[at + 3])


def _time_out(reply: asyncio.Future[Msg]) -> None:
    if not reply.done():
        reply.set_exception(nats.errors.TimeoutError())
