"""The approvals service.

Consumes: `ApprovalRequested` (all tools), durable `approvals`: stores the
request's state in the KV bucket `toolgate_approvals` (idempotent on
redelivery) and publishes a `PendingNotice` on `toolgate.results.<call_id>.pending`.
Answers: votes, core NATS request/reply on `toolgate.approvals.vote`
(queue group `approvals`; see protocol.py).
Emits: `ApprovalGranted` (one per approval; the one completing the quorum has
`quorum_reached`, which the policy re-checks into CallAuthorized or
CallDenied), `ApprovalDenied`, `ApprovalExpired` (terminal: the attacher
turns them into results).

Every replica runs an expiry sweeper. It is safe to run many: a request
expires through an optimistic KV update that only one writer wins, and the
event ids are derived from the call_id, so a repeat publish is a duplicate.
The KV state is also an outbox: `emitted` counts the events known to be
published; the sweeper publishes whatever a crashed replica left unpublished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from datetime import datetime

import msgspec
from faststream import FastStream
from faststream.nats.message import NatsMessage

from toolgate.contracts import subjects
from toolgate.contracts.calls import PendingNotice, is_valid_call_id
from toolgate.contracts.events import ApprovalRequested, decode_event, utc_now
from toolgate.services import bus
from toolgate.services.approvals import protocol
from toolgate.services.approvals.approvers import ApproverBook
from toolgate.services.approvals.logic import (
    SERVICE,
    ApprovalState,
    Ballot,
    Refusal,
    VoteOutcome,
    apply_vote,
    events_of,
    expire,
    new_state,
    pending_notice_id,
    same_person,
)
from toolgate.services.approvals.store import ApprovalStore, ensure_bucket
from toolgate.services.settings import GatewaySettings

log = logging.getLogger("toolgate.approvals")

DEFAULT_SWEEP_INTERVAL_S = 5.0

Clock = Callable[[], datetime]


async def _message_itself(msg: NatsMessage) -> NatsMessage:
    """Hand the vote handler the message undecoded (the broker runs without FastDepends)."""
    return msg


def refused(code: str, message: str) -> VoteOutcome:
    return VoteOutcome(accepted=False, code=code, message=message)


class ApprovalsService:
    """The service's behaviour, independent of how messages reach it."""

    def __init__(self, publisher: bus.Publisher, book: ApproverBook,
                 clock: Clock = utc_now) -> None:
        self.publisher = publisher
        self.book = book
        self.clock = clock
        self.store: ApprovalStore | None = None  # bound once the broker is connected

    def _store(self) -> ApprovalStore:
        if self.store is None:
            raise RuntimeError("the approvals store is not bound yet")
        return self.store

    async def on_requested(self, event: ApprovalRequested) -> None:
        state, revision = await self._store().create(new_state(event))
        if state.is_open and not state.is_due(self.clock()):
            await self.publisher.publish_pending(PendingNotice(
                call_id=state.call_id,
                message=f"waiting for {state.required_approvals} human approval(s) "
                        f"of this {state.risk}-risk call",
                expires_at=state.expires_at.isoformat()),
                state.call.principal, message_id=pending_notice_id(state.call_id))
        await self.publish_outbox(state, revision)

    async def publish_outbox(self, state: ApprovalState, revision: int) -> None:
        """Publish the events `state` stands for that are not known to be out yet."""
        events = events_of(state)
        if state.emitted >= len(events):
            return
        for event in events[state.emitted:]:
            await self.publisher.emit(event)
        done = len(events)

        def mark(current: ApprovalState) -> ApprovalState | None:
            if current.emitted >= done:
                return None
            return msgspec.structs.replace(current, emitted=done)

        await self._store().change(state.call_id, mark)

    async def vote(self, raw: bytes) -> VoteOutcome:
        if len(raw) > protocol.MAX_REQUEST_BYTES:
            return refused(Refusal.BAD_REQUEST, "the vote request is too large")
        try:
            request = protocol.request_decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return refused(Refusal.BAD_REQUEST, f"not a vote request: {exc}")
        approver = self.book.authenticate(request.token)
        if approver is None:
            return refused(Refusal.INVALID_TOKEN, "unknown or invalid approver token")
        if request.approver and not same_person(request.approver, approver.name):
            return refused(Refusal.INVALID_TOKEN,
                           f"this token does not belong to approver {request.approver!r}")
        if not is_valid_call_id(request.call_id):
            return refused(Refusal.UNKNOWN_CALL, "not a call id")
        ballot = Ballot(call_id=request.call_id, decision=request.decision,
                        arguments_sha256=request.arguments_sha256, reason=request.reason,
                        vote_id=request.vote_id[:128])
        answer: list[VoteOutcome] = []

        def step(state: ApprovalState) -> ApprovalState:
            new, result = apply_vote(state, approver, ballot, self.clock())
            answer[:] = [result]
            return new

        found = await self._store().change(request.call_id, step)
        if found is None:
            return refused(Refusal.UNKNOWN_CALL,
                           f"no approval was requested for call {request.call_id}")
        state, revision = found
        # Durable (KV) first, events published second, reply last.
        await self.publish_outbox(state, revision)
        result = answer[0]
        log.info("vote by %s on %s: %s -> %s %s", approver.name, request.call_id,
                 request.decision, "counted" if result.accepted else "refused",
                 result.code or result.status)
        return result

    async def sweep_once(self) -> int:
        """Expire what is due and publish what is unpublished. Returns how many expired."""
        store = self._store()
        expired = 0
        for state, revision in await store.snapshot():
            now = self.clock()
            due = expire(state, now)
            if due is not None:
                written = await store.update(due, revision)
                if written is None:
                    continue  # a vote or another replica got there first: next sweep looks
                state, revision = due, written
                expired += 1
                log.info("approval of %s expired", state.call_id)
            if state.unpublished:
                await self.publish_outbox(state, revision)
        return expired

    async def sweep_forever(self, interval_s: float) -> None:
        while True:
            try:
                await self.sweep_once()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS down, say: try again next round
                log.warning("expiry sweep failed: %r", exc)
            # Jitter, so replicas started together do not sweep in lock-step.
            await asyncio.sleep(interval_s * random.uniform(0.8, 1.2))


