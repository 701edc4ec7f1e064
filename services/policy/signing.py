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

import base64
import os
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from toolgate.contracts.authorization import canonical_json, key_id

PRIVATE_KEY_FILE = "policy-signing.key"
PUBLIC_KEY_FILE = "policy-signing.pub"
# v1: bundles signed before version numbers (number 0); v2 also covers number and source.
DOMAIN_UNNUMBERED = "toolgate.policy-bundle.v1"
DOMAIN = "toolgate.policy-bundle.v2"


class StoredBundle(msgspec.Struct, frozen=True):
    """The value of the active key: a bundle's files and the operator's signature."""

    files: dict[str, str]
    # The content hash, for operators reading the bucket; replicas recompute it.
    version: str = ""
    # base64 Ed25519 over signed_bytes(); "" for a bundle nobody signed.
    signature: str = ""
    key_id: str = ""
    signed_at: str = ""
    # The bundle's version number, covered by the signature: 1 for the first push, one
    # more for each later one. 0: signed before bundles had numbers.
    number: int = 0
    # Where its content came from ("pushed from DIR", "example refund",
    # "rollback: content of version 3"), covered by the signature too.
    source: str = ""


class BundleRefused(Exception):
    """A stored value that must not be decided under; the message says why, on one line."""


def signed_bytes(
    files: Mapping[str, str], signed_at: str, signer: str, number: int = 0, source: str = ""
) -> bytes:
    if number == 0:  # as signed before bundles had numbers
        return canonical_json(
            {
                "domain": DOMAIN_UNNUMBERED,
                "files": dict(files),
                "signed_at": signed_at,
                "key_id": signer,
            }
        )
    return canonical_json(
        {
            "domain": DOMAIN,
            "files": dict(files),
            "signed_at": signed_at,
            "key_id": signer,
            "number": number,
            "source": source,
        }
    )


def sign_bundle(
    files: Mapping[str, str],
    version: str,
    private_key: Ed25519PrivateKey,
    now: datetime | None = None,
    number: int = 0,
    source: str = "",
) -> StoredBundle:
    if number < 0:
        raise ValueError(f"a bundle's version number is 1 or more, not {number}")
    signed_at = (now or datetime.now(UTC)).isoformat()
    signer = key_id(private_key.public_key())
    signature = private_key.sign(signed_bytes(files, signed_at, signer, number, source))
    return StoredBundle(
        files=dict(files),
        version=version,
        signature=base64.b64encode(signature).decode(),
        key_id=signer,
        signed_at=signed_at,
        number=number,
        source=source,
    )


def open_stored(
    value: bytes | None, public_key: Ed25519PublicKey | None, key_path: Path | str = PUBLIC_KEY_FILE
) -> StoredBundle:
    """The stored bundle, if it is readable and signed by `public_key`; else BundleRefused."""
    if not value:
        raise BundleRefused("it is empty")
    try:
        stored = msgspec.json.decode(value, type=StoredBundle)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BundleRefused(f"it is not readable: {_one_line(str(exc))}") from exc
    if not stored.signature:
        raise BundleRefused("it is not signed (only `toolgate policy push` writes bundles)")
    if public_key is None:
        raise BundleRefused(
            f"there is no policy-signing public key at {key_path} to verify it with"
        )
    trusted = key_id(public_key)
    if stored.key_id != trusted:
        raise BundleRefused(
            f"it is signed by key {stored.key_id[:32]!r}, not by the trusted "
            f"key {trusted} ({key_path})"
        )
    try:
        public_key.verify(
            base64.b64decode(stored.signature, validate=True),
            signed_bytes(
                stored.files, stored.signed_at, stored.key_id, stored.number, stored.source
            ),
        )
    except (InvalidSignature, ValueError) as exc:
        raise BundleRefused(f"its signature does not verify with key {trusted}") from exc
    return stored


def ensure_signing_key(keys_dir: Path) -> tuple[Ed25519PrivateKey, bool]:
    """The operator's policy-signing key, created (mode 0600) if missing; True if created now."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    private_path = keys_dir / PRIVATE_KEY_FILE
    created = False
    if not private_path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        try:
            fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass  # another push won the race; its key stands
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(pem)
            created = True
    private_key = load_signing_key(keys_dir)
    public_path = keys_dir / PUBLIC_KEY_FILE
    if created or not public_path.exists():
        tmp = keys_dir / f".{PUBLIC_KEY_FILE}.tmp{os.getpid()}"
        tmp.write_bytes(
            private_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        tmp.replace(public_path)
    return private_key, created


def load_signing_key(keys_dir: Path) -> Ed25519PrivateKey:
    path = keys_dir / PRIVATE_KEY_FILE
    key = serialization.load_pem_private_key(path.read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def load_verify_key(keys_dir: Path) -> Ed25519PublicKey | None:
    """The trusted public key, or None if there is none yet (then no stored bundle is used).

    A file that is there but holds no Ed25519 public key: BundleRefused.
    """
    path = keys_dir / PUBLIC_KEY_FILE
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise BundleRefused(
            f"the policy-signing public key {path} is not readable: {_one_line(str(exc))}"
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise BundleRefused(f"{path} is not an Ed25519 public key")
    return key


def _one_line(text: str) -> str:
    return " ".join(text.split())
