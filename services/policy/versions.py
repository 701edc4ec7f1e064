"""Bundle version numbers only move forward (DESIGN.md invariant 12), as pure functions.

Every signed bundle carries a version number that its signature covers
(signing.py): `toolgate policy push` gives it one more than the highest it
can find, and the policy service refuses a bundle whose number is not
higher than the one it has active. So a writer of the policies bucket who
has no signing key can put back an old signed bundle from the bucket's own
history, or delete the key, and nothing changes but an ERROR line.

Across restarts the policy service remembers the last bundle it accepted in
a bucket of its own (`toolgate_policy_accepted`, its high-water mark), which
only the policy role and the operator may write (infra/nats/permissions.yaml):
a bucket writer cannot lower it while the service is down, and a replica
that starts finds there both the number to beat and a good bundle to keep.

Version 0 is a bundle nobody pushed: the built-in default, or the bundle a
service was started with (`--policy DIR`, an example's); it is used only
while nothing was ever pushed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from toolgate.runtime import bundle_versions
from toolgate.services.policy.bundle import bundle_version
from toolgate.services.policy.bundle_store import ActiveEntry
from toolgate.services.policy.signing import (
    POLICY_BUNDLE,
    BundleRefused,
    StoredBundle,
    open_stored,
)

# The `source` of a bundle by how it was made (signed with it).
PUSHED_FROM = "pushed from {directory}"
EXAMPLE = "example {name}"
ROLLBACK = "rollback: content of version {number}"


def describe(stored: StoredBundle) -> str:
    """`version 3 (pushed from /srv/policy, bundle 1a2b..., signed by key 9f8e...)`."""
    source = stored.source or ("signed before bundle versions" if stored.number == 0 else "?")
    return (
        f"version {stored.number} ({source}, bundle {bundle_version(stored.files)}, "
        f"signed by key {stored.key_id})"
    )


def describe_local(version: str, source: str) -> str:
    return f"version 0 ({source}, bundle {version}, not signed: used while nothing is pushed)"


def decode_accepted(value: bytes | None) -> StoredBundle | None:
    """The policy service's record of its last accepted bundle, not verified; None: none.

    BundleRefused if it is there but not readable.
    """
    return bundle_versions.decode_accepted(value)


def newer_problem(candidate: StoredBundle, active: StoredBundle | None) -> str | None:
    """Why `candidate` may not replace `active` (None: it may): only a higher number may.

    `active` None: nothing signed is active yet, so any verified bundle may.
    """
    if active is None or candidate.number > active.number:
        return None
    return (
        f"its version {candidate.number} is not higher than the active version {active.number}"
        " (a newer version is a new `toolgate policy push`, or "
        f"`toolgate policy rollback {candidate.number}`)"
    )


def verified(
    written: Iterable[ActiveEntry], public_key: Ed25519PublicKey | None
) -> list[tuple[int, StoredBundle]]:
    """(revision, bundle) of each written value that is signed by `public_key`."""
    return bundle_versions.verified(POLICY_BUNDLE, written, public_key)


def next_number(
    written: Sequence[ActiveEntry], accepted: StoredBundle | None, public_key: Ed25519PublicKey
) -> int:
    """One more than any version the operator's key signed in the bucket's history, and
    than the one the policy service last accepted (whatever the bucket says now)."""
    return bundle_versions.next_number(POLICY_BUNDLE, written, accepted, public_key)


def find_version(
    written: Sequence[ActiveEntry], number: int, public_key: Ed25519PublicKey
) -> StoredBundle | None:
    """The bundle the operator's key signed as version `number`, from the bucket's history."""
    found = [stored for _, stored in verified(written, public_key) if stored.number == number]
    return found[-1] if found else None


def expected_active(
    written: Sequence[ActiveEntry],
    accepted: StoredBundle | None,
    public_key: Ed25519PublicKey | None,
) -> tuple[StoredBundle | None, str | None]:
    """What a policy replica starting now would decide under (None: its local bundle), and
    why the bucket's newest write is not it (None: it is, or there is none).

    The same rule as the service's (app.py ActivePolicy.start), without loading Cedar.
    """
    trusted: StoredBundle | None = None
    if accepted is not None and public_key is not None:
        try:
            trusted = open_stored(msgspec.json.encode(accepted), public_key)
        except BundleRefused:
            trusted = None  # signed by a key no longer trusted: only its number counts
    if not written:
        return trusted, None
    newest = written[-1]
    if newest.deleted:
        problem: str | None = "it was deleted"
    else:
        try:
            stored = open_stored(newest.value, public_key)
        except BundleRefused as exc:
            problem = str(exc)
        else:
            if accepted is not None and stored.signature == accepted.signature:
                return stored, None
            problem = newer_problem(stored, accepted)
            if problem is None:
                return stored, None
    if accepted is None:
        return None, problem
    return trusted, problem


def active_line(
    written: Sequence[ActiveEntry],
    accepted: StoredBundle | None,
    public_key: Ed25519PublicKey | None,
    local_version: str,
    local_source: str,
) -> str:
    """One line for `toolgate up` and `toolgate status`: the bundle policy replicas decide
    under, where it came from and who signed it, and a newer write they refuse."""
    active, problem = expected_active(written, accepted, public_key)
    if active is None:
        if problem is not None:
            return (
                f"none: the stored bundle is refused ({problem}); a policy replica starts "
                "only once a good one is pushed (`toolgate policy push DIR`)"
            )
        return describe_local(local_version, local_source)
    if problem is not None:
        return f"{describe(active)}; the bucket's newest write is refused: {problem}"
    return describe(active)
