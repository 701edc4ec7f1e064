"""Pushing a bundle as the next version: what `toolgate policy push|rollback` and
`toolgate up --example NAME` do with the operator's key, as the operator (admin).

Read the active key's history and the policy service's last accepted bundle,
sign the files with one more than the highest version number found there
(versions.py), and write only if the active key has not changed meanwhile:
two pushes that race never write the same number, and a push never lands
behind a newer one.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from toolgate.services.policy import versions
from toolgate.services.policy.bundle import bundle_version
from toolgate.services.policy.bundle_store import (
    ActiveEntry,
    active_history,
    fetch_accepted,
    open_bucket,
    policies_bucket_config,
    policy_accepted_bucket_config,
    push_bundle,
)
from toolgate.services.policy.signing import BundleRefused, StoredBundle, sign_bundle


@dataclass(frozen=True)
class BucketState:
    """The active key's history (oldest first) and the policy service's high-water mark."""

    kv: KeyValue
    written: list[ActiveEntry]
    accepted: StoredBundle | None

    @property
    def last_revision(self) -> int:
        return self.written[-1].revision if self.written else 0


async def read_state(js: JetStreamContext) -> BucketState:
    kv = await open_bucket(js, policies_bucket_config())
    written = await active_history(kv)
    accepted_kv = await open_bucket(js, policy_accepted_bucket_config())
    try:
        accepted = versions.decode_accepted(await fetch_accepted(accepted_kv))
    except BundleRefused:
        accepted = None  # unreadable: the policy service says so when it starts
    return BucketState(kv, written, accepted)


async def push_next_version(
    state: BucketState, files: dict[str, str], source: str, private_key: Ed25519PrivateKey
) -> tuple[int, StoredBundle]:
    """Sign `files` as the next version and make it the active one: (revision, bundle).

    nats.js.errors.KeyWrongLastSequenceError if the active key changed since `state`.
    """
    number = versions.next_number(state.written, state.accepted, private_key.public_key())
    bundle = sign_bundle(files, bundle_version(files), private_key, number=number, source=source)
    return await push_bundle(state.kv, bundle, last_revision=state.last_revision), bundle
