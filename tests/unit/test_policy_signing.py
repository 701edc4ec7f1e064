"""Signed bundles and the fail-closed policy state: pure, no broker."""

from __future__ import annotations

import logging
import stat
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from toolgate.contracts.authorization import ensure_keypair
from toolgate.services.policy import versions
from toolgate.services.policy.app import ActivePolicy, PolicyStateError
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, bundle_version, read_bundle_dir
from toolgate.services.policy.bundle_store import ActiveEntry
from toolgate.services.policy.engine import engine_from_files
from toolgate.services.policy.signing import (
    PRIVATE_KEY_FILE,
    PUBLIC_KEY_FILE,
    BundleRefused,
    StoredBundle,
    ensure_signing_key,
    load_verify_key,
    open_stored,
    sign_bundle,
)

DEFAULT = read_bundle_dir(DEFAULT_BUNDLE_DIR)
STRICT = {
    **DEFAULT,
    "no-echo.cedar": '@id("no-echo") forbid (principal, action, resource == Tool::"echo");\n',
}


def signed(files: dict[str, str], key: Ed25519PrivateKey, number: int = 1) -> bytes:
    return msgspec.json.encode(
        sign_bundle(files, bundle_version(files), key, number=number, source="pushed from test")
    )


def refusal(value: bytes | None, key: Ed25519PrivateKey | None) -> str:
    with pytest.raises(BundleRefused) as raised:
        open_stored(value, key.public_key() if key else None, "keys/policy-signing.pub")
    text = str(raised.value)
    assert "\n" not in text
    return text


class TestSignatures:
    def test_a_signed_bundle_opens_with_its_files(self) -> None:
        key = Ed25519PrivateKey.generate()
        stored = open_stored(signed(STRICT, key), key.public_key())
        assert stored.files == STRICT and stored.version == bundle_version(STRICT)
        assert stored.signed_at and stored.key_id

    def test_garbled_empty_or_unsigned_values_are_refused(self) -> None:
        key = Ed25519PrivateKey.generate()
        assert "not readable" in refusal(signed(STRICT, key)[:-7], key)
        assert "not readable" in refusal(b"\x00\xffnot json", key)
        assert "not readable" in refusal(b'{"files": {"a.cedar": 5}}', key)
        assert "empty" in refusal(b"", key)
        assert "empty" in refusal(None, key)
        unsigned = msgspec.json.encode(StoredBundle(files=STRICT))
        assert "not signed" in refusal(unsigned, key)

    def test_changed_files_or_a_changed_date_break_the_signature(self) -> None:
        key = Ed25519PrivateKey.generate()
        good = sign_bundle(DEFAULT, bundle_version(DEFAULT), key)
        for forged in (
            msgspec.structs.replace(good, files=STRICT),
            msgspec.structs.replace(good, signed_at="2099-01-01T00:00:00+00:00"),
            msgspec.structs.replace(good, signature="not base64!"),
        ):
            assert "does not verify" in refusal(msgspec.json.encode(forged), key)

    def test_another_key_is_refused_even_with_a_valid_signature(self) -> None:
        operator, intruder = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
        assert "not by the trusted key" in refusal(signed(STRICT, intruder), operator)
        # Claiming the operator's key id does not help: the signature is checked.
        claimed = msgspec.structs.replace(
            sign_bundle(STRICT, "", intruder),
            key_id=msgspec.json.decode(signed(STRICT, operator), type=StoredBundle).key_id,
        )
        assert "does not verify" in refusal(msgspec.json.encode(claimed), operator)

    def test_without_a_trusted_key_nothing_stored_is_used(self) -> None:
        key = Ed25519PrivateKey.generate()
        assert "no policy-signing public key at keys/policy-signing.pub" in refusal(
            signed(STRICT, key), None
        )