def build_app(settings: GatewaySettings, *, sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
              clock: Clock = utc_now) -> FastStream:
    broker = bus.make_broker(settings.nats_url, bus.worker_name(SERVICE), settings.nats_creds)
    publisher = bus.Publisher(broker)
    service = ApprovalsService(publisher, ApproverBook(settings.data_dir), clock)
    source = subjects.event_filter(ApprovalRequested)

    @bus.durable_subscriber(broker, source, subjects.EVENTS_STREAM, SERVICE)
    async def on_requested(msg: NatsMessage) -> None:
        delivery = bus.delivery_of(msg)

        async def work() -> None:
            event = decode_event(msg.body)
            if not isinstance(event, ApprovalRequested):
                raise TypeError(f"expected ApprovalRequested, got {type(event).__name__}")
            await service.on_requested(event)

        async def give_up(exc: Exception) -> None:
            await publisher.emit(bus.dead_letter(SERVICE, delivery, msg.body, exc))

        await bus.settle(msg, delivery, work, give_up)

    @broker.subscriber(protocol.VOTE_SUBJECT, queue=protocol.QUEUE_GROUP,
                       decoder=_message_itself)
    async def on_vote(msg: NatsMessage) -> bytes:
        try:
            result = await service.vote(msg.body)
        except Exception as exc:  # the voter gets an answer, never silence
            log.exception("vote failed")
            result = refused(Refusal.INTERNAL, f"the vote could not be applied, retry: {exc!r}")
        return protocol.encode(result)

    app = FastStream(broker)
    sweeper: list[asyncio.Task[None]] = []

    @app.on_startup
    async def bind_store() -> None:
        # Connect before the subscribers start, so no message meets an unbound store.
        await broker.connect()
        service.store = ApprovalStore(await ensure_bucket(broker.connection.jetstream()))

    @app.after_startup
    async def start_sweeper() -> None:
        sweeper.append(asyncio.create_task(service.sweep_forever(sweep_interval_s)))

    @app.on_shutdown
    async def stop_sweeper() -> None:
        for task in sweeper:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return app
