"""The validator service.

Consumes: `toolgate.calls.<tenant>.<agent>` (raw `ToolCall` JSON from agents),
durable `validator`. The tenant and agent are the subject's: the server let
only that agent's identity publish there.
Emits: `ArgumentsValidated` (to policy), `ArgumentsRejected` (to the attacher:
unknown tool, malformed call, bad arguments, oversized call, a payload naming
another principal), `MessageDeadLettered` for a message with no usable
call_id, and `CallRetried` for a call_id its agent used before.
With an OIDC issuer (`--oidc-issuer`): the call's `Authorization: Bearer <JWT>`
header is verified (runtime/oidc.py, users.py), the principal's user becomes the
token's `sub`, and for a tool that acts for the user the token is sealed into the
KV bucket `toolgate_user_tokens` for the executor (runtime/user_tokens.py).
A call_id this agent used before is a duplicate: it claims nothing and
nothing runs or is decided again; it emits `CallRetried`, on which the
attacher sends the first call's stored result (or pending notice) again.

Fair admission (services/validator/admission.py): before any work, a call
takes one of its agent's slots in the pipeline, waiting for one in its agent's
room, or nak'ed for later when the room is full. The slot is given back when
the call's `ResultAttached` (or `ApprovalRequested`) goes by, heard on a plain
subscription to those subjects; a call that sends nothing downstream gives it
back at once.

The registry is the one the gateway serves (runtime/served_registry.py): followed
without a restart when `toolgate tools push` stores a newer signed version; the
validator alone records the last version accepted. It also answers each agent's
request for its own tool listing on `toolgate.tools.<tenant>.<agent>` (queue group
`validator`): the agent is the subject's, as for calls.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import msgspec
from faststream import FastStream
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ToolCall
from toolgate.contracts.events import (
    ArgumentsRejected,
    ArgumentsValidated,
    CallRetried,
    Event,
    MessageDeadLettered,
    call_fields,
    derive_event_id,
    payload_sha256,
    utc_now,
)
from toolgate.contracts.registry_bundle import ToolListing, listing_for
from toolgate.runtime import consumers, giving_up, publishing, settling
from toolgate.runtime.oidc import (
    OidcConfig,
    ProviderUnreachable,
    TokenRejected,
    TokenVerifier,
    bearer_token,
)
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner
from toolgate.runtime.user_tokens import SealedTokens, ensure_seal_key
from toolgate.services.validator.admission import (
    DEFAULT_WAITING_TOTAL,
    FairAdmission,
    Slot,
    in_flight_from_env,
)
from toolgate.services.validator.call_ids import CallIdClaims
from toolgate.services.validator.logic import (
    CallChecker,
    CheckOutcome,
    Identity,
    Rejected,
    Undeliverable,
    Validated,
)
from toolgate.services.validator.users import TokenCheck, user_verdict

SERVICE = "validator"
log = logging.getLogger("toolgate.validator")
# The events that say a call has left the pipeline's queues (its slot is free).
RELEASE_EVENTS = ("ResultAttached", "ApprovalRequested")
# Un-acked calls the validator may hold: its handler slots, its waiting rooms and
# the calls nak'ed for later (they stay pending until redelivered and acked).
MAX_ACK_PENDING = 20_000


class _CallOf(msgspec.Struct):
    """The little of an event that names its call."""

    call_id: str = ""
    principal: dict[str, Any] | None = None


_call_of = msgspec.json.Decoder(_CallOf)


@dataclass
class Held:
    """A call's slot in fair admission, while its message is handled."""

    slot: Slot
    inside: bool = False  # did the call go downstream (its end frees the slot)?


# The slot of the call this task handles (set by the admission gate, read by the work).
_held: ContextVar[Held] = ContextVar("validator_held")


def released_key(data: bytes) -> str | None:
    """tenant.agent.call_id of the call a release event names (None if it names none)."""
    try:
        found = _call_of.decode(data)
    except msgspec.DecodeError:
        return None
    p = found.principal or {}
    tenant, agent = p.get("tenant"), p.get("agent")
    if not found.call_id or not isinstance(tenant, str) or not isinstance(agent, str):
        return None
    return subjects.call_key(tenant, agent, found.call_id)


def identity_of(subject: str) -> Identity | None:
    found = subjects.identity_of_calls_subject(subject)
    return Identity(*found) if found else None


