"""The approvals service.

Consumes: `ApprovalRequested` (all tools), durable `approvals`: stores the
request's state in the KV bucket `toolgate_approvals` under the call key
`tenant.agent.call_id` (idempotent on redelivery) and publishes a
`PendingNotice` on `toolgate.results.<tenant>.<agent>.<call_id>.pending`.
Answers: approvers, core NATS request/reply on `toolgate.approvals.>`
(whoami, list, show, vote; queue group `approvals`; see protocol.py). Each
request is authenticated by the NATS user the server says sent it and the
approver's token, and sees only the calls of the approver's tenants.
Emits: `ApprovalGranted` (one per approval; the one completing the quorum has
`quorum_reached`, which the policy re-checks into CallAuthorized or
CallDenied), `ApprovalDenied`, `ApprovalExpired` (terminal: the attacher
turns them into results).

Every replica runs an expiry sweeper. It is safe to run many: a request
expires through an optimistic KV update that only one writer wins, and the
event ids are derived from the call key, so a repeat publish is a duplicate.
The KV state is also an outbox: `emitted` counts the events known to be
published; the sweeper publishes whatever a crashed replica left unpublished.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec
from faststream import FastStream
from faststream.nats.message import NatsMessage
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.calls import PendingNotice, answer_headers
from toolgate.contracts.events import ApprovalRequested, decode_event, utc_now
from toolgate.contracts.registry import Registry, ToolSpec
from toolgate.runtime import giving_up, publishing, settling
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner, event_of
from toolgate.services.approvals import protocol
from toolgate.services.approvals.approvers import ApproverBook
from toolgate.services.approvals.logic import (
    SERVICE,
    ApprovalState,
    Approver,
    Ballot,
    InvalidIdentity,
    Refusal,
    VoteOutcome,
    apply_vote,
    events_of,
    expire,
    new_state,
    pending_notice_id,
    same_person,
)
from toolgate.services.approvals.store import ApprovalStore

log = logging.getLogger("toolgate.approvals")

DEFAULT_SWEEP_INTERVAL_S = 5.0
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default; the connection tells the real one

Clock = Callable[[], datetime]


async def _message_itself(msg: NatsMessage) -> NatsMessage:
    """Hand the request handler the message undecoded (the broker runs without FastDepends)."""
    return msg


def refused(code: str, message: str, call: str = "") -> VoteOutcome:
    return VoteOutcome(accepted=False, call=call, code=code, message=message)


def _refusal_for(subject: str) -> Callable[[str, str], msgspec.Struct]:
    """How to say no on `subject`, in that operation's reply shape."""
    if subject == protocol.VOTE_SUBJECT:
        return refused
    if subject == protocol.LIST_SUBJECT:
        return lambda code, message: protocol.ListReply(ok=False, code=code, message=message)
    if subject == protocol.SHOW_SUBJECT:
        return lambda code, message: protocol.ShowReply(ok=False, code=code, message=message)
    if subject == protocol.HISTORY_SUBJECT:
        return lambda code, message: protocol.HistoryReply(ok=False, code=code, message=message)
    return lambda code, message: protocol.WhoamiReply(ok=False, code=code, message=message)


def unknown_call(text: str) -> str:
    # The same words whether the call does not exist or belongs to another tenant.
    return f"no approval was requested for call {text!r} that you may see"


def tool_info_of(spec: ToolSpec | None) -> protocol.ToolInfo | None:
    """What an approver is shown of a tool from the registry (None: not registered)."""
    if spec is None:
        return None
    if spec.mcp is None:
        return protocol.ToolInfo(description=spec.description, risk=spec.risk)
    # A stdio upstream (once the registry has them) is named by its command line.
    command = getattr(spec.mcp, "command", None)
    server = getattr(spec.mcp, "url", None) or " ".join(
        [str(command), *map(str, getattr(spec.mcp, "args", None) or ())] if command else []
    )
    return protocol.ToolInfo(
        description=spec.description,
        risk=spec.risk,
        server=server,
        upstream_tool=spec.mcp.tool,
        pin=spec.mcp.definition_sha256,
    )


