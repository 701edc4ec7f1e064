"""The hash chain a sink writes, and the signed checkpoints that pin it. No I/O but keys.

Each sink process writes one chain of its own (`chain_id`, new at every
start): row n stores ``chain_hash_n = sha256(chain_hash_{n-1} || n || sha256(content_n))``
where content is the row's CONTENT_COLUMNS as length-prefixed fields (the
same bytes ClickHouse computes from the stored row: see content_sql). Why a chain per
writer and not one in stream order: several replicas write at once, and a
global order would need them to agree on the previous hash before every
insert. A per-writer chain needs no coordination, survives a crash (the
restarted sink starts a new chain; a row written twice lives in two chains,
identical in content) and still fixes every row's place.

After every insert the sink signs a checkpoint (chain_id, chain_seq,
chain_hash) with its Ed25519 key; seq 0, the genesis, is signed before the
first row. Someone with write access to ClickHouse but not the key can
alter, delete or add rows, but cannot make the chain match the signatures.
"""

from __future__ import annotations

import base64
import hashlib
import operator
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from toolgate.contracts.authorization import canonical_json, key_id
from toolgate.services.audit.rows import CONTENT_COLUMNS, to_micros

# A key of its own: the audit seal must not be able to authorize a call, and
# rotating the authorization key must not orphan the audit's signatures.
SEAL_KEY_FILE = "audit-seal.key"
SEAL_PUBLIC_FILE = "audit-seal.pub"


def genesis_hash(chain_id: str) -> str:
    return hashlib.sha256(f"toolgate-audit-chain/{chain_id}".encode()).hexdigest()


def time_text(value: datetime) -> str:
    """A DateTime64(6, 'UTC') as ClickHouse reads and prints it; naive means UTC."""
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.isoformat(" ", "microseconds")  # YYYY-MM-DD hh:mm:ss.ffffff, in C


_pack_double = struct.Struct("<d").pack
_unpack_bits = struct.Struct("<Q").unpack


def _text(value: Any, column: str) -> bytes:
    """A non-string field: the time in microseconds, the float's bits, NULL as N."""
    if value is None:
        return b"N"
    if column == "occurred_at":
        return str(to_micros(value)).encode()
    if column == "duration_ms":  # exact on both sides (ClickHouse: reinterpretAsUInt64)
        return str(_unpack_bits(_pack_double(value))[0]).encode()
    return str(int(value)).encode()