def events_for(outcome: CheckOutcome, raw: bytes, delivery: settling.Delivery) -> list[Event]:
    def eid(kind: str) -> str:
        return derive_event_id(delivery.message_id, kind)

    now = utc_now()
    if isinstance(outcome, Validated):
        call = outcome.call
        return [
            ArgumentsValidated(
                event_id=eid("validated"),
                occurred_at=now,
                service=SERVICE,
                call=call,
                **hashed_call_fields(call),
            )
        ]
    events: list[Event] = []
    reason = outcome.dead_letter_reason if isinstance(outcome, Rejected) else outcome.reason
    call_id = outcome.call_id if isinstance(outcome, Rejected) else ""
    if reason:
        events.append(
            MessageDeadLettered(
                event_id=eid("dead-letter"),
                occurred_at=now,
                service=SERVICE,
                call_id=call_id,
                reason=reason,
                source_subject=delivery.subject,
                payload_bytes=len(raw),
                payload_sha256=payload_sha256(raw),
            )
        )
    if isinstance(outcome, Rejected):
        fields = (
            hashed_call_fields(outcome.call)
            if outcome.call
            else {"call_id": outcome.call_id, "principal": outcome.principal}
        )
        events.append(
            ArgumentsRejected(
                event_id=eid("rejected"),
                occurred_at=now,
                service=SERVICE,
                status=outcome.status,
                error=outcome.error,
                **fields,
            )
        )
    return events


def build_app(settings: GatewaySettings) -> FastStream:
    # The served registry (runtime/served_registry.py): the validator keeps its high-water mark.
    served = ServedRegistry(settings, records=True)
    checker = served.derive(lambda registry: CallChecker(registry, settings.max_call_bytes))
    runner = StageRunner(SERVICE, settings)
    broker, publisher = runner.broker, runner.publisher
    claims: list[CallIdClaims] = []  # bound once the broker is connected
    verifier = oidc_verifier(settings)
    sealed: list[SealedTokens] = []  # bound once the broker is connected (with an issuer)
    admission = FairAdmission(in_flight=in_flight_from_env())

    @contextlib.asynccontextmanager
    async def admitted(msg: Msg, delivery: settling.Delivery) -> AsyncIterator[bool]:
        slot = await admission.enter(delivery.subject, len(msg.data))
        if slot is None:  # its agent's room is full: later, and on to the next agent's
            await msg.nak(delay=admission.later(delivery.subject))
            yield False
            return
        held = Held(slot)
        _held.set(held)
        try:
            yield True
        finally:
            if not held.inside:
                admission.release(slot)

    async def on_call(msg: Msg, delivery: settling.Delivery) -> None:
        raw: bytes = msg.data
        held = _held.get()
        identity = identity_of(delivery.subject)
        outcome: CheckOutcome = (
            checker().check(raw, identity)
            if identity is not None
            else Undeliverable(f"{delivery.subject!r} is not a calls subject")
        )
        token: str | None = None
        if verifier is not None and isinstance(outcome, Validated):
            token = bearer_token((msg.headers or {}).get("Authorization"))
            check = await check_token(verifier, token)
            spec = checker().registry.get(outcome.call.tool)
            verdict = user_verdict(outcome, spec, check, settings.oidc_tenant_claim)
            outcome = verdict.outcome
            if not verdict.token_for_tool:
                token = None
        if isinstance(outcome, Validated | Rejected) and identity is not None:
            key = subjects.call_key(identity.tenant, identity.agent, outcome_call_id(outcome))
            if not await claims[0].claim(key, delivery.message_id):
                log.info(
                    "call %s: duplicate call_id from %s.%s, nothing runs again; "
                    "the attacher answers it again",
                    outcome_call_id(outcome),
                    identity.tenant,
                    identity.agent,
                )
                await publisher.emit(retried(outcome, delivery))
                return
            if token is not None and isinstance(outcome, Validated):
                await sealed[0].put(key, token)  # before the call goes on: never after
            # Bound before anything is emitted, so its end cannot come first.
            admission.bind(held.slot, key)
        for event in events_for(outcome, raw, delivery):
            await publisher.emit(event)
        held.inside = isinstance(outcome, Validated | Rejected)

    async def give_up(msg: Msg, delivery: settling.Delivery, exc: Exception) -> None:
        raw: bytes = msg.data
        call = call_named(checker(), raw, delivery)
        if call and not await owns_call(claims[0], call, delivery):
            call = {}  # a duplicate: the call is the first message's to end, not this one's
        await giving_up.give_up_on(publisher, SERVICE, delivery, raw, exc, call=call)

    runner.add(
        Stage(
            runner.durable_for(subjects.CALLS_FILTER),
            on_call,
            give_up=give_up,
            gate=admitted,
            concurrency=consumers.CONCURRENCY + DEFAULT_WAITING_TOTAL,
            max_ack_pending=MAX_ACK_PENDING,
        )
    )

    app = runner.app()

    async def on_release(msg: Msg) -> None:
        key = released_key(msg.data)
        if key is not None:
            admission.finished(key)

    async def on_listing(msg: Msg) -> None:
        # The agent is who the server let publish on this subject (its own, on a locked bus).
        if msg.reply:  # a plain publish asks nothing
            await msg.respond(listing_reply(served, msg.subject))

    @app.on_startup
    async def bind_claims() -> None:
        nc = await broker.connect()
        await start_registry(served, publishing.jetstream(broker))
        await nc.subscribe(
            f"{subjects.TOOLS_PREFIX}.*.*", queue=SERVICE, cb=on_listing, pending_msgs_limit=-1
        )
        claims.append(
            CallIdClaims(await publishing.jetstream(broker).key_value(subjects.CALL_IDS_BUCKET))
        )
        if verifier is not None:
            kv = await publishing.jetstream(broker).key_value(subjects.USER_TOKENS_BUCKET)
            sealed.append(SealedTokens(kv, ensure_seal_key(settings.keys_dir)))
        for kind in RELEASE_EVENTS:
            await nc.subscribe(
                f"{subjects.EVENTS_PREFIX}.{kind}.*",
                cb=on_release,
                pending_msgs_limit=-1,
                pending_bytes_limit=-1,
            )

    @app.on_shutdown  # before the consumers stop: waiting calls go back at once
    async def close_gate() -> None:
        admission.close()
        await served.stop()

    runner.run_consumers(app)
    return app