class TestKeys:
    def test_first_use_creates_a_private_key_only_its_owner_can_read(self, tmp_path: Path) -> None:
        key, created = ensure_signing_key(tmp_path / "keys")
        again, created_again = ensure_signing_key(tmp_path / "keys")
        assert created and not created_again
        private = tmp_path / "keys" / PRIVATE_KEY_FILE
        assert stat.S_IMODE(private.stat().st_mode) == 0o600
        trusted = load_verify_key(tmp_path / "keys")
        assert trusted is not None
        assert open_stored(signed(STRICT, again), trusted).files == STRICT
        assert open_stored(signed(STRICT, key), trusted).files == STRICT

    def test_public_key_is_put_back_if_it_went_missing(self, tmp_path: Path) -> None:
        ensure_signing_key(tmp_path)
        (tmp_path / PUBLIC_KEY_FILE).unlink()
        assert load_verify_key(tmp_path) is None
        ensure_signing_key(tmp_path)
        assert load_verify_key(tmp_path) is not None

    def test_it_is_not_the_authorization_key(self, tmp_path: Path) -> None:
        ensure_keypair(tmp_path)  # the policy service's own key, for executors
        assert load_verify_key(tmp_path) is None
        ensure_signing_key(tmp_path)
        assert (tmp_path / PUBLIC_KEY_FILE).read_bytes() != (
            tmp_path / "authorization.pub"
        ).read_bytes()

    def test_a_public_key_file_that_is_not_one_refuses_bundles(self, tmp_path: Path) -> None:
        (tmp_path / PUBLIC_KEY_FILE).write_text("garbage")
        with pytest.raises(BundleRefused, match="not readable"):
            load_verify_key(tmp_path)


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Ed25519PrivateKey]:
    key, _ = ensure_signing_key(tmp_path / "keys")
    return tmp_path / "keys", key


def fresh(keys_dir: Path) -> ActivePolicy:
    return ActivePolicy(engine_from_files(DEFAULT), keys_dir)


def errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


class TestStartup:
    def test_nothing_ever_pushed_runs_the_local_bundle(
        self, keys: tuple[Path, Ed25519PrivateKey], caplog: pytest.LogCaptureFixture
    ) -> None:
        policy = fresh(keys[0])
        policy.start(None)
        assert policy.engine.version == bundle_version(DEFAULT) and errors(caplog) == []

    def test_a_pushed_bundle_is_active_from_the_start(
        self, keys: tuple[Path, Ed25519PrivateKey]
    ) -> None:
        policy = fresh(keys[0])
        policy.start(ActiveEntry(revision=3, value=signed(STRICT, keys[1])))
        assert policy.engine.version == bundle_version(STRICT) and policy.revision == 3

    @pytest.mark.parametrize(
        ("value", "deleted", "why"),
        [
            (b'{"files": {"schema.ceda', False, "not readable"),
            (msgspec.json.encode(StoredBundle(files=STRICT)), False, "not signed"),
            (None, True, "deleted"),
        ],
    )
    def test_a_bad_stored_bundle_refuses_to_start_with_one_error_line(
        self,
        keys: tuple[Path, Ed25519PrivateKey],
        caplog: pytest.LogCaptureFixture,
        value: bytes | None,
        deleted: bool,
        why: str,
    ) -> None:
        policy = fresh(keys[0])
        with pytest.raises(PolicyStateError) as raised:
            policy.start(ActiveEntry(revision=7, value=value, deleted=deleted))
        [line] = errors(caplog)
        assert line == raised.value.reason and "\n" not in line
        assert why in line and "revision 7" in line and "toolgate policy push" in line

    def test_an_invalid_but_signed_bundle_refuses_to_start(
        self, keys: tuple[Path, Ed25519PrivateKey], caplog: pytest.LogCaptureFixture
    ) -> None:
        broken = {**DEFAULT, "bad.cedar": "permit (principal"}
        with pytest.raises(PolicyStateError):
            fresh(keys[0]).start(ActiveEntry(revision=1, value=signed(broken, keys[1])))
        [line] = errors(caplog)
        assert "not a valid bundle: bad.cedar:1:" in line and "\n" not in line

    def test_without_the_public_key_a_stored_bundle_refuses_to_start(self, tmp_path: Path) -> None:
        key = Ed25519PrivateKey.generate()
        with pytest.raises(PolicyStateError) as raised:
            fresh(tmp_path / "no-keys").start(ActiveEntry(1, signed(STRICT, key)))
        assert "no policy-signing public key" in raised.value.reason


