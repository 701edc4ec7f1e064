from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import msgspec

from toolgate.contracts.authorization import (
    arguments_sha256,
    ensure_keypair,
    load_private_key,
    load_public_key,
    sign,
    verify,
)
from toolgate.contracts.events import Authorization, utc_now


def authorization(**changes: object) -> Authorization:
    auth = Authorization(
        call_id="c1",
        tool="save_evidence",
        arguments_sha256=arguments_sha256({"a": 1}),
        policy_version="v1",
        expires_at=utc_now() + timedelta(minutes=5),
        tenant="acme",
        agent="researcher",
        user="u-alice",
        session="s-1",
        task_id="task-1",
    )
    return msgspec.structs.replace(auth, **changes)


def test_canonical_hash_ignores_key_order_but_not_values() -> None:
    assert arguments_sha256({"a": 1, "b": [1, 2]}) == arguments_sha256({"b": [1, 2], "a": 1})
    assert arguments_sha256({"a": 1}) != arguments_sha256({"a": 2})


def test_signed_authorization_verifies_and_any_change_breaks_it(tmp_path: Path) -> None:
    ensure_keypair(tmp_path)
    signed = sign(authorization(), load_private_key(tmp_path))
    public = load_public_key(tmp_path)
    assert verify(signed, public)
    for change in (
        {"tool": "echo"},
        {"arguments_sha256": arguments_sha256({"a": 2})},
        {"policy_version": "v2"},
        {"approvals": ["mallory"]},
        {"expires_at": signed.expires_at + timedelta(days=1)},
        # v2: the whole six-tuple is signed, not only the call.
        {"tenant": "globex"},
        {"agent": "writer"},
        {"user": "u-mallory"},
        {"session": "s-other"},
        {"task_id": "task-other"},
    ):
        assert not verify(msgspec.structs.replace(signed, **change), public), change


def test_signature_of_another_key_is_refused(tmp_path: Path) -> None:
    ensure_keypair(tmp_path / "ours")
    ensure_keypair(tmp_path / "theirs")
    forged = sign(authorization(), load_private_key(tmp_path / "theirs"))
    assert not verify(forged, load_public_key(tmp_path / "ours"))


def test_garbage_signature_is_refused_not_raised(tmp_path: Path) -> None:
    ensure_keypair(tmp_path)
    assert not verify(authorization(signature="not base64 !!"), load_public_key(tmp_path))


def test_keypair_is_created_once(tmp_path: Path) -> None:
    ensure_keypair(tmp_path)
    first = (tmp_path / "authorization.key").read_bytes()
    ensure_keypair(tmp_path)
    assert (tmp_path / "authorization.key").read_bytes() == first
