"""The end user's access token on its way from the validator to the executor, sealed.

A call may wait hours for a human before its tool runs, and the tool may need the
user's token then (RFC 8693 token exchange). The validator, which verified the token,
seals it with AES-256-GCM under a key only the validator and the executor read
(DATA_DIR/keys/user-token-seal.key, mode 0600), with the call's key
(tenant.agent.call_id) as associated data, and stores the ciphertext in the KV
bucket `toolgate_user_tokens` under that call key. The executor opens it just before
the tool runs, into `ToolContext.subject_token`, and deletes the entry once the tool
has run. Nothing else reads the bucket (infra/nats/permissions.yaml), no event
carries the token or its ciphertext, so the audit never sees either.

A sealed token moved to another call's key does not open (the associated data
differs); a changed ciphertext does not open (GCM's tag). The threat model is in
docs/users-oidc.md, "Where the token goes, and who can read it".
"""

from __future__ import annotations

import base64
import contextlib
import os
import secrets
from pathlib import Path
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

SEAL_KEY_FILE: Final = "user-token-seal.key"
_VERSION: Final = b"v1."
_NONCE_BYTES: Final = 12


class SealBroken(ValueError):
    """The sealed token does not open with this key for this call."""


def ensure_seal_key(keys_dir: Path) -> bytes:
    """The sealing key, created once (mode 0600) by whichever process comes first."""
    path = Path(keys_dir) / SEAL_KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{SEAL_KEY_FILE}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(base64.b64encode(secrets.token_bytes(32)))
    try:
        os.link(tmp, path)  # atomic: a reader finds no file or a whole key
    except FileExistsError:
        pass  # another process won the race; its key stands
    finally:
        tmp.unlink()
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    key = base64.b64decode(path.read_bytes().strip())
    if len(key) != 32:
        raise ValueError(f"{path} does not hold a 256-bit key")
    return key


def seal(key: bytes, token: str, call_key: str) -> bytes:
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return _VERSION + nonce + AESGCM(key).encrypt(nonce, token.encode(), call_key.encode())


def open_sealed(key: bytes, sealed: bytes, call_key: str) -> str:
    if not sealed.startswith(_VERSION):
        raise SealBroken("not a sealed token")
    body = sealed[len(_VERSION) :]
    try:
        plain = AESGCM(key).decrypt(body[:_NONCE_BYTES], body[_NONCE_BYTES:], call_key.encode())
    except InvalidTag:
        raise SealBroken("the sealed token does not open for this call") from None
    return plain.decode()


class SealedTokens:
    """The bucket of sealed tokens, by call key."""

    def __init__(self, kv: KeyValue, key: bytes) -> None:
        self._kv = kv
        self._key = key

    async def put(self, call_key: str, token: str) -> None:
        await self._kv.put(call_key, seal(self._key, token, call_key))

    async def take(self, call_key: str) -> str | None:
        """The token sealed for this call, opened; None if none is stored (or it was
        deleted after the tool ran). SealBroken if it does not open."""
        try:
            entry = await self._kv.get(call_key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return open_sealed(self._key, entry.value, call_key)

    async def forget(self, call_key: str) -> None:
        with contextlib.suppress(KeyNotFoundError):
            await self._kv.purge(call_key)
