"""Publishing: events, results and pending notices, each to a stream with a publish ack.

Always with a `Nats-Msg-Id` derived from the message that caused it, so a
stage that is redelivered its input publishes nothing new (JetStream drops the
duplicate within the stream's duplicate window; the audit dedupes by
`event_id` after). Publishing goes straight to nats-py, not through FastStream.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import msgspec
from faststream.nats import NatsBroker
from nats.aio.client import Client
from nats.js.api import RawStreamMsg
from nats.js.errors import APIError, NotFoundError

from toolgate.contracts import subjects
from toolgate.contracts.calls import (
    REFUSED_HEADER,
    PendingNotice,
    Principal,
    ToolResult,
    answer_headers,
    answered_call,
    call_id_reused,
)
from toolgate.contracts.events import (
    Event,
    encode_event,
)
from toolgate.runtime import emits, telemetry
from toolgate.runtime.jetstream import LeanJetStream

log = logging.getLogger("toolgate")


_json = msgspec.json.Encoder()
# JetStream's answer when a write-once subject (discard new per subject) already holds one.
SUBJECT_FULL_ERR_CODE = 10077
# A plain publish on a stream's subject that no stream stores (each refuses a message
# expecting another stream by name); its subscribers get it.
_NEVER_STORED = {"Nats-Expected-Stream": "toolgate-never-stored"}


# One per connection: the services' Publisher and the KV buckets they write share it.
_lean: weakref.WeakKeyDictionary[Client, LeanJetStream] = weakref.WeakKeyDictionary()


def jetstream(broker: NatsBroker) -> LeanJetStream:
    """The JetStream context of a connected broker's connection (survives reconnects)."""
    connection = broker.connection
    found = _lean.get(connection)
    if found is None:
        found = _lean[connection] = LeanJetStream(connection)
    return found


