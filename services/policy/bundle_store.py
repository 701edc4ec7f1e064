"""The active policy bundle in a JetStream KV bucket, watched by every policy replica.

`toolgate policy push DIR` validates and signs a bundle and puts all its
files under one key; each replica watches that key and hands every new
revision to the service, which verifies the signature and the bundle before
it swaps its engine (services/policy/signing.py, app.py). This module only
moves bytes: it never decides whether a value may be used. The bucket keeps
a short history, so an operator can see what was active before and roll back
to it (`toolgate policy rollback`, versions.py).

The policy service's high-water mark, the last bundle it accepted, lives
in a bucket of its own that only the policy role writes (versions.py says why).
"""

from __future__ import annotations

from toolgate.contracts import subjects
from toolgate.runtime.bundle_bucket import (
    ACCEPTED_KEY,
    ACTIVE_KEY,
    ActiveEntry,
    BundleUnreadable,
    Following,
    active_history,
    fetch_accepted,
    fetch_active,
    follow,
    open_bucket,
    push_bundle,
    record_accepted,
    watch_active,
)
from toolgate.runtime.topology import policies_bucket_config, policy_accepted_bucket_config

__all__ = [
    "ACCEPTED_KEY",
    "ACTIVE_KEY",
    "ActiveEntry",
    "BundleUnreadable",
    "Following",
    "active_history",
    "fetch_accepted",
    "fetch_active",
    "follow",
    "open_bucket",
    "policies_bucket_config",
    "policy_accepted_bucket_config",
    "push_bundle",
    "record_accepted",
    "watch_active",
]

POLICIES_BUCKET = subjects.POLICIES_BUCKET
ACCEPTED_BUCKET = subjects.POLICY_ACCEPTED_BUCKET
