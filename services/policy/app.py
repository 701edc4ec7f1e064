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
key (signing.py) that loads cleanly and whose version number is higher than
the active one's (versions.py) is used. The policy state fails closed: a
stored bundle that is unreadable, unsigned, wrongly signed, invalid, deleted,
older or of the same version is refused with one ERROR line and the last
good bundle stays: in a running replica, and in a starting one too, from the
service's record of the last bundle it accepted (bucket
`toolgate_policy_accepted`, which it alone writes). A starting replica with
no good bundle at all refuses to start (exit status 2). The local default
bundle is used only while nothing was ever pushed. Rate limits are
counted in KV too, so they hold across replicas. Any error while deciding is
a deny.

A tool that declares resources has them looked up first, in parallel, through
the active bundle's entity providers (providers.py; a short cache per replica,
emptied when another bundle becomes active); what they said is passed to the
engine and recorded in the decision event (`resources`), found or not.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import msgspec
from faststream import FastStream
from nats.aio.msg import Msg
from nats.js.kv import KeyValue

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
    utc_now,
)
from toolgate.contracts.registry import Registry
from toolgate.runtime import settling
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner, event_of
from toolgate.services.policy import logic, versions
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    BundleError,
    bundle_version,
    read_bundle_dir,
)
from toolgate.services.policy.bundle_store import (
    ACCEPTED_BUCKET,
    ACTIVE_KEY,
    POLICIES_BUCKET,
    ActiveEntry,
    BundleUnreadable,
    Following,
    follow,
    open_bucket,
    policies_bucket_config,
    policy_accepted_bucket_config,
    record_accepted,
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

    `engine` starts as the local bundle (version 0), used only if nothing was ever
    pushed. A stored bundle replaces the active one only if it is signed by the
    operator, loads, and has a higher version number (versions.py); anything else is
    one ERROR line naming both versions, and the active bundle stays.
    """

    def __init__(
        self, engine: CedarEngine, keys_dir: Path, local_source: str = "built-in default"
    ) -> None:
        self.engine = engine
        self.keys_dir = keys_dir
        self.local_source = local_source
        self.revision = 0  # the last stored revision judged, used or refused
        # The signed bundle in use; None: the local one (version 0).
        self.accepted: StoredBundle | None = None
        # The highest version written to the accepted-bundle record (-1: none yet).
        self.recorded = -1

    def describe(self) -> str:
        if self.accepted is None:
            return versions.describe_local(self.engine.version, self.local_source)
        return versions.describe(self.accepted)

    @property
    def to_record(self) -> StoredBundle | None:
        """The accepted bundle, if the high-water mark does not say so yet."""
        if self.accepted is not None and self.accepted.number > self.recorded:
            return self.accepted
        return None

    def judge(self, entry: ActiveEntry) -> tuple[CedarEngine, StoredBundle]:
        """The engine of one stored revision, or BundleRefused saying why (one line)."""
        if entry.deleted:
            raise BundleRefused("it was deleted (push a bundle to replace it)")
        return self._load(entry.value)

    def _load(self, value: bytes | None) -> tuple[CedarEngine, StoredBundle]:
        stored = open_stored(value, load_verify_key(self.keys_dir), self.keys_dir / PUBLIC_KEY_FILE)
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

    def _last_good(self, accepted: StoredBundle) -> tuple[CedarEngine, StoredBundle] | None:
        """The recorded bundle, if it still verifies and loads (a rotated key: it does not)."""
        try:
            return self._load(msgspec.json.encode(accepted))
        except Exception as exc:
            log.warning("the last accepted bundle (%s) cannot be used: %s", accepted.number, exc)
            return None

    def _use(self, engine: CedarEngine, stored: StoredBundle, where_from: str) -> None:
        self.engine, self.accepted = engine, stored
        log.info(
            "policy bundle %s active (%s, signed at %s)",
            self.describe(),
            where_from,
            stored.signed_at,
        )

    def start(self, entry: ActiveEntry | None, accepted_value: bytes | None = None) -> None:
        """At startup: the stored bundle if it is newer than the last one the policy service
        accepted (`accepted_value`, its high-water mark), else that last one; the local
        bundle only if nothing was ever pushed or accepted."""
        try:
            accepted = versions.decode_accepted(accepted_value)
        except BundleRefused as exc:
            self._refuse_start(f"the record of the last accepted bundle ({ACCEPTED_BUCKET}) {exc}")
        if accepted is not None:
            self.recorded = accepted.number
        if entry is None and accepted is None:
            log.info("no policy bundle pushed yet: %s is active", self.describe())
            return
        problem = "there is none (the key is gone)"
        if entry is not None:
            self.revision = entry.revision
            try:
                engine, stored = self._judged(entry)
            except BundleRefused as exc:
                problem = str(exc)
            else:
                same = accepted is not None and stored.signature == accepted.signature
                newer = versions.newer_problem(stored, accepted)
                if same or newer is None:
                    self._use(engine, stored, where(entry))
                    return
                problem = newer
        stored_at = where(entry) if entry is not None else f"{POLICIES_BUCKET}/{ACTIVE_KEY}"
        last_good = self._last_good(accepted) if accepted is not None else None
        if last_good is None:
            self._refuse_start(
                f"the stored policy bundle ({stored_at}) is refused: {problem}; push a good "
                "one with `toolgate policy push DIR`"
            )
        engine, stored = last_good
        self.engine, self.accepted = engine, stored
        log.error(
            "policy bundle %s refused, keeping %s (the last one accepted, from %s): %s",
            stored_at,
            self.describe(),
            ACCEPTED_BUCKET,
            problem,
        )

    def _refuse_start(self, why: str) -> NoReturn:
        reason = f"policy service not starting: {why}"
        log.error("%s", reason)
        raise PolicyStateError(reason) from None

    def offer(self, entry: ActiveEntry) -> None:
        """A running replica: switch to a good newer version, else keep the engine it has."""
        if entry.revision <= self.revision:
            return  # judged already (the watch and the periodic re-read both bring it)
        self.revision = entry.revision
        try:
            engine, stored = self._judged(entry)
            problem = versions.newer_problem(stored, self.accepted)
            if problem is not None:
                raise BundleRefused(f"version {stored.number}: {problem}")
        except BundleRefused as exc:
            log.error(
                "policy bundle %s refused, keeping %s: %s", where(entry), self.describe(), exc
            )
            return
        self._use(engine, stored, where(entry))


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
    following: Following | None = None  # the active bundle, watched
    accepted: KeyValue | None = None  # the high-water mark (versions.py)


async def record(policy: ActivePolicy, stores: Stores) -> None:
    """Raise the high-water mark to the bundle just accepted; on failure, the next watch
    round (at most REFRESH_S away) tries again."""
    bundle = policy.to_record
    if bundle is None or stores.accepted is None:
        return
    try:
        await record_accepted(stores.accepted, bundle)
    except Exception as exc:
        log.warning("cannot record version %s in %s yet: %r", bundle.number, ACCEPTED_BUCKET, exc)
        return
    policy.recorded = max(policy.recorded, bundle.number)


def build_app(settings: GatewaySettings, policy_dir: Path | None = None) -> FastStream:
    served = ServedRegistry(settings)  # the pushed registry, followed (runtime/served_registry.py)
    policy = ActivePolicy(
        engine_from_files(read_bundle_dir(policy_dir or DEFAULT_BUNDLE_DIR)),
        settings.keys_dir,
        "built-in default" if policy_dir is None else f"local bundle {policy_dir}",
    )
    ensure_keypair(settings.keys_dir)
    private_key = load_private_key(settings.keys_dir)
    ttl = timedelta(seconds=settings.authorization_ttl_s)
    runner = StageRunner(SERVICE, settings)
    broker, publisher = runner.broker, runner.publisher
    stores = Stores()
    resolvers = Resolvers(settings.data_dir)

    signer = logic.Signer(private_key, ttl)

    async def on_validated(event: ArgumentsValidated, delivery: settling.Delivery) -> Event:
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
        registry = served.current  # one registry too
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
            # hash_problem found the event's hash to be the arguments': not computed again
            checked_sha256=event.arguments_sha256,
        )

    async def on_granted(event: ApprovalGranted, delivery: settling.Delivery) -> Event | None:
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
        registry = served.current
        resources = await resolvers.look_up(engine, registry, event.call)
        decision = decide_safely(engine, registry, event.call, event.approvers, resources)
        return logic.after_approval(
            event,
            delivery.message_id,
            decision,
            signer,
            utc_now(),
            resources,
            checked_sha256=event.arguments_sha256,  # as hash_problem found it
        )

    def stage(
        event_type: type[Event],
        outcome: Callable[[Any, settling.Delivery], Awaitable[Event | None]],
    ) -> Stage:
        async def work(msg: Msg, delivery: settling.Delivery) -> None:
            event = event_of(msg.data, event_type)
            result = await outcome(event, delivery)
            if result is not None:
                await publisher.emit(result)

        return Stage(runner.durable_for(subjects.event_filter(event_type)), work)

    runner.add(stage(ArgumentsValidated, on_validated))
    runner.add(stage(ApprovalGranted, on_granted))
    app = runner.app(PolicyApp)

    @app.on_startup
    async def bind_stores() -> None:
        # Before the subscribers start: no call is decided under a stale bundle
        # or without its rate limiter.
        await broker.connect()
        js = broker.connection.jetstream()

        async def begin(entry: ActiveEntry | None, accepted: bytes | None, kv: KeyValue) -> None:
            stores.accepted = kv
            policy.start(entry, accepted)
            await record(policy, stores)

        async def on_entry(entry: ActiveEntry) -> None:
            policy.offer(entry)
            await record(policy, stores)  # also retries a record that failed before

        try:
            try:
                stores.following = await follow(
                    js,
                    policies_bucket_config(),
                    policy_accepted_bucket_config(),
                    begin,
                    on_entry,
                    "policy bundle",
                )
            except BundleUnreadable as exc:
                reason = f"policy service not starting: {exc}"
                log.error("%s", reason)
                raise PolicyStateError(reason) from exc
        except PolicyStateError:
            await broker.stop()
            raise
        await start_registry(served, js)
        stores.limiter = RateLimiter(await open_bucket(js, rate_limits_bucket_config()))

    @app.on_shutdown
    async def stop_watching() -> None:
        if stores.following is not None:
            await stores.following.stop()
        await resolvers.aclose()
        await served.stop()

    runner.run_consumers(app)
    return app
