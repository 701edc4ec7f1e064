"""Bundle version numbers only move forward (DESIGN.md invariant 12): pushing the next one.

Pure rules over a bucket's history (`verified`, `next_number`) and the push itself
(`read_state`, `push_next_version`), shared by policy bundles and the served
registry: read the active key's history and the readers' high-water mark, sign the
files with one more than the highest number found there, and write only if the
active key has not changed meanwhile. Two pushes that race never write the same
number, and a push never lands behind a newer one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from toolgate.runtime.bundle_bucket import (
    ActiveEntry,
    active_history,
    fetch_accepted,
    open_bucket,
    push_bundle,
)
from toolgate.runtime.signed_bundles import (
    BundleKind,
    BundleRefused,
    StoredBundle,
    open_stored,
    sign_bundle,
)


def decode_accepted(value: bytes | None) -> StoredBundle | None:
    """A reader's record of its last accepted bundle, not verified; None: none.

    BundleRefused if it is there but not readable.
    """
    if not value:
        return None
    try:
        return msgspec.json.decode(value, type=StoredBundle)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BundleRefused(f"it is not readable: {' '.join(str(exc).split())}") from exc


def verified(
    kind: BundleKind, written: Iterable[ActiveEntry], public_key: Ed25519PublicKey | None
) -> list[tuple[int, StoredBundle]]:
    """(revision, bundle) of each written value that is signed by `public_key`."""
    found: list[tuple[int, StoredBundle]] = []
    if public_key is None:
        return found
    for entry in written:
        if entry.deleted or not entry.value:
            continue
        try:
            found.append((entry.revision, open_stored(kind, entry.value, public_key)))
        except BundleRefused:
            continue  # not the operator's: it counts for nothing
    return found


def next_number(
    kind: BundleKind,
    written: Sequence[ActiveEntry],
    accepted: StoredBundle | None,
    public_key: Ed25519PublicKey,
) -> int:
    """One more than any version the operator's key signed in the bucket's history, and
    than the one the readers last accepted (whatever the bucket says now)."""
    numbers = [stored.number for _, stored in verified(kind, written, public_key)]
    if accepted is not None:
        numbers.append(accepted.number)
    return max(numbers, default=0) + 1


@dataclass(frozen=True)
class BucketState:
    """The active key's history (oldest first) and the readers' high-water mark."""

    kv: KeyValue
    written: list[ActiveEntry]
    accepted: StoredBundle | None

    @property
    def last_revision(self) -> int:
        return self.written[-1].revision if self.written else 0


async def read_state(
    js: JetStreamContext, active: KeyValueConfig, accepted: KeyValueConfig
) -> BucketState:
    kv = await open_bucket(js, active)
    written = await active_history(kv)
    accepted_kv = await open_bucket(js, accepted)
    try:
        record = decode_accepted(await fetch_accepted(accepted_kv))
    except BundleRefused:
        record = None  # unreadable: the readers say so when they start
    return BucketState(kv, written, record)


async def push_next_version(
    kind: BundleKind,
    state: BucketState,
    files: dict[str, str],
    version: str,
    source: str,
    private_key: Ed25519PrivateKey,
) -> tuple[int, StoredBundle]:
    """Sign `files` as the next version and make it the active one: (revision, bundle).

    nats.js.errors.KeyWrongLastSequenceError if the active key changed since `state`.
    """
    number = next_number(kind, state.written, state.accepted, private_key.public_key())
    bundle = sign_bundle(kind, files, version, private_key, number=number, source=source)
    return await push_bundle(state.kv, bundle, last_revision=state.last_revision), bundle