def in_history(state: ApprovalState, request: protocol.HistoryRequest) -> bool:
    """Whether a decided call matches the history filters."""
    if state.is_open or state.decided_at is None:
        return False
    if request.tool and state.call.tool != request.tool.strip():
        return False
    if request.decision and state.status != request.decision:
        return False
    if request.approver and not any(same_person(v.approver, request.approver) for v in state.votes):
        return False
    since, until = _aware(request.since), _aware(request.until)
    if since is not None and state.decided_at < since:
        return False
    return not (until is not None and state.decided_at >= until)


def _aware(moment: datetime | None) -> datetime | None:
    """A time without a zone is UTC."""
    if moment is None or moment.tzinfo is not None:
        return moment
    return moment.replace(tzinfo=UTC)


class ApprovalsService:
    """The service's behaviour, independent of how messages reach it."""

    def __init__(
        self,
        publisher: publishing.Publisher,
        book: ApproverBook,
        clock: Clock = utc_now,
        registry: Registry | None = None,
    ) -> None:
        self.publisher = publisher
        self.book = book
        self.clock = clock
        self.registry = registry
        self.store: ApprovalStore | None = None  # bound once the broker is connected
        self.max_reply_bytes = DEFAULT_MAX_PAYLOAD - protocol.REPLY_HEADROOM_BYTES

    def _store(self) -> ApprovalStore:
        if self.store is None:
            raise RuntimeError("the approvals store is not bound yet")
        return self.store

    async def on_requested(self, event: ApprovalRequested) -> None:
        fresh = new_state(event)
        state, revision = await self._store().create(fresh)
        if (
            state.request_event_id != fresh.request_event_id
            and state.arguments_sha256 != fresh.arguments_sha256
        ):
            # The call key is taken by this call's first request: that one stands.
            log.warning(
                "approval request %s for %s ignored: the call already has one "
                "(for other arguments)",
                event.event_id,
                state.key,
            )
        if state.is_open and not state.is_due(self.clock()):
            await self.publisher.publish_pending(
                PendingNotice(
                    call_id=state.call_id,
                    message=f"waiting for {state.required_approvals} human approval(s) "
                    f"of this {state.risk}-risk call",
                    expires_at=state.expires_at.isoformat(),
                    arguments_sha256=state.arguments_sha256,
                ),
                state.call.principal,
                message_id=pending_notice_id(state.key),
                answers=answer_headers(state.call.tool, state.arguments_sha256),
            )
        await self.publish_outbox(state, revision)

    async def holds_approval_for(self, raw: bytes) -> bool:
        """Is an approval stored for the call of this ApprovalRequested? (True when that
        cannot be told: the safe answer for a caller deciding whether to end the call.)"""
        try:
            event = decode_event(raw)
            if not isinstance(event, ApprovalRequested):
                return False
            return await self._store().get(new_state(event).key) is not None
        except InvalidIdentity:
            return False
        except Exception:
            return True

    async def publish_outbox(self, state: ApprovalState, revision: int) -> None:
        """Publish the events `state` stands for that are not known to be out yet."""
        events = events_of(state)
        if state.emitted >= len(events):
            return
        for event in events[state.emitted :]:
            await self.publisher.emit(event)
        done = len(events)

        def mark(current: ApprovalState) -> ApprovalState | None:
            if current.emitted >= done:
                return None
            return msgspec.structs.replace(current, emitted=done)

        await self._store().change(state.key, mark)

    # ------------------------------------------------------------ approvers' requests

    async def handle(
        self, subject: str, raw: bytes, requester: protocol.Requester | None = None
    ) -> msgspec.Struct:
        """Answer one approver request on `subject` (see protocol.py), sent by
        `requester` (the server's word; None: from inside toolgate's account)."""
        fail = _refusal_for(subject)
        decoder = protocol.request_decoders.get(subject)
        if decoder is None:
            return fail(
                Refusal.BAD_REQUEST,
                f"no such operation {subject!r}; one of "
                f"{', '.join(sorted(protocol.request_decoders))}",
            )
        if len(raw) > protocol.MAX_REQUEST_BYTES:
            return fail(Refusal.BAD_REQUEST, "the request is too large")
        try:
            request = decoder.decode(raw)
        except msgspec.DecodeError as exc:
            return fail(Refusal.BAD_REQUEST, f"not a valid request: {exc}")
        approver = self.book.authenticate(request.token)
        if approver is None:
            return fail(Refusal.INVALID_TOKEN, "unknown or invalid approver token")
        if requester is not None and not requester.is_inbox:
            # Who asks is the NATS user the server names, never the payload: the token
            # must be that approver's too.
            if self.book.approver_of_user(requester.user) != approver.name:
                return fail(
                    Refusal.INVALID_TOKEN,
                    "this token is not the approver's whose NATS credentials sent it "
                    "(use the creds `toolgate approvals add-approver` wrote with the token)",
                )
        if isinstance(request, protocol.VoteRequest):
            return await self.vote(approver, request)
        if isinstance(request, protocol.ShowRequest):
            return await self.show(approver, request.call)
        if isinstance(request, protocol.ListRequest):
            return await self.list_pending(approver)
        if isinstance(request, protocol.HistoryRequest):
            return await self.history(approver, request)
        return protocol.WhoamiReply(ok=True, approver=protocol.Identity.of(approver))

    async def resolve(self, approver: Approver, text: str) -> tuple[str | None, str, str]:
        """(call key, "", "") of the call `text` names among those `approver` may see,
        or (None, code, message)."""
        ref = protocol.parse_call_ref(text)
        if ref is None:
            return (
                None,
                Refusal.UNKNOWN_CALL,
                (f"not a call: {text[:200]!r}; give TENANT.AGENT.CALL_ID (or a CALL_ID)"),
            )
        if ref.key is not None:
            assert ref.tenant is not None
            if not approver.may_vote_for(ref.tenant):
                return None, Refusal.UNKNOWN_CALL, unknown_call(text)
            return ref.key, "", ""
        keys = sorted(s.key for s in await self._store().visible_to(approver, ref.call_id))
        if not keys:
            return None, Refusal.UNKNOWN_CALL, unknown_call(text)
        if len(keys) > 1:
            return (
                None,
                Refusal.AMBIGUOUS_CALL,
                (
                    f"call_id {ref.call_id} names {len(keys)} calls (one per agent): give one "
                    f"of {', '.join(keys)}"
                ),
            )
        return keys[0], "", ""

    async def list_pending(self, approver: Approver) -> protocol.ListReply:
        states = await self._store().pending(approver, now=self.clock())
        views: list[protocol.ApprovalView] = []
        size = 512
        for state in states:
            if not approver.may_vote_for(state.tenant):
                continue
            view = self.view(state)
            size += len(protocol.encode(view)) + 1
            if size > self.max_reply_bytes:
                break
            views.append(view)
        omitted = len(states) - len(views)
        return protocol.ListReply(
            ok=True,
            approver=protocol.Identity.of(approver),
            calls=views,
            omitted=omitted,
            message=f"{omitted} more not shown: too large for one reply" if omitted else "",
        )

    async def show(self, approver: Approver, text: str) -> protocol.ShowReply:
        key, code, message = await self.resolve(approver, text)
        if key is None:
            return protocol.ShowReply(ok=False, code=code, message=message)
        found = await self._store().get(key)
        if found is None or not approver.may_vote_for(found[0].tenant):
            return protocol.ShowReply(
                ok=False, code=Refusal.UNKNOWN_CALL, message=unknown_call(text)
            )
        return protocol.ShowReply(ok=True, approval=self.view(found[0]))

    def view(self, state: ApprovalState) -> protocol.ApprovalView:
        spec = self.registry.get(state.call.tool) if self.registry is not None else None
        return protocol.view_of(state, tool_info_of(spec))

    async def history(
        self, approver: Approver, request: protocol.HistoryRequest
    ) -> protocol.HistoryReply:
        """Decided calls of the approver's tenants, latest decision first. They come from
        the KV bucket (file storage, kept RETENTION_S): a restart loses none; older ones
        are in the audit."""
        found = [s for s in await self._store().visible_to(approver) if in_history(s, request)]
        found.sort(key=lambda s: (s.decided_at, s.key), reverse=True)
        limit = max(1, min(request.limit, protocol.HISTORY_LIMIT))
        views: list[protocol.ApprovalView] = []
        size = 512
        for state in found[:limit]:
            if not approver.may_vote_for(state.tenant):
                continue
            view = self.view(state)
            size += len(protocol.encode(view)) + 1
            if size > self.max_reply_bytes:
                break
            views.append(view)
        return protocol.HistoryReply(ok=True, calls=views, omitted=len(found) - len(views))

    async def vote(self, approver: Approver, request: protocol.VoteRequest) -> VoteOutcome:
        if request.approver and not same_person(request.approver, approver.name):
            return refused(
                Refusal.INVALID_TOKEN,
                f"this token does not belong to approver {request.approver!r}",
            )
        key, code, message = await self.resolve(approver, request.call)
        if key is None:
            return refused(code, message)
        ballot = Ballot(
            call_key=key,
            decision=request.decision,
            arguments_sha256=request.arguments_sha256,
            reason=request.reason,
            vote_id=request.vote_id[:128],
        )
        answer: list[VoteOutcome] = []

        def step(state: ApprovalState) -> ApprovalState:
            new, result = apply_vote(state, approver, ballot, self.clock())
            answer[:] = [result]
            return new

        found = await self._store().change(key, step)
        if found is None or answer[0].code == Refusal.NOT_PERMITTED:
            return refused(Refusal.UNKNOWN_CALL, unknown_call(request.call))
        state, revision = found
        # Durable (KV) first, events published second, reply last.
        await self.publish_outbox(state, revision)
        result = answer[0]
        log.info(
            "vote by %s on %s: %s -> %s %s",
            approver.name,
            key,
            request.decision,
            "counted" if result.accepted else "refused",
            result.code or result.status,
        )
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
                log.info("approval of %s expired", state.key)
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


