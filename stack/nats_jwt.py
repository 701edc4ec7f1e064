"""NATS decentralized auth: operator, account and user JWTs, signed with nkeys.

The format is the one `nsc` writes and nats-server checks (nats-io/jwt v2):
a JWT whose header says `"alg": "ed25519-nkey"`, whose `iss` is the public
nkey of the signer (operator for accounts, account for users) and whose
signature is the signer's Ed25519 signature over `header.payload`. A creds
file is the user JWT followed by the user's seed, in the decorated form every
NATS client (and the `nats` CLI) reads with `--creds`.

Only what toolgate needs is modelled: no signing-key scopes, no activation
tokens (every import is written by the operator itself).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import time
from typing import Any

import nkeys

# Reading creds and claims is the runtime's (clients need it too); minting is ours.
from toolgate.runtime.creds import jwt_claims as decode_claims
from toolgate.runtime.creds import read_creds

__all__ = ["decode_claims", "read_creds"]

_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}

UNLIMITED_ACCOUNT_LIMITS: dict[str, Any] = {
    "subs": -1,
    "data": -1,
    "payload": -1,
    "imports": -1,
    "exports": -1,
    "wildcards": True,
    "conn": -1,
    "leaf": -1,
}
# JetStream enabled, unbounded (the operator's own account only).
UNLIMITED_JETSTREAM: dict[str, Any] = {
    "mem_storage": -1,
    "disk_storage": -1,
    "streams": -1,
    "consumer": -1,
}


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def new_seed(prefix: int) -> str:
    """A fresh nkey seed of the given kind (nkeys.PREFIX_BYTE_OPERATOR / ACCOUNT / USER)."""
    return nkeys.encode_seed(os.urandom(32), prefix).decode()


def public_key(seed: str) -> str:
    pair = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return str(pair.public_key.decode())
    finally:
        pair.wipe()


def encode(
    claims_nats: dict[str, Any],
    *,
    subject: str,
    name: str,
    issuer_seed: str,
    issued_at: int | None = None,
) -> str:
    """Sign a JWT whose `nats` section is `claims_nats`, issued by `issuer_seed`."""
    claims: dict[str, Any] = {
        "jti": "",
        "iat": int(issued_at if issued_at is not None else time.time()),
        "iss": public_key(issuer_seed),
        "name": name,
        "sub": subject,
        "nats": claims_nats,
    }
    # The id is the hash of the claims without it, as nats-io/jwt computes it.
    digest = hashlib.sha512(json.dumps(claims, sort_keys=True).encode()).digest()[:32]
    claims["jti"] = base64.b32encode(digest).decode().rstrip("=")
    signing_input = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    pair = nkeys.from_seed(bytearray(issuer_seed.encode()))
    try:
        signature = pair.sign(signing_input.encode())
    finally:
        pair.wipe()
    return f"{signing_input}.{_b64(signature)}"


def operator_jwt(operator_seed: str, name: str, system_account: str) -> str:
    operator = public_key(operator_seed)
    return encode(
        {"type": "operator", "version": 2, "system_account": system_account},
        subject=operator,
        name=name,
        issuer_seed=operator_seed,
    )


def account_jwt(
    operator_seed: str,
    account_seed: str,
    name: str,
    *,
    jetstream: bool = False,
    imports: list[dict[str, Any]] | None = None,
    exports: list[dict[str, Any]] | None = None,
    revocations: dict[str, int] | None = None,
    limits: dict[str, Any] | None = None,
) -> str:
    all_limits = {
        **UNLIMITED_ACCOUNT_LIMITS,
        **(UNLIMITED_JETSTREAM if jetstream else {}),
        **(limits or {}),
    }
    claims: dict[str, Any] = {"type": "account", "version": 2, "limits": all_limits}
    if imports:
        claims["imports"] = imports
    if exports:
        claims["exports"] = exports
    if revocations:
        claims["revocations"] = revocations
    return encode(claims, subject=public_key(account_seed), name=name, issuer_seed=operator_seed)


def user_jwt(
    account_seed: str,
    user_seed: str,
    name: str,
    *,
    publish: list[str] | None = None,
    subscribe: list[str] | None = None,
    allow_responses: bool = False,
    max_payload: int = -1,
    tags: list[str] | None = None,
    issued_at: int | None = None,
) -> str:
    """A user of the account. `publish`/`subscribe` None: no restriction."""
    claims: dict[str, Any] = {
        "type": "user",
        "version": 2,
        "subs": -1,
        "data": -1,
        "payload": max_payload,
    }
    if publish is not None:
        claims["pub"] = {"allow": publish}
    if subscribe is not None:
        claims["sub"] = {"allow": subscribe}
    if allow_responses:
        claims["resp"] = {"max": 1, "ttl": 0}
    if tags:
        claims["tags"] = tags
    return encode(
        claims,
        subject=public_key(user_seed),
        name=name,
        issuer_seed=account_seed,
        issued_at=issued_at,
    )


def creds_text(user_token: str, user_seed: str, comment: str = "") -> str:
    """The standard decorated creds file (as `nsc generate creds` writes it)."""
    head = "".join(f"# {line}\n" for line in comment.splitlines() if line)
    return (
        f"{head}-----BEGIN NATS USER JWT-----\n{user_token}\n------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        f"-----BEGIN USER NKEY SEED-----\n{user_seed}\n------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )
