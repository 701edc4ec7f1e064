"""The registry a service uses now: the one the operator pushed, followed without a restart.

`toolgate tools push DIR` signs DIR's tool files with the operator's
registry-signing key (DATA_DIR/keys/registry-signing.key; runtime/signed_bundles.py)
as the next version number and puts them in the KV bucket `toolgate_registry`
(runtime/bundle_bucket.py: the same machinery as policy bundles). Every service that
reads the registry (validator, policy, executor, attacher, approvals, notifier,
audit, the MCP front door) holds a `ServedRegistry`: it starts from the bucket and
watches it, and takes a new version only if it is signed by the operator, builds
into a valid registry, and has a higher number than the one in use. Anything else
(unsigned, another key, tampered, older, the same number again, deleted) is one
ERROR line and the registry in use stays (DESIGN.md invariant 12).

Across restarts the validator keeps the last version it accepted in
`toolgate_registry_accepted` (its high-water mark; no other role writes it): a
service that starts takes the bucket's newest version only if it is not older
than that, else the recorded one. The local registry (the built-in tools and the
`--registry` directories the service was started with) is used only while nothing
was ever pushed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Generic, TypeVar

import msgspec
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from toolgate.contracts import subjects
from toolgate.contracts.registry import Registry, RegistryError
from toolgate.contracts.registry_bundle import registry_from_files
from toolgate.runtime.bundle_bucket import (
    ACTIVE_KEY,
    ActiveEntry,
    BundleUnreadable,
    Following,
    follow,
    record_accepted,
)
from toolgate.runtime.bundle_versions import decode_accepted
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.signed_bundles import (
    BundleKind,
    BundleRefused,
    StoredBundle,
    load_verify_key,
    newer_problem,
    open_stored,
)
from toolgate.runtime.topology import registry_accepted_bucket_config, registry_bucket_config

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

log = logging.getLogger("toolgate.registry")

REGISTRY_BUNDLE = BundleKind(
    domain="toolgate.registry-bundle.v1",
    domain_unnumbered=None,
    key_name="registry-signing",
    push_command="toolgate tools push",
    noun="registry bundle",
)
PUSHED_FROM = "pushed from {directory} by {who}"

T = TypeVar("T")
Listener = Callable[[Registry], Awaitable[None]]


class RegistryStateError(RuntimeError):
    """No trustworthy registry to serve: the service does not start."""


def describe(stored: StoredBundle | None, registry: Registry) -> str:
    """`version 3 (pushed from /srv/tools by alice, registry 1a2b..., signed by key ...)`."""
    if stored is None:
        return f"version 0 (local, registry {registry.version}: used while nothing is pushed)"
    return (
        f"version {stored.number} ({stored.source}, registry {registry.version}, "
        f"signed by key {stored.key_id})"
    )


def served_bundle(
    entry: ActiveEntry | None, accepted: StoredBundle | None, public_key: Ed25519PublicKey | None
) -> tuple[StoredBundle | None, str | None]:
    """The pushed bundle the services serve (None: the local registry, nothing pushed)
    and why the bucket's newest write is refused (None: it is not), from the active key's
    latest entry and the validator's record of what it accepted."""
    stored: StoredBundle | None = None
    refused: str | None = None
    if entry is not None:
        try:
            if entry.deleted:
                raise BundleRefused("it was deleted")
            stored = open_stored(REGISTRY_BUNDLE, entry.value, public_key)
        except BundleRefused as exc:
            refused = str(exc)
    if stored is not None and accepted is not None and stored.number < accepted.number:
        refused = f"its version {stored.number} is older than the served {accepted.number}"
        stored = None
    if stored is None and refused is not None and accepted is not None:
        stored = accepted  # what the services keep serving (the validator's record)
    return stored, refused


def local_differs(served: Registry, local: Registry) -> str | None:
    """A line when the local registry (the --registry directories and built-in tools a
    gateway was started with) is not the pushed one it serves: edits to those files do
    nothing until they are pushed. None when they are the same."""
    if served.version == local.version:
        return None
    return (
        f"not the local registry (registry {local.version}, from --registry and the "
        "built-in tools): the pushed version is served until another is pushed "
        "(`toolgate tools push DIR`)"
    )


class ServedRegistry:
    """The registry in use (`current`), replaced in one assignment by a verified newer one.

    `records`: this service keeps the high-water mark (the validator).
    """

    def __init__(self, settings: GatewaySettings, *, records: bool = False) -> None:
        self.local = settings.load_registry()
        self.builtin_tools = settings.builtin_tools
        self.keys_dir = settings.keys_dir
        self.records = records
        self.current: Registry = self.local
        # The signed bundle in use; None: the local registry (version 0).
        self.stored: StoredBundle | None = None
        self.revision = 0  # the last stored revision judged, used or refused
        self._listeners: list[Listener] = []
        self._following: Following | None = None
        self._accepted_kv: KeyValue | None = None

    @property
    def number(self) -> int:
        return self.stored.number if self.stored is not None else 0

    def describe(self) -> str:
        return describe(self.stored, self.current)

    def on_change(self, listener: Listener) -> None:
        """`listener(registry)` after each new version is in use (the executor's new tools)."""
        self._listeners.append(listener)

    def follow(self, assign: Callable[[Registry], None]) -> None:
        """`assign(registry)` now, and again with each new version in use."""
        assign(self.current)

        async def listener(registry: Registry) -> None:
            assign(registry)

        self.on_change(listener)

    def derive(self, build: Callable[[Registry], T]) -> Derived[T]:
        """What a service builds from the registry (a checker, a builder), rebuilt once per
        version, on first use after a change."""
        return Derived(self, build)

    # ------------------------------------------------------------ judging

    def judge(self, entry: ActiveEntry) -> tuple[Registry, StoredBundle]:
        """The registry of one stored revision, or BundleRefused saying why (one line)."""
        if entry.deleted:
            raise BundleRefused("it was deleted (push a registry to replace it)")
        return self._load(entry.value)

    def _load(self, value: bytes | None) -> tuple[Registry, StoredBundle]:
        key_path = self.keys_dir / REGISTRY_BUNDLE.public_key_file
        try:
            stored = open_stored(
                REGISTRY_BUNDLE, value, load_verify_key(REGISTRY_BUNDLE, self.keys_dir), key_path
            )
            return registry_from_files(stored.files, self.builtin_tools), stored
        except BundleRefused:
            raise
        except RegistryError as exc:
            raise BundleRefused(f"it is not a valid registry: {exc}") from exc
        except Exception as exc:  # anything unforeseen refuses the bundle too
            raise BundleRefused(f"it could not be loaded: {exc!r}") from exc

    def _use(self, registry: Registry, stored: StoredBundle, where_from: str) -> None:
        self.current, self.stored = registry, stored
        log.info(
            "registry %s active (%s, signed at %s)", self.describe(), where_from, stored.signed_at
        )

    def begin(self, entry: ActiveEntry | None, accepted_value: bytes | None) -> None:
        """At start-up: the stored version unless it is older than the recorded high-water
        mark (then the recorded one); the local registry only if nothing was ever pushed."""
        try:
            accepted = decode_accepted(accepted_value)
        except BundleRefused as exc:
            raise RegistryStateError(
                f"the record of the last accepted registry ({subjects.REGISTRY_ACCEPTED_BUCKET}) "
                f"{exc}"
            ) from None
        if entry is None and accepted is None:
            log.info("no registry pushed yet: %s", self.describe())
            return
        problem = "there is none (the key is gone)"
        if entry is not None:
            self.revision = entry.revision
            try:
                registry, stored = self.judge(entry)
            except BundleRefused as exc:
                problem = str(exc)
            else:
                same = accepted is not None and stored.signature == accepted.signature
                newer = newer_problem(REGISTRY_BUNDLE, stored, accepted)
                if same or newer is None:
                    self._use(registry, stored, where(entry))
                    return
                problem = newer
        last_good = None
        if accepted is not None:
            try:
                last_good = self._load(msgspec.json.encode(accepted))
            except BundleRefused as exc:
                log.warning(
                    "the last accepted registry (%s) cannot be used: %s", accepted.number, exc
                )
        if last_good is None:
            raise RegistryStateError(
                f"the stored registry ({subjects.REGISTRY_BUCKET}/{ACTIVE_KEY}) is refused: "
                f"{problem}; push a good one with `toolgate tools push DIR`"
            )
        self.current, self.stored = last_good
        log.error(
            "registry %s refused, keeping %s (the last one accepted): %s",
            subjects.REGISTRY_BUCKET,
            self.describe(),
            problem,
        )

    def offer(self, entry: ActiveEntry) -> bool:
        """A running service: switch to a good newer version (True), else keep the one in use."""
        if entry.revision <= self.revision:
            return False  # judged already (the watch and the periodic re-read both bring it)
        self.revision = entry.revision
        try:
            registry, stored = self.judge(entry)
            problem = newer_problem(REGISTRY_BUNDLE, stored, self.stored)
            if problem is not None:
                raise BundleRefused(f"version {stored.number}: {problem}")
        except BundleRefused as exc:
            log.error("registry %s refused, keeping %s: %s", where(entry), self.describe(), exc)
            return False
        self._use(registry, stored, where(entry))
        return True

    # ------------------------------------------------------------ the bucket

    async def start(self, js: JetStreamContext) -> None:
        """Read the bucket and the high-water mark, take the version to serve, then watch.

        RegistryStateError if neither is readable or nothing stored can be trusted.
        """

        async def begin(entry: ActiveEntry | None, accepted: bytes | None, kv: KeyValue) -> None:
            self.begin(entry, accepted)
            self._accepted_kv = kv
            await self._record()

        async def on_entry(found: ActiveEntry) -> None:
            if self.offer(found):
                await self._record()
                for listener in self._listeners:
                    try:
                        await listener(self.current)
                    except Exception:
                        log.exception("applying registry %s failed", self.describe())

        try:
            self._following = await follow(
                js,
                registry_bucket_config(),
                registry_accepted_bucket_config(),
                begin,
                on_entry,
                "registry",
            )
        except BundleUnreadable as exc:
            raise RegistryStateError(str(exc)) from exc

    async def _record(self) -> None:
        if not self.records or self.stored is None or self._accepted_kv is None:
            return
        try:
            await record_accepted(self._accepted_kv, self.stored)
        except Exception as exc:  # the next new version records again
            log.warning("cannot record registry version %s yet: %r", self.number, exc)

    async def stop(self) -> None:
        if self._following is not None:
            await self._following.stop()


class Derived(Generic[T]):
    """Something built from the registry in use, rebuilt when another version is in use."""

    def __init__(self, served: ServedRegistry, build: Callable[[Registry], T]) -> None:
        self._served = served
        self._build = build
        self._of: Registry | None = None
        self._value: T | None = None

    def __call__(self) -> T:
        registry = self._served.current
        if self._of is not registry or self._value is None:
            self._value = self._build(registry)
            self._of = registry
        return self._value


def where(entry: ActiveEntry) -> str:
    return f"{subjects.REGISTRY_BUCKET}/{ACTIVE_KEY} revision {entry.revision}"


# The exit status of a service that refuses to start (no trustworthy registry).
EXIT_REFUSED = 2


async def start_registry(served: ServedRegistry, js: JetStreamContext) -> None:
    """`served.start(js)` in a service's start-up: refusing ends the process (status 2)
    with one ERROR line saying why, before any call is handled under a stale registry."""
    try:
        await served.start(js)
    except RegistryStateError as exc:
        log.error("not starting: %s", exc)
        raise SystemExit(EXIT_REFUSED) from None
