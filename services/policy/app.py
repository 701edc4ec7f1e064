"""The policy service.

Consumes: `ArgumentsValidated` (all tools), durable `policy`.
Emits: `CallAuthorized` with a signed `Authorization` (to the tool's executor)
or `CallDenied` (to the attacher). Any error while deciding is a deny.
"""

from __future__ import annotations

from datetime import timedelta

from faststream import FastStream
from faststream.nats.message import NatsMessage

from toolgate.contracts import subjects
from toolgate.contracts.authorization import ensure_keypair, load_private_key, sign
from toolgate.contracts.calls import ErrorCode, ToolError
from toolgate.contracts.events import (
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    CallDenied,
    Event,
    carried_fields,
    decode_event,
    derive_event_id,
    utc_now,
)
from toolgate.contracts.registry import Registry
from toolgate.services import bus
from toolgate.services.policy.rules import Decision, PolicyEngine, RegistryRules
from toolgate.services.settings import GatewaySettings

SERVICE = "policy"


def decide_safely(engine: PolicyEngine, registry: Registry, event: ArgumentsValidated) -> Decision:
    try:
        return engine.decide(event.call, registry.get(event.call.tool))
    except Exception as exc:  # fail closed
        return Decision(allowed=False, policy_version=engine.version, policy_ids=[],
                        status="denied", error=ToolError(
                            code=ErrorCode.POLICY_ERROR,
                            message=f"policy evaluation failed: {exc!r}", retryable=False))


def build_app(settings: GatewaySettings) -> FastStream:
    registry = settings.load_registry()
    engine: PolicyEngine = RegistryRules(registry)
    ensure_keypair(settings.keys_dir)
    private_key = load_private_key(settings.keys_dir)
    ttl = timedelta(seconds=settings.authorization_ttl_s)
    broker = bus.make_broker(settings.nats_url, bus.worker_name(SERVICE))
    publisher = bus.Publisher(broker)
    source = subjects.event_filter(ArgumentsValidated)

    def outcome_for(event: ArgumentsValidated, delivery: bus.Delivery) -> Event:
        decision = decide_safely(engine, registry, event)
        now = utc_now()
        fields = carried_fields(event)
        if not decision.allowed:
            return CallDenied(
                event_id=derive_event_id(delivery.message_id, "denied"), occurred_at=now,
                service=SERVICE, status=decision.status,
                error=decision.error or ToolError(code=ErrorCode.POLICY_DENIED, message="denied"),
                policy_version=decision.policy_version, policy_ids=decision.policy_ids, **fields)
        authorization = sign(Authorization(
            call_id=event.call_id, tool=event.call.tool,
            arguments_sha256=event.arguments_sha256 or "",
            policy_version=decision.policy_version, expires_at=now + ttl), private_key)
        return CallAuthorized(
            event_id=derive_event_id(delivery.message_id, "authorized"), occurred_at=now,
            service=SERVICE, call=event.call, policy_version=decision.policy_version,
            policy_ids=decision.policy_ids, authorization=authorization, **fields)

    @bus.durable_subscriber(broker, source, subjects.EVENTS_STREAM, SERVICE)
    async def on_validated(msg: NatsMessage) -> None:
        delivery = bus.delivery_of(msg)

        async def work() -> None:
            event = decode_event(msg.body)
            if not isinstance(event, ArgumentsValidated):
                raise TypeError(f"expected ArgumentsValidated, got {type(event).__name__}")
            await publisher.emit(outcome_for(event, delivery))

        async def give_up(exc: Exception) -> None:
            await publisher.emit(bus.dead_letter(SERVICE, delivery, msg.body, exc))

        await bus.settle(msg, delivery, work, give_up)

    return FastStream(broker)
