"""Signed policy bundles: only what an operator pushed is ever decided under.

`toolgate policy push` signs the bundle's files with the operator's
policy-signing key (Ed25519, DATA_DIR/keys/policy-signing.key, mode 0600,
created on first use); each policy replica verifies the signature with the
public half (DATA_DIR/keys/policy-signing.pub) before it uses a stored
bundle. A value written to the bucket any other way (a raw KV put, a
garbled write, another key) is refused with the reason, never decided under.

The signature covers the bundle's files, its version number, where it came
from, when it was signed and the key id, as canonical JSON behind a fixed
domain tag, so it cannot be confused with any other toolgate signature. The
version number only moves forward (versions.py): nobody without the key can
give an old bundle a new number, and the policy service refuses a number not
higher than the one it has active.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from toolgate.runtime import signed_bundles
from toolgate.runtime.signed_bundles import BundleKind, BundleRefused, StoredBundle

__all__ = ["BundleRefused", "StoredBundle"]

# v1: bundles signed before version numbers (number 0); v2 also covers number and source.
DOMAIN_UNNUMBERED = "toolgate.policy-bundle.v1"
DOMAIN = "toolgate.policy-bundle.v2"
POLICY_BUNDLE = BundleKind(
    domain=DOMAIN,
    domain_unnumbered=DOMAIN_UNNUMBERED,
    key_name="policy-signing",
    push_command="toolgate policy push",
    noun="policy bundle",
)
PRIVATE_KEY_FILE = POLICY_BUNDLE.private_key_file
PUBLIC_KEY_FILE = POLICY_BUNDLE.public_key_file


def signed_bytes(
    files: Mapping[str, str], signed_at: str, signer: str, number: int = 0, source: str = ""
) -> bytes:
    return signed_bundles.signed_bytes(POLICY_BUNDLE, files, signed_at, signer, number, source)


def sign_bundle(
    files: Mapping[str, str],
    version: str,
    private_key: Ed25519PrivateKey,
    now: datetime | None = None,
    number: int = 0,
    source: str = "",
) -> StoredBundle:
    return signed_bundles.sign_bundle(
        POLICY_BUNDLE, files, version, private_key, now, number=number, source=source
    )


def open_stored(
    value: bytes | None, public_key: Ed25519PublicKey | None, key_path: Path | str = PUBLIC_KEY_FILE
) -> StoredBundle:
    """The stored bundle, if it is readable and signed by `public_key`; else BundleRefused."""
    return signed_bundles.open_stored(POLICY_BUNDLE, value, public_key, key_path)


def ensure_signing_key(keys_dir: Path) -> tuple[Ed25519PrivateKey, bool]:
    """The operator's policy-signing key, created (mode 0600) if missing; True if created now."""
    return signed_bundles.ensure_signing_key(POLICY_BUNDLE, keys_dir)


def load_signing_key(keys_dir: Path) -> Ed25519PrivateKey:
    return signed_bundles.load_signing_key(POLICY_BUNDLE, keys_dir)


def load_verify_key(keys_dir: Path) -> Ed25519PublicKey | None:
    """The trusted public key, or None if there is none yet (then no stored bundle is used).

    A file that is there but holds no Ed25519 public key: BundleRefused.
    """
    return signed_bundles.load_verify_key(POLICY_BUNDLE, keys_dir)
