"""Pushing a bundle as the next version: what `toolgate policy push|rollback` and
`toolgate up --example NAME` do with the operator's key, as the operator (admin).

Read the active key's history and the policy service's last accepted bundle,
sign the files with one more than the highest version number found there
(versions.py), and write only if the active key has not changed meanwhile:
two pushes that race never write the same number, and a push never lands
behind a newer one.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from nats.js import JetStreamContext

from toolgate.runtime import bundle_versions
from toolgate.runtime.bundle_versions import BucketState
from toolgate.services.policy.bundle import bundle_version
from toolgate.services.policy.bundle_store import (
    policies_bucket_config,
    policy_accepted_bucket_config,
)
from toolgate.services.policy.signing import POLICY_BUNDLE, StoredBundle

__all__ = ["BucketState", "push_next_version", "read_state"]


async def read_state(js: JetStreamContext) -> BucketState:
    return await bundle_versions.read_state(
        js, policies_bucket_config(), policy_accepted_bucket_config()
    )


async def push_next_version(
    state: BucketState, files: dict[str, str], source: str, private_key: Ed25519PrivateKey
) -> tuple[int, StoredBundle]:
    """Sign `files` as the next version and make it the active one: (revision, bundle).

    nats.js.errors.KeyWrongLastSequenceError if the active key changed since `state`.
    """
    return await bundle_versions.push_next_version(
        POLICY_BUNDLE, state, files, bundle_version(files), source, private_key
    )
