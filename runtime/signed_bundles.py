"""Signed, numbered bundles of files: what an operator pushes for every replica to verify.

Policy bundles (services/policy/signing.py) and the served tool registry
(runtime/served_registry.py) are both a set of files an operator signs with a
key of their own (Ed25519, DATA_DIR/keys/<kind>-signing.key, mode 0600,
created on first use); each reader verifies the signature with the public half
(DATA_DIR/keys/<kind>-signing.pub) before it uses a stored bundle. A value
written any other way (a raw KV put, a garbled write, another key) is refused
with the reason, never used.

The signature covers the files, the version number, where they came from, when
they were signed and the key id, as canonical JSON behind a domain tag of the
kind, so a policy bundle can never pass for a registry or the reverse. Version
numbers only move forward (`newer_problem`): nobody without the key can give an
old bundle a new number, and a reader refuses a number not higher than the one
it has active.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class BundleKind:
    """What kind of bundle is signed: its domain tags, its key files, its push command."""

    # Covers files, signed_at, key_id, number and source.
    domain: str
    # Bundles signed before numbers existed (number 0), if the kind ever had them.
    domain_unnumbered: str | None
    # `policy-signing`: the key files are <key_name>.key and <key_name>.pub.
    key_name: str
    # The command that writes such bundles, for messages ("toolgate policy push").
    push_command: str
    # What people call one ("policy bundle", "registry bundle").
    noun: str

    @property
    def private_key_file(self) -> str:
        return f"{self.key_name}.key"

    @property
    def public_key_file(self) -> str:
        return f"{self.key_name}.pub"


class StoredBundle(msgspec.Struct, frozen=True):
    """The value of a bundle bucket's active key: the files and the operator's signature."""

    files: dict[str, str]
    # The content hash, for operators reading the bucket; readers recompute what they need.
    version: str = ""
    # base64 Ed25519 over signed_bytes(); "" for a bundle nobody signed.
    signature: str = ""
    key_id: str = ""
    signed_at: str = ""
    # The version number, covered by the signature: 1 for the first push, one more for
    # each later one. 0: signed before bundles had numbers.
    number: int = 0
    # Where its content came from ("pushed from DIR", "example refund",
    # "rollback: content of version 3"), covered by the signature too.
    source: str = ""


class BundleRefused(Exception):
    """A stored value that must not be used; the message says why, on one line."""


def signed_bytes(
    kind: BundleKind,
    files: Mapping[str, str],
    signed_at: str,
    signer: str,
    number: int = 0,
    source: str = "",
) -> bytes:
    if number == 0 and kind.domain_unnumbered is not None:  # as signed before numbers
        return canonical_json(
            {
                "domain": kind.domain_unnumbered,
                "files": dict(files),
                "signed_at": signed_at,
                "key_id": signer,
            }
        )
    return canonical_json(
        {
            "domain": kind.domain,
            "files": dict(files),
            "signed_at": signed_at,
            "key_id": signer,
            "number": number,
            "source": source,
        }
    )


def sign_bundle(
    kind: BundleKind,
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
    signature = private_key.sign(signed_bytes(kind, files, signed_at, signer, number, source))
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
    kind: BundleKind,
    value: bytes | None,
    public_key: Ed25519PublicKey | None,
    key_path: Path | str | None = None,
) -> StoredBundle:
    """The stored bundle, if it is readable and signed by `public_key`; else BundleRefused."""
    key_path = key_path or kind.public_key_file
    if not value:
        raise BundleRefused("it is empty")
    try:
        stored = msgspec.json.decode(value, type=StoredBundle)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BundleRefused(f"it is not readable: {one_line(str(exc))}") from exc
    if not stored.signature:
        raise BundleRefused(f"it is not signed (only `{kind.push_command}` writes bundles)")
    if public_key is None:
        raise BundleRefused(
            f"there is no {kind.key_name} public key at {key_path} to verify it with"
        )
    trusted = key_id(public_key)
    if stored.key_id != trusted:
        raise BundleRefused(
            f"it is signed by key {stored.key_id[:32]!r}, not by the trusted "
            f"key {trusted} ({key_path})"
        )
    if stored.number == 0 and kind.domain_unnumbered is None:
        raise BundleRefused("it has no version number")
    try:
        public_key.verify(
            base64.b64decode(stored.signature, validate=True),
            signed_bytes(
                kind, stored.files, stored.signed_at, stored.key_id, stored.number, stored.source
            ),
        )
    except (InvalidSignature, ValueError) as exc:
        raise BundleRefused(f"its signature does not verify with key {trusted}") from exc
    return stored


def newer_problem(
    kind: BundleKind, candidate: StoredBundle, active: StoredBundle | None, hint: str = ""
) -> str | None:
    """Why `candidate` may not replace `active` (None: it may): only a higher number may.

    `active` None: nothing signed is active yet, so any verified bundle may.
    """
    if active is None or candidate.number > active.number:
        return None
    return (
        f"its version {candidate.number} is not higher than the active version {active.number}"
        f" (a newer version is a new `{kind.push_command}`{hint})"
    )


def ensure_signing_key(kind: BundleKind, keys_dir: Path) -> tuple[Ed25519PrivateKey, bool]:
    """The operator's signing key of `kind`, created (mode 0600) if missing; True if
    created now."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    private_path = keys_dir / kind.private_key_file
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
    private_key = load_signing_key(kind, keys_dir)
    public_path = keys_dir / kind.public_key_file
    if created or not public_path.exists():
        tmp = keys_dir / f".{kind.public_key_file}.tmp{os.getpid()}"
        tmp.write_bytes(
            private_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )
        tmp.replace(public_path)
    return private_key, created


def load_signing_key(kind: BundleKind, keys_dir: Path) -> Ed25519PrivateKey:
    path = keys_dir / kind.private_key_file
    key = serialization.load_pem_private_key(path.read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path}: not an Ed25519 private key")
    return key


def load_verify_key(kind: BundleKind, keys_dir: Path) -> Ed25519PublicKey | None:
    """The trusted public key, or None if there is none yet (then no stored bundle is used).

    A file that is there but holds no Ed25519 public key: BundleRefused.
    """
    path = keys_dir / kind.public_key_file
    try:
        key = serialization.load_pem_public_key(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise BundleRefused(
            f"the {kind.key_name} public key {path} is not readable: {one_line(str(exc))}"
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise BundleRefused(f"{path} is not an Ed25519 public key")
    return key


def one_line(text: str) -> str:
    return " ".join(text.split())