class TestRunning:
    def test_bad_revisions_keep_the_last_good_bundle_and_are_logged_once(
        self, keys: tuple[Path, Ed25519PrivateKey], caplog: pytest.LogCaptureFixture
    ) -> None:
        keys_dir, key = keys
        policy = fresh(keys_dir)
        policy.start(ActiveEntry(1, signed(STRICT, key)))
        intruder = Ed25519PrivateKey.generate()
        bad = [
            ActiveEntry(2, b"garbage"),
            ActiveEntry(3, signed(DEFAULT, intruder)),
            ActiveEntry(4, msgspec.json.encode(StoredBundle(files=DEFAULT))),
            ActiveEntry(5, None, deleted=True),
        ]
        for entry in bad:
            policy.offer(entry)
            policy.offer(entry)  # the periodic re-read brings the same revision again
        assert policy.engine.version == bundle_version(STRICT)
        lines = errors(caplog)
        assert len(lines) == 4, lines
        assert all(
            f"keeping version 1 (pushed from test, bundle {bundle_version(STRICT)}" in x
            for x in lines
        )
        assert "revision 2" in lines[0] and "revision 5" in lines[3]

    def test_a_good_new_revision_switches_and_an_older_one_is_ignored(
        self, keys: tuple[Path, Ed25519PrivateKey]
    ) -> None:
        keys_dir, key = keys
        policy = fresh(keys_dir)
        policy.start(None)
        policy.offer(ActiveEntry(4, signed(STRICT, key, 1)))
        assert policy.engine.version == bundle_version(STRICT)
        policy.offer(ActiveEntry(3, signed(DEFAULT, key, 2)))
        assert policy.engine.version == bundle_version(STRICT)
        policy.offer(ActiveEntry(5, signed(DEFAULT, key, 2)))
        assert policy.engine.version == bundle_version(DEFAULT)


def accepted_record(files: dict[str, str], key: Ed25519PrivateKey, number: int) -> bytes:
    """The policy service's record of the last bundle it accepted (its high-water mark)."""
    return signed(files, key, number)