def build_app(
    settings: GatewaySettings,
    *,
    sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
    clock: Clock = utc_now,
) -> FastStream:
    runner = StageRunner(SERVICE, settings)
    broker, publisher = runner.broker, runner.publisher
    served = ServedRegistry(settings)  # the pushed registry, followed
    service = ApprovalsService(
        publisher, ApproverBook(settings.data_dir), clock, registry=served.current
    )

    async def on_requested(msg: Msg, delivery: settling.Delivery) -> None:
        event = event_of(msg.data, ApprovalRequested)
        try:
            await service.on_requested(event)
        except InvalidIdentity as exc:  # no retry can mend it: dead-letter it now
            log.error("approval request %s refused: %s", event.event_id, exc)
            await publisher.emit(giving_up.dead_letter(SERVICE, delivery, msg.data, exc))

    async def give_up(msg: Msg, delivery: settling.Delivery, exc: Exception) -> None:
        # A stored approval still ends the call (approvers vote, the sweeper expires
        # it): telling the agent now that the tool did not run could be wrong later.
        stored = await service.holds_approval_for(msg.data)
        await giving_up.give_up_on(publisher, SERVICE, delivery, msg.data, exc, end_call=not stored)

    durable = runner.durable_for(subjects.event_filter(ApprovalRequested))
    runner.add(Stage(durable, on_requested, give_up=give_up))

    @broker.subscriber(
        protocol.SERVICE_SUBJECTS, queue=protocol.QUEUE_GROUP, decoder=_message_itself
    )
    async def on_request(msg: NatsMessage) -> bytes:
        subject = msg.raw_message.subject
        try:
            requester = protocol.requester_of(msg.raw_message.headers)
            result = await service.handle(subject, msg.body, requester)
        except Exception as exc:  # the approver gets an answer, never silence
            log.exception("request on %s failed", subject)
            result = _refusal_for(subject)(
                Refusal.INTERNAL, f"the request could not be answered, retry: {exc!r}"
            )
        return protocol.encode(result)

    app = runner.app()

    @app.on_startup
    async def bind_store() -> None:
        # Connect before the subscribers start, so no message meets an unbound store.
        await broker.connect()
        service.store = await ApprovalStore.open(broker.connection.jetstream())
        max_payload = broker.connection.max_payload or DEFAULT_MAX_PAYLOAD
        await start_registry(served, broker.connection.jetstream())
        served.follow(lambda registry: setattr(service, "registry", registry))
        service.max_reply_bytes = max(max_payload - protocol.REPLY_HEADROOM_BYTES, 4096)

    @app.on_shutdown
    async def stop_following() -> None:
        await served.stop()

    runner.alongside("expiry-sweep", lambda: service.sweep_forever(sweep_interval_s))
    runner.run_consumers(app)
    return app
