"""Binding an authorization to the exact call: canonical hashing and Ed25519 signatures.

The policy service signs each `Authorization` (call_id, tool, SHA-256 of the
canonical arguments, the principal's tenant, agent, user and session, the
task, the policy version, approvals, expiry). The executor checks
the signature and recomputes the hash before it runs anything, so a message
injected onto an executor subject, or one whose arguments changed after the
decision, is refused.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from .events import Authorization

PRIVATE_KEY_FILE = "authorization.key"
PUBLIC_KEY_FILE = "authorization.pub"


def canonical_json(value: Any) -> bytes:
    """Sorted keys, no whitespace, UTF-8: the same arguments always give the same bytes."""
    return msgspec.json.encode(value, order="sorted")


def arguments_sha256(arguments: Any) -> str:
    return hashlib.sha256(canonical_json(arguments)).hexdigest()


def _signed_bytes(auth: Authorization) -> bytes:
    return canonical_json(msgspec.structs.replace(auth, signature=""))


def key_id(public_key: Ed25519PublicKey) -> str:
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign(auth: Authorization, private_key: Ed25519PrivateKey) -> Authorization:
    auth = msgspec.structs.replace(auth, key_id=key_id(private_key.public_key()), signature="")
    signature = private_key.sign(_signed_bytes(auth))
    return msgspec.structs.replace(auth, signature=base64.b64encode(signature).decode())


def verify(auth: Authorization, public_key: Ed25519PublicKey) -> bool:
    try:
        public_key.verify(base64.b64decode(auth.signature, validate=True), _signed_bytes(auth))
    except (InvalidSignature, ValueError):
        return False
    return auth.key_id == key_id(public_key)


def ensure_keypair(keys_dir: Path) -> None:
    """Create the signing key pair once; later callers (other replicas) find it."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    private_path = keys_dir / PRIVATE_KEY_FILE
    if private_path.exists():
        return
    private_key = Ed25519PrivateKey.generate()
    pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    try:
        fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return  # another process won the race; its key stands
    with os.fdopen(fd, "wb") as handle:
        handle.write(pem)
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    tmp = keys_dir / (PUBLIC_KEY_FILE + ".tmp")
    tmp.write_bytes(public_pem)
    tmp.replace(keys_dir / PUBLIC_KEY_FILE)


def load_private_key(keys_dir: Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key((keys_dir / PRIVATE_KEY_FILE).read_bytes(), None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{keys_dir / PRIVATE_KEY_FILE}: not an Ed25519 private key")
    return key


def load_public_key(keys_dir: Path) -> Ed25519PublicKey:
    path = keys_dir / PUBLIC_KEY_FILE
    if not path.exists():
        # The private key may exist while the public file is being renamed into place.
        return load_private_key(keys_dir).public_key()
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key