class TestVersions:
    """Invariant 12: a bundle becomes active only with a higher version number."""

    def test_the_signature_covers_the_version_number_and_the_source(self) -> None:
        key = Ed25519PrivateKey.generate()
        good = msgspec.json.decode(signed(STRICT, key, 3), type=StoredBundle)
        assert open_stored(msgspec.json.encode(good), key.public_key()).number == 3
        for forged in (
            msgspec.structs.replace(good, number=9),
            msgspec.structs.replace(good, number=0),
            msgspec.structs.replace(good, source="example refund"),
        ):
            assert "does not verify" in refusal(msgspec.json.encode(forged), key)

    def test_a_running_replica_refuses_an_older_or_equal_version_naming_both(
        self, keys: tuple[Path, Ed25519PrivateKey], caplog: pytest.LogCaptureFixture
    ) -> None:
        keys_dir, key = keys
        policy = fresh(keys_dir)
        policy.start(ActiveEntry(1, signed(DEFAULT, key, 1)))
        policy.offer(ActiveEntry(2, signed(STRICT, key, 2)))
        assert policy.engine.version == bundle_version(STRICT)
        policy.offer(ActiveEntry(3, signed(DEFAULT, key, 1)))  # put back from the history
        policy.offer(ActiveEntry(4, signed(DEFAULT, key, 2)))  # same number, other content
        assert policy.engine.version == bundle_version(STRICT) and policy.accepted is not None
        assert policy.accepted.number == 2
        older, equal = errors(caplog)
        assert "revision 3" in older and "keeping version 2" in older
        assert "version 1: its version 1 is not higher than the active version 2" in older
        assert "version 2: its version 2 is not higher than the active version 2" in equal
        policy.offer(ActiveEntry(5, signed(DEFAULT, key, 3)))
        assert policy.engine.version == bundle_version(DEFAULT)

    def test_a_restart_keeps_the_last_accepted_bundle_over_an_older_one_in_the_bucket(
        self, keys: tuple[Path, Ed25519PrivateKey], caplog: pytest.LogCaptureFixture
    ) -> None:
        keys_dir, key = keys
        policy = fresh(keys_dir)
        policy.start(ActiveEntry(9, signed(DEFAULT, key, 1)), accepted_record(STRICT, key, 2))
        assert policy.engine.version == bundle_version(STRICT)
        [line] = errors(caplog)
        assert "revision 9 refused, keeping version 2" in line
        assert "its version 1 is not higher than the active version 2" in line

    @pytest.mark.parametrize("entry", [None, ActiveEntry(9, None, deleted=True)])
    def test_a_restart_with_the_key_deleted_or_gone_keeps_the_last_accepted_bundle(
        self,
        keys: tuple[Path, Ed25519PrivateKey],
        caplog: pytest.LogCaptureFixture,
        entry: ActiveEntry | None,
    ) -> None:
        keys_dir, key = keys
        policy = fresh(keys_dir)
        policy.start(entry, accepted_record(STRICT, key, 2))
        assert policy.engine.version == bundle_version(STRICT)
        [line] = errors(caplog)
        assert "keeping version 2" in line

    def test_a_restart_takes_a_newer_push_and_the_same_bundle_quietly(
        self, keys: tuple[Path, Ed25519PrivateKey], caplog: pytest.LogCaptureFixture
    ) -> None:
        keys_dir, key = keys
        same = signed(STRICT, key, 2)
        policy = fresh(keys_dir)
        policy.start(ActiveEntry(3, same), same)
        assert policy.engine.version == bundle_version(STRICT) and policy.to_record is None
        newer = fresh(keys_dir)
        newer.start(ActiveEntry(4, signed(DEFAULT, key, 3)), same)
        assert newer.engine.version == bundle_version(DEFAULT)
        assert newer.to_record is not None and newer.to_record.number == 3
        assert errors(caplog) == []

    def test_an_unreadable_record_refuses_to_start(
        self, keys: tuple[Path, Ed25519PrivateKey]
    ) -> None:
        keys_dir, key = keys
        with pytest.raises(PolicyStateError) as raised:
            fresh(keys_dir).start(ActiveEntry(1, signed(STRICT, key, 1)), b"\x00garbage")
        assert "toolgate_policy_accepted" in raised.value.reason

    def test_the_next_number_counts_only_the_operators_bundles_and_the_record(self) -> None:
        key, intruder = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
        written = [
            ActiveEntry(1, signed(DEFAULT, key, 1)),
            ActiveEntry(2, signed(STRICT, key, 4)),
            ActiveEntry(3, signed(STRICT, intruder, 99)),
            ActiveEntry(4, msgspec.json.encode(StoredBundle(files=STRICT, number=50))),
            ActiveEntry(5, None, deleted=True),
        ]
        assert versions.next_number(written, None, key.public_key()) == 5
        record = msgspec.json.decode(signed(STRICT, key, 7), type=StoredBundle)
        assert versions.next_number(written, record, key.public_key()) == 8
        found = versions.find_version(written, 1, key.public_key())
        assert found is not None and found.files == DEFAULT
        assert versions.find_version(written, 99, key.public_key()) is None