def content_bytes(row: dict[str, Any]) -> bytes:
    """The row's content columns as length-prefixed fields: what a link hashes.

    Chosen so that ClickHouse computes the very same bytes from the stored
    columns (content_sql below): `toolgate audit verify` checks every link in
    SQL, without pulling rows out. Strings as stored, the time as microseconds
    since the epoch, the duration as the bits of its float, NULL as `N`.
    """
    # The sink's costliest step per row, so no Python loop over the fields. A row as
    # RowBuilder makes it (every column a str but the time, the duration and the stream
    # position) is written as one text, encoded once: UTF-8 encodes a concatenation as
    # the concatenation of the encodings, so the bytes are the same as field by field.
    # When the whole text is ASCII (one check: str.isascii() of the fields joined), a
    # field's byte length is its length, and the prefixes come from a table by C calls.
    texts = [*_content_values(row)]
    at, duration, seq = texts[_AT], texts[_DURATION], texts[_SEQ]
    if (
        at.__class__ is datetime
        and at.tzinfo is not None
        and (duration is None or duration.__class__ is float)
        and seq.__class__ is int
    ):
        texts[_AT] = str((at - _EPOCH) // _MICROSECOND)  # to_micros of an aware time
        texts[_DURATION] = "N" if duration is None else str(_unpack_bits(_pack_double(duration))[0])
        texts[_SEQ] = str(seq)
        try:
            ascii_only = "".join(texts).isascii()
        except TypeError:  # a column that is not a str (None, say): field by field
            return _content_bytes_by_field(row)
        if ascii_only:
            parts = _EMPTY_PARTS.copy()
            parts[::2] = map(_PREFIXES.__getitem__, map(len, texts))
            parts[1::2] = texts
            return "".join(parts).encode()
        return "".join(
            [f"{len(v) if v.isascii() else len(v.encode())}:{v}" for v in texts]
        ).encode()
    return _content_bytes_by_field(row)


class _LengthPrefixes(dict[int, str]):
    """`n:` for a field of n bytes; the short ones (nearly all) kept."""

    def __missing__(self, length: int) -> str:
        prefix = f"{length}:"
        if length < 65536:
            self[length] = prefix
        return prefix


_PREFIXES = _LengthPrefixes()
_EMPTY_PARTS = [""] * (2 * len(CONTENT_COLUMNS))


def _content_bytes_by_field(row: dict[str, Any]) -> bytes:
    """content_bytes for any row, one field at a time."""
    out: list[bytes] = []
    append = out.append
    for column in CONTENT_COLUMNS:
        value = row[column]
        if value.__class__ is str:
            data = value.encode()
        elif column == "occurred_at":
            data = b"%d" % to_micros(value)
        else:
            data = _text(value, column)
        append(b"%d:%b" % (len(data), data))
    return b"".join(out)


_content_values = operator.itemgetter(*CONTENT_COLUMNS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
_AT = CONTENT_COLUMNS.index("occurred_at")
_DURATION = CONTENT_COLUMNS.index("duration_ms")
_SEQ = CONTENT_COLUMNS.index("source_seq")


def content_sql() -> str:
    """content_bytes as a ClickHouse expression over an event_log row."""

    def field(column: str) -> str:
        if column == "occurred_at":
            text = "toString(toUnixTimestamp64Micro(occurred_at))"
        elif column == "duration_ms":
            text = (
                "if(duration_ms IS NULL, 'N', "
                "toString(reinterpretAsUInt64(assumeNotNull(duration_ms))))"
            )
        elif column == "source_seq":
            text = "toString(source_seq)"
        else:
            text = f"toString(`{column}`)"
        return f"toString(length({text})), ':', {text}"

    return "concat(" + ", ".join(field(c) for c in CONTENT_COLUMNS) + ")"


def content_digest(row: dict[str, Any]) -> bytes:
    """SHA-256 of the row's content_bytes: the part of its link that needs no chain."""
    return hashlib.sha256(content_bytes(row)).digest()


def link_hash(previous: str, seq: int, row: dict[str, Any], content: bytes | None = None) -> str:
    """sha256(previous || "/seq/" || sha256(content)): the per-row digest first, so
    verify can compute it while reading and sort only the short links."""
    inner = hashlib.sha256(content if content is not None else content_bytes(row)).digest()
    digest = hashlib.sha256(previous.encode())
    digest.update(f"/{seq}/".encode())
    digest.update(inner)
    return digest.hexdigest()


class Chain:
    """One writer's chain. `link` is tentative until `commit` (after the insert succeeded)."""

    def __init__(self, chain_id: str) -> None:
        self.chain_id = chain_id
        self.seq = 0
        self.head = genesis_hash(chain_id)

    def link(
        self, rows: list[dict[str, Any]], digests: Sequence[bytes] | None = None
    ) -> list[dict[str, Any]]:
        """The rows given chain columns (set in place): what the insert sends. Each link is
        link_hash's, its three parts hashed as one text. `digests`: each row's
        content_digest, if the caller made them with the rows (the sink does, while each
        row is fresh in the cache and outside the chain's lock)."""
        if digests is None:
            digests = [content_digest(row) for row in rows]
        previous, seq, chain_id, sha256 = self.head, self.seq, self.chain_id, hashlib.sha256
        for row, inner in zip(rows, digests, strict=True):
            seq += 1
            previous = sha256(b"%b/%d/%b" % (previous.encode(), seq, inner)).hexdigest()
            row["chain_id"] = chain_id
            row["chain_seq"] = seq
            row["chain_hash"] = previous
        return list(rows)

    def commit(self, linked: list[dict[str, Any]]) -> None:
        if linked:
            self.seq = linked[-1]["chain_seq"]
            self.head = linked[-1]["chain_hash"]


@dataclass(frozen=True)
class Checkpoint:
    chain_id: str
    chain_seq: int
    chain_hash: str
    final: bool
    writer: str
    signed_at: datetime
    key_id: str = ""
    signature: str = ""

    def signed_bytes(self) -> bytes:
        return canonical_json(
            {
                "chain_id": self.chain_id,
                "chain_seq": self.chain_seq,
                "chain_hash": self.chain_hash,
                "final": bool(self.final),
                "writer": self.writer,
                "signed_at": to_micros(self.signed_at),
                "key_id": self.key_id,
            }
        )

    def row(self) -> tuple[Any, ...]:
        return (
            self.chain_id,
            self.chain_seq,
            self.chain_hash,
            int(self.final),
            self.writer,
            self.signed_at,
            self.key_id,
            self.signature,
        )


def seal_bytes(checkpoint: Checkpoint) -> bytes:
    """A checkpoint as the JSON message kept in the JetStream seal stream."""
    return canonical_json(
        {
            "chain_id": checkpoint.chain_id,
            "chain_seq": checkpoint.chain_seq,
            "chain_hash": checkpoint.chain_hash,
            "final": bool(checkpoint.final),
            "writer": checkpoint.writer,
            "signed_at": to_micros(checkpoint.signed_at),
            "key_id": checkpoint.key_id,
            "signature": checkpoint.signature,
        }
    )


def seal_of(data: bytes) -> Checkpoint:
    """A seal message back as a Checkpoint; ValueError if it is not one."""
    try:
        fields = msgspec.json.decode(data)
        return Checkpoint(
            chain_id=str(fields["chain_id"]),
            chain_seq=int(fields["chain_seq"]),
            chain_hash=str(fields["chain_hash"]),
            final=bool(fields["final"]),
            writer=str(fields["writer"]),
            signed_at=datetime.fromtimestamp(int(fields["signed_at"]) / 1e6, UTC).replace(
                microsecond=int(fields["signed_at"]) % 1_000_000
            ),
            key_id=str(fields["key_id"]),
            signature=str(fields["signature"]),
        )
    except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a seal: {exc}") from None


CHECKPOINT_COLUMNS = (
    "chain_id",
    "chain_seq",
    "chain_hash",
    "final",
    "writer",
    "signed_at",
    "key_id",
    "signature",
)


def sign_checkpoint(checkpoint: Checkpoint, private_key: Ed25519PrivateKey) -> Checkpoint:
    unsigned = replace(checkpoint, key_id=key_id(private_key.public_key()), signature="")
    signature = private_key.sign(unsigned.signed_bytes())
    return replace(unsigned, signature=base64.b64encode(signature).decode())


def checkpoint_is_genuine(checkpoint: Checkpoint, public_key: Ed25519PublicKey) -> bool:
    if checkpoint.key_id != key_id(public_key):
        return False
    try:
        public_key.verify(
            base64.b64decode(checkpoint.signature, validate=True), checkpoint.signed_bytes()
        )
    except (InvalidSignature, ValueError):
        return False
    return True


def ensure_seal_key(keys_dir: Path) -> Ed25519PrivateKey:
    """The sink's signing key, created once (replicas on one host share it)."""
    keys_dir.mkdir(parents=True, exist_ok=True)
    private_path = keys_dir / SEAL_KEY_FILE
    if not private_path.exists():
        key = Ed25519PrivateKey.generate()
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # Written whole under a private name, then linked into place: a replica starting
        # at the same moment finds either no key or a complete one, never half a file.
        draft = keys_dir / f".{SEAL_KEY_FILE}.{os.getpid()}"
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(pem)
        try:
            os.link(draft, private_path)
        except FileExistsError:
            pass  # another replica won the race; its key stands
        else:
            public = key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
            tmp = keys_dir / f".{SEAL_PUBLIC_FILE}.{os.getpid()}"
            tmp.write_bytes(public)
            tmp.replace(keys_dir / SEAL_PUBLIC_FILE)
        finally:
            draft.unlink(missing_ok=True)
    loaded = serialization.load_pem_private_key(private_path.read_bytes(), None)
    if not isinstance(loaded, Ed25519PrivateKey):
        raise ValueError(f"{private_path}: not an Ed25519 private key")
    return loaded


def load_seal_public_key(path: Path) -> Ed25519PublicKey:
    """`path` is the public key file, or a keys directory holding audit-seal.pub."""
    if path.is_dir():
        path = path / SEAL_PUBLIC_FILE
    key = serialization.load_pem_public_key(path.read_bytes())
    if not isinstance(key, Ed25519PublicKey):
        raise ValueError(f"{path}: not an Ed25519 public key")
    return key