def listing_reply(served: ServedRegistry, subject: str) -> bytes:
    """The ToolListing of the agent whose tools subject this is (contracts/registry_bundle.py)."""
    identity = subjects.identity_of_tools_subject(subject)
    if identity is None:
        listing = ToolListing(
            tenant="", agent="", version="", number=0, tools=[], error="not an agent's subject"
        )
    else:
        listing = listing_for(served.current, identity[0], identity[1], served.number)
    return msgspec.json.encode(listing)


def oidc_verifier(settings: GatewaySettings) -> TokenVerifier | None:
    """The end-user token verifier, when an issuer is configured."""
    if not settings.oidc_issuer:
        return None
    if not settings.oidc_audience:
        log.warning(
            "OIDC issuer %s without an audience (--oidc-audience): a token the issuer "
            "made for any other service is accepted too",
            settings.oidc_issuer,
        )
    return TokenVerifier(
        OidcConfig(
            settings.oidc_issuer,
            settings.oidc_audience,
            settings.oidc_tenant_claim,
            settings.oidc_clock_skew_s,
        )
    )


async def check_token(verifier: TokenVerifier, token: str | None) -> TokenCheck:
    """The verifier's answer as a value (its refusals are expected, not errors)."""
    if token is None:
        return None
    try:
        return await verifier.verify(token)
    except TokenRejected as exc:
        return exc
    except ProviderUnreachable as exc:
        now = time.monotonic()
        if now - _provider_warned[0] >= 10:  # one line per 10 s in an outage, not per call
            _provider_warned[0] = now
            log.warning("the OIDC provider could not be reached (calls are refused): %s", exc)
        return exc


_provider_warned = [-1e9]


def call_named(checker: CallChecker, raw: bytes, delivery: settling.Delivery) -> dict[str, Any]:
    """The event fields of the call a message names (empty if it names none): what a
    give-up needs to end that call in an error result."""
    identity = identity_of(delivery.subject)
    try:
        outcome = checker.check(raw, identity) if identity is not None else None
    except Exception:  # the check itself may be what kept failing
        return {}
    if isinstance(outcome, Validated):
        return call_fields(outcome.call)
    if isinstance(outcome, Rejected):
        if outcome.call is not None:
            return call_fields(outcome.call)
        return {"call_id": outcome.call_id, "principal": outcome.principal}
    return {}


async def owns_call(
    claims: CallIdClaims, call: dict[str, Any], delivery: settling.Delivery
) -> bool:
    """Does this message own the call it names (it claimed the call_id, now or before)?"""
    try:
        principal = call["principal"]
        key = subjects.call_key(principal.tenant, principal.agent, call["call_id"])
        return await claims.claim(key, delivery.message_id)
    except Exception:  # cannot tell: leave the call to whoever owns it
        return False


def hashed_call_fields(call: ToolCall) -> dict[str, Any]:
    """The call columns of an event of `call`, with the hash of its arguments (what an
    approval binds, and what the attacher names an answer's call by)."""
    return {**call_fields(call), "arguments_sha256": arguments_sha256(call.arguments)}


def retried(outcome: Validated | Rejected, delivery: settling.Delivery) -> CallRetried:
    """The event that has the attacher answer a duplicate call_id again."""
    call = outcome.call
    fields: dict[str, Any]
    if call is not None:  # what the attacher checks the stored answer's call against
        fields = hashed_call_fields(call)
    else:
        assert isinstance(outcome, Rejected)  # a Validated outcome always has its call
        fields = {"call_id": outcome.call_id, "principal": outcome.principal}
    return CallRetried(
        event_id=derive_event_id(delivery.message_id, "retried"),
        occurred_at=utc_now(),
        service=SERVICE,
        **fields,
    )


def outcome_call_id(outcome: Validated | Rejected) -> str:
    return outcome.call.call_id if isinstance(outcome, Validated) else outcome.call_id
