"""The policy service.

Consumes: `ArgumentsValidated` (all tools), durable `policy`; `ApprovalGranted`
(all tools), durable `policy-approvals`, acting only on the vote that
completes the quorum.
Emits: `CallAuthorized` with a signed `Authorization` (to the tool's
executor), `CallDenied` (to the attacher), or `ApprovalRequested` (to the
approvals service) when the policy lets the call run only with approval.

Decisions come from the Cedar bundle stored in the KV bucket
`toolgate_policies`; each replica watches it and swaps its engine when a new
bundle is pushed. Only a bundle signed with the operator's policy-signing
key (signing.py) that loads cleanly is used. The policy state fails closed:
a stored bundle that is unreadable, unsigned, wrongly signed, invalid or
deleted is refused with one ERROR line; a running replica keeps its last
good bundle, a starting one refuses to start (exit status 2). The local
default bundle is used only while nothing was ever pushed. Rate limits are
counted in KV too, so they hold across replicas. Any error while deciding is
a deny.

A tool that declares resources has them looked up first, in parallel, through
the active bundle's entity providers (providers.py; a short cache per replica,
emptied when another bundle becomes active); what they said is passed to the
engine and recorded in the decision event (`resources`), found or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from faststream import FastStream
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.authorization import (
    ensure_keypair,
    load_private_key,
)
from toolgate.contracts.calls import ErrorCode, ToolCall, ToolError
from toolgate.contracts.events import (
    ApprovalGranted,
    ArgumentsValidated,
    Event,
    ResourceSeen,
    decode_event,
    utc_now,
)
from toolgate.contracts.registry import Registry
from toolgate.runtime import bus
from toolgate.runtime.settings import GatewaySettings
from toolgate.services.policy import logic
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    BundleError,
    bundle_version,
    read_bundle_dir,
)
from toolgate.services.policy.bundle_store import (
    ACTIVE_KEY,
    POLICIES_BUCKET,
    ActiveEntry,
    fetch_active,
    open_bucket,
    policies_bucket_config,
    watch_active,
)
from toolgate.services.policy.engine import CedarEngine, engine_from_files
from toolgate.services.policy.providers import EntityResolver
from toolgate.services.policy.rate_limits import (
    RateLimiter,
    rate_limits_bucket_config,
)
from toolgate.services.policy.resources import ResourceProblem, resource_refs
from toolgate.services.policy.rules import Decision
from toolgate.services.policy.signing import (
    PUBLIC_KEY_FILE,
    BundleRefused,
    StoredBundle,
    load_verify_key,
    open_stored,
)

SERVICE = logic.SERVICE
APPROVALS_DURABLE = "policy-approvals"
# The exit status of a policy service that refuses to start (no trustworthy bundle).
EXIT_REFUSED = 2

log = logging.getLogger("toolgate.policy")


class PolicyStateError(RuntimeError):
    """No trustworthy bundle to decide under: the service does not start."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PolicyApp(FastStream):
    """The service as a process: refusing to start ends it with status 2, no traceback.

    The ERROR line saying why was logged already; `async with` / `start()` (tests,
    embedding) still raise PolicyStateError.
    """

    async def run(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().run(*args, **kwargs)
        except PolicyStateError:
            raise SystemExit(EXIT_REFUSED) from None


class ActivePolicy:
    """The engine decisions use; a verified new bundle replaces it in one assignment.

    `engine` starts as the local bundle, used only if nothing was ever pushed.
    """

    def __init__(self, engine: CedarEngine, keys_dir: Path) -> None:
        self.engine = engine
        self.keys_dir = keys_dir
        self.revision = 0  # the last stored revision judged, used or refused

    def judge(self, entry: ActiveEntry) -> tuple[CedarEngine, StoredBundle]:
        """The engine of one stored revision, or BundleRefused saying why (one line)."""
        if entry.deleted:
            raise BundleRefused("it was deleted (push a bundle to replace it)")
        stored = open_stored(
            entry.value, load_verify_key(self.keys_dir), self.keys_dir / PUBLIC_KEY_FILE
        )
        if bundle_version(stored.files) == self.engine.version:
            return self.engine, stored
        try:
            return engine_from_files(stored.files), stored
        except BundleError as exc:
            raise BundleRefused(
                "it is not a valid bundle: " + "; ".join(str(exc).splitlines())
            ) from exc

    def _judged(self, entry: ActiveEntry) -> tuple[CedarEngine, StoredBundle]:
        try:
            return self.judge(entry)
        except BundleRefused:
            raise
        except Exception as exc:  # anything unforeseen refuses the bundle too
            raise BundleRefused(f"it could not be loaded: {exc!r}") from exc

    def start(self, entry: ActiveEntry | None) -> None:
        """At startup: the stored bundle; the local one only if nothing was ever pushed."""
        if entry is None:
            log.info(
                "no policy bundle pushed yet: the local bundle %s is active", self.engine.version
            )
            return
        self.revision = entry.revision
        try:
            engine, stored = self._judged(entry)
        except BundleRefused as exc:
            reason = (
                f"policy service not starting: the stored policy bundle "
                f"({where(entry)}) is refused: {exc}; push a good one with "
                "`toolgate policy push DIR`"
            )
            log.error("%s", reason)
            raise PolicyStateError(reason) from None
        self.engine = engine
        log.info(
            "policy bundle %s active (%s, signed by key %s at %s)",
            engine.version,
            where(entry),
            stored.key_id,
            stored.signed_at,
        )

    def offer(self, entry: ActiveEntry) -> None:
        """A running replica: switch to a good new revision, else keep the engine it has."""
        if entry.revision <= self.revision:
            return  # judged already (the watch and the periodic re-read both bring it)
        self.revision = entry.revision
        try:
            engine, stored = self._judged(entry)
        except BundleRefused as exc:
            log.error(
                "policy bundle %s refused, keeping %s: %s", where(entry), self.engine.version, exc
            )
            return
        if engine is not self.engine:
            self.engine = engine
            log.info(
                "policy bundle %s active (%s, signed by key %s at %s)",
                engine.version,
                where(entry),
                stored.key_id,
                stored.signed_at,
            )


def where(entry: ActiveEntry) -> str:
    return f"{POLICIES_BUCKET}/{ACTIVE_KEY} revision {entry.revision}"


def decide_safely(
    engine: CedarEngine,
    registry: Registry,
    call: ToolCall,
    approvers: Sequence[str] = (),
    resources: Sequence[ResourceSeen] | None = None,
) -> Decision:
    try:
        return engine.decide(call, registry.get(call.tool), approvers, resources)
    except Exception as exc:  # fail closed
        return Decision(
            allowed=False,
            policy_version=engine.version,
            error=ToolError(
                code=ErrorCode.POLICY_ERROR, message=f"policy evaluation failed: {exc!r}"
            ),
        )


class Resolvers:
    """The entity resolver of the active bundle; another bundle gets a new one (empty cache)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.version = ""
        self.current: EntityResolver | None = None
        self._closing: set[asyncio.Task[None]] = set()

    def of(self, engine: CedarEngine) -> EntityResolver:
        if self.current is None or self.version != engine.version:
            if self.current is not None:
                closing = asyncio.create_task(self.current.aclose())
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            self.current = EntityResolver(engine.bundle.settings.entities, self.data_dir)
            self.version = engine.version
        return self.current

    async def look_up(
        self, engine: CedarEngine, registry: Registry, call: ToolCall
    ) -> list[ResourceSeen] | None:
        """What the providers say of the call's resources (None: its tool declares none)."""
        spec = registry.get(call.tool)
        if spec is None or not spec.resources:
            return None
        try:
            refs = resource_refs(call, spec)
        except ResourceProblem:
            return []  # nothing to look up: the engine denies, naming the argument
        return await self.of(engine).resolve(refs, call.principal.tenant)

    async def aclose(self) -> None:
        if self.current is not None:
            await self.current.aclose()


@dataclass
class Stores:
    """What the service keeps in JetStream, bound once the broker is connected."""

    limiter: RateLimiter | None = None
    watching: asyncio.Task[None] | None = None


def build_app(settings: GatewaySettings, policy_dir: Path | None = None) -> FastStream:
    registry = settings.load_registry()
    policy = ActivePolicy(
        engine_from_files(read_bundle_dir(policy_dir or DEFAULT_BUNDLE_DIR)), settings.keys_dir
    )
    ensure_keypair(settings.keys_dir)
    private_key = load_private_key(settings.keys_dir)
    ttl = timedelta(seconds=settings.authorization_ttl_s)
    broker = bus.make_broker(settings.nats_url, bus.worker_name(SERVICE), settings.nats_creds)
    publisher = bus.Publisher(broker)
    stores = Stores()
    resolvers = Resolvers(settings.data_dir)

    signer = logic.Signer(private_key, ttl)

    async def on_validated(event: ArgumentsValidated, delivery: bus.Delivery) -> Event:
        call, now = event.call, utc_now()
        problem = logic.hash_problem(event)
        if problem is not None:
            return logic.refused(
                event,
                delivery.message_id,
                policy.engine.version,
                now,
                ErrorCode.POLICY_DENIED,
                problem,
            )
        engine = policy.engine  # one bundle for the whole decision, even if a push lands
        resources = await resolvers.look_up(engine, registry, call)
        decision = decide_safely(engine, registry, call, resources=resources)
        spec = registry.get(call.tool)
        rate = None
        if logic.needs_rate_check(decision, spec):
            assert spec is not None and spec.rate_limit is not None
            assert stores.limiter is not None
            rate = await stores.limiter.admit(call, spec.rate_limit)
        return logic.after_validation(
            event,
            delivery.message_id,
            decision,
            spec,
            rate,
            signer,
            engine.bundle.settings.approval_ttl_s,
            utc_now(),
            resources,
        )

    async def on_granted(event: ApprovalGranted, delivery: bus.Delivery) -> Event | None:
        if not event.quorum_reached:
            return None  # one vote of several: the approvals service counts them
        problem = logic.hash_problem(event)
        if problem is not None:
            return logic.refused(
                event,
                delivery.message_id,
                policy.engine.version,
                utc_now(),
                ErrorCode.POLICY_DENIED,
                problem,
            )
        # Decided again under the bundle active now, on the resources as they are now:
        # either may have changed since the request.
        engine = policy.engine
        resources = await resolvers.look_up(engine, registry, event.call)
        decision = decide_safely(engine, registry, event.call, event.approvers, resources)
        return logic.after_approval(
            event, delivery.message_id, decision, signer, utc_now(), resources
        )

    def subscribe(
        event_type: type[Event],
        durable: str,
        outcome: Callable[[Any, bus.Delivery], Awaitable[Event | None]],
    ) -> None:
        @bus.durable_subscriber(
            broker, subjects.event_filter(event_type), subjects.EVENTS_STREAM, durable
        )
        async def handle(msg: Msg) -> None:
            delivery = bus.delivery_of(msg)

            async def work() -> None:
                event = decode_event(msg.data)
                if not isinstance(event, event_type):
                    raise TypeError(f"expected {event_type.__name__}, got {type(event).__name__}")
                result = await outcome(event, delivery)
                if result is not None:
                    await publisher.emit(result)

            async def give_up(exc: Exception) -> None:
                await bus.give_up_on(publisher, SERVICE, delivery, msg.data, exc)

            await bus.settle(msg, delivery, work, give_up)

    subscribe(ArgumentsValidated, SERVICE, on_validated)
    subscribe(ApprovalGranted, APPROVALS_DURABLE, on_granted)
    app = PolicyApp(broker)

    @app.on_startup
    async def bind_stores() -> None:
        # Before the subscribers start: no call is decided under a stale bundle
        # or without its rate limiter.
        await broker.connect()
        js = broker.connection.jetstream()
        try:
            try:
                policies_kv = await open_bucket(js, policies_bucket_config())
                entry = await fetch_active(policies_kv)
            except Exception as exc:  # unreadable is refused too, not read as "none"
                reason = (
                    f"policy service not starting: cannot read {POLICIES_BUCKET}/"
                    f"{ACTIVE_KEY}: {exc!r}"
                )
                log.error("%s", reason)
                raise PolicyStateError(reason) from exc
            policy.start(entry)
        except PolicyStateError:
            await broker.stop()
            raise
        stores.limiter = RateLimiter(await open_bucket(js, rate_limits_bucket_config()))
        stores.watching = asyncio.create_task(watch_active(policies_kv, policy.offer))

    @app.on_shutdown
    async def stop_watching() -> None:
        if stores.watching is not None:
            stores.watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stores.watching
        await resolvers.aclose()

    bus.run_consumers(app, broker)
    return app
