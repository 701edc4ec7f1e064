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


# The key id of each key a process signs or verifies with, kept with the key itself (so
# its id() is not reused while the entry stands): found once, not per call (the public
# half derived, serialised and hashed on every sign was a sixth of the policy's signing).
_key_ids: dict[int, tuple[Ed25519PrivateKey | Ed25519PublicKey, str]] = {}
_KEY_IDS_KEPT = 16


def _key_id_of(key: Ed25519PrivateKey | Ed25519PublicKey) -> str:
    found = _key_ids.get(id(key))
    if found is not None and found[0] is key:
        return found[1]
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    kid = key_id(public)
    if len(_key_ids) >= _KEY_IDS_KEPT:
        _key_ids.clear()
    _key_ids[id(key)] = (key, kid)
    return kid


def sign(auth: Authorization, private_key: Ed25519PrivateKey) -> Authorization:
    auth = msgspec.structs.replace(auth, key_id=_key_id_of(private_key), signature="")
    signature = private_key.sign(canonical_json(auth))  # its signature is "" already
    return msgspec.structs.replace(auth, signature=base64.b64encode(signature).decode())


def verify(auth: Authorization, public_key: Ed25519PublicKey) -> bool:
    if auth.key_id != _key_id_of(public_key):
        return False  # signed with another key (or not at all): no signature check needed
    try:
        public_key.verify(base64.b64decode(auth.signature, validate=True), _signed_bytes(auth))
    except (InvalidSignature, ValueError):
        return False
    return True


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