class Publisher:
    """Publishes events, results and notices, each with a publish ack."""

    def __init__(self, broker: NatsBroker) -> None:
        self._broker = broker
        self._js: LeanJetStream | None = None

    def _jetstream(self) -> LeanJetStream:
        # Looked up once: FastStream's `broker.connection` walks its config
        # layers on every access (5 % of the validator's CPU, profiled), and a
        # connected broker keeps its connection (nats-py reconnects inside it).
        if self._js is None:
            self._js = jetstream(self._broker)
        return self._js

    async def emit(self, event: Event) -> None:
        emits.check(type(event).__name__)
        await self._jetstream().publish(
            subjects.subject_of(event),
            encode_event(event),
            stream=subjects.EVENTS_STREAM,
            headers=telemetry.trace_headers({"Nats-Msg-Id": event.event_id}),
        )
        telemetry.emitted(event)

    async def emit_all(self, events: Sequence[Event]) -> None:
        """Publish several events for one round trip: sent in this order (and stored in
        it: one connection, one stream), then every publish ack awaited. Raises the
        first error, after every ack has come or timed out; a retry publishes them all
        again under the same ids, which the stream drops where it has them."""
        for event in events:
            emits.check(type(event).__name__)
        js = self._jetstream()
        acks = []
        error: BaseException | None = None
        try:
            for event in events:
                acks.append(
                    await js.send(
                        subjects.subject_of(event),
                        encode_event(event),
                        stream=subjects.EVENTS_STREAM,
                        headers=telemetry.trace_headers({"Nats-Msg-Id": event.event_id}),
                    )
                )
        except Exception as exc:
            error = exc
        for ack in acks:  # each awaited, so none is left behind
            try:
                await ack
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        for event in events:
            telemetry.emitted(event)

    async def publish_result(
        self,
        result: ToolResult,
        principal: Principal,
        message_id: str,
        answers: dict[str, str] | None = None,
    ) -> bool:
        """Store the call's one result; False if it already has one (it is never replaced).
        `answers`: the headers naming the call it answers (contracts/calls.py `answer_headers`)."""
        emits.check("ToolResult")
        return await self._publish_once(
            _json.encode(result),
            subjects.results_subject(principal.tenant, principal.agent, result.call_id),
            message_id,
            answers,
        )

    async def publish_pending(
        self,
        notice: PendingNotice,
        principal: Principal,
        message_id: str,
        answers: dict[str, str] | None = None,
    ) -> bool:
        emits.check("PendingNotice")
        return await self._publish_once(
            _json.encode(notice),
            subjects.pending_subject(principal.tenant, principal.agent, notice.call_id),
            message_id,
            answers,
        )

    async def answer_again(
        self,
        principal: Principal,
        call_id: str,
        tool: str = "",
        arguments_sha256: str | None = None,
    ) -> str:
        """Send a retried call's stored answer again, to whoever listens on its subjects now.

        A plain (core NATS) publish of the stored bytes: the retry's subscriber gets
        exactly what the first one got, and the results stream, which holds one message
        per subject, stores nothing new (checked against nats-server: the copy is
        delivered, the stream refuses it). Returns what was sent: "result", "pending"
        (the call waits for a human), or "" (no answer stored yet: the result reaches
        the retry's subscriber when it lands, as it reaches every subscriber).

        The retry's `tool` and `arguments_sha256`, when known, are checked against the
        call the stored answer names (its headers). Another call under the same call_id
        is refused (a ToolResult CALL_ID_REUSED, never stored) once the first call's
        result is stored: "refused". Before that, whoever listens on the result subject
        may be the first call's own caller, whom a refusal would mislead: nothing is sent
        ("another": the answer that lands names the first call, which GatewayClient
        checks, and so must a plain client)."""
        result = subjects.results_subject(principal.tenant, principal.agent, call_id)
        pending = subjects.pending_subject(principal.tenant, principal.agent, call_id)
        # The notice first: a result stored between the two reads is then found too.
        notice = await self._stored(pending)
        stored = await self._stored(result)
        subject, found = (result, stored) if stored is not None else (pending, notice)
        if found is None or found.data is None:
            return ""
        retry = answer_headers(tool, arguments_sha256)
        named = answered_call(found.headers)
        if retry and named is not None and named != (tool, arguments_sha256):
            if stored is None:
                return "another"
            emits.check("ToolResult")
            await self._broker.connection.publish(
                result,
                _json.encode(call_id_reused(call_id, tool)),
                # Never stored, whatever the subject holds: the stream refuses a message
                # that expects another stream (subscribers get it all the same).
                headers={**retry, REFUSED_HEADER: "CALL_ID_REUSED", **_NEVER_STORED},
            )
            return "refused"
        emits.check("ToolResult" if stored is not None else "PendingNotice")
        # With the headers naming its call (a client checks them), none of the store's own.
        await self._broker.connection.publish(
            subject, found.data, headers=answer_headers(*named) if named else None
        )
        return "result" if stored is not None else "pending"

    async def _stored(self, subject: str) -> RawStreamMsg | None:
        try:
            return await self._jetstream().get_last_msg(
                subjects.RESULTS_STREAM, subject, direct=True
            )
        except NotFoundError:
            return None

    async def _publish_once(
        self, body: bytes, subject: str, message_id: str, answers: dict[str, str] | None
    ) -> bool:
        """True if the subject now holds this message (stored now, or by an earlier try)."""
        js = self._jetstream()
        try:
            await js.publish(
                subject,
                body,
                stream=subjects.RESULTS_STREAM,
                headers=telemetry.trace_headers({**(answers or {}), "Nats-Msg-Id": message_id}),
            )
        except APIError as exc:
            if exc.err_code != SUBJECT_FULL_ERR_CODE:
                raise
            # Ours, stored by an attempt that crashed before its ack (beyond the
            # duplicate window), or another message that holds the subject for good?
            stored = await js.get_last_msg(subjects.RESULTS_STREAM, subject, direct=True)
            return (stored.headers or {}).get("Nats-Msg-Id") == message_id
        return True
