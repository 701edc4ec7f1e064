"""Batches of stored messages into chained rows in ClickHouse, before they are acked.

The order per batch, each step retried until it succeeds:
  1. build the rows (pure, rows.py) and link them into this sink's chain;
  2. insert them in one block with insert_deduplication_token = chain position
     range: a retry of a block ClickHouse did store (the answer was lost) is
     dropped by ClickHouse, so retries are harmless;
  3. sign a checkpoint of the new chain head and insert it (and publish it);
  4. return: the stage runner acks every message of the batch (app.py).
While ClickHouse is down the batch waits in step 2 and the runner's heartbeat
keeps its messages `in progress`, so JetStream does not hand them to another
replica. A crash at any step leaves the batch un-acked: it is redelivered and
written again, by whichever sink gets it, and the `events` view shows each
event_id once.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from itertools import repeat
from operator import floordiv, sub
from typing import Any, Protocol

from clickhouse_connect.driver.client import Client
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from toolgate.contracts.events import utc_now
from toolgate.services.audit.chain import (
    CHECKPOINT_COLUMNS,
    Chain,
    Checkpoint,
    content_digest,
    sign_checkpoint,
)
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import INSERT_COLUMNS, RowBuilder, StoredMessage, to_micros
from toolgate.services.audit.schema import ensure_schema

log = logging.getLogger("toolgate.audit")

# How the insert sends each column, in ClickHouse's Native format (INSERT_COLUMNS order):
# the values as the chain hashed them, in binary, so the server parses no text (JSON lines
# were most of its CPU per row). The time goes as its microseconds, the duration as its
# float's bits. A LowCardinality column of event_log goes as a plain String: the server
# builds its dictionary (as it did from JSON), not Python.
NATIVE_TYPES: dict[str, str] = dict.fromkeys(INSERT_COLUMNS, "String") | {
    "occurred_at": "DateTime64(6, 'UTC')",
    "duration_ms": "Nullable(Float64)",
    "source_seq": "UInt64",
    "chain_seq": "UInt64",
}
_AT = INSERT_COLUMNS.index("occurred_at")
_insert_values = operator.itemgetter(*INSERT_COLUMNS)
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 5.0


class JetStreamMessage(Protocol):
    """The parts of a nats-py message the writer uses."""

    subject: str
    data: bytes

    @property
    def metadata(self) -> Any: ...


def stored_message(msg: JetStreamMessage) -> StoredMessage:
    # The ack subject says where the message is stored and when. Read here
    # directly: nats-py's `metadata` parses it about ten times slower, and it
    # was the largest single cost per row. Its layout (ADR-15):
    # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<tm>.<pending> or,
    # with domain and account, $JS.ACK.<domain>.<hash>.<stream>...<pending>.<token>.
    # The time stays the subject's nanoseconds: only a raw call's row reads it as a
    # datetime (StoredMessage.stored_at), and making one cost more than the rest.
    tokens = (getattr(msg, "reply", "") or "").split(".")
    count = len(tokens)
    if (count == 9 or count == 12) and tokens[0] == "$JS" and tokens[1] == "ACK":
        at = 2 if count == 9 else 4
        return StoredMessage(
            tokens[at], int(tokens[at + 3]), int(tokens[at + 5]), msg.subject, msg.data
        )
    meta = msg.metadata
    return StoredMessage(meta.stream, meta.sequence.stream, meta.timestamp, msg.subject, msg.data)


def insert_columns(linked: Sequence[dict[str, Any]]) -> list[Sequence[Any]]:
    """The linked rows as columns, in INSERT_COLUMNS order, as NATIVE_TYPES sends them
    (transposed, and the times converted, by C-level passes: no Python step per value)."""
    columns: list[Sequence[Any]] = list(zip(*map(_insert_values, linked), strict=True))
    times = columns[_AT]
    try:  # aware datetimes, as RowBuilder makes them
        columns[_AT] = list(map(floordiv, map(sub, times, repeat(_EPOCH)), repeat(_MICROSECOND)))
    except TypeError:  # a naive one (a row as read back): UTC
        columns[_AT] = [to_micros(at) for at in times]
    return columns


def new_chain_id(writer: str) -> str:
    return f"{writer}/{uuid.uuid4().hex[:12]}"


class AuditWriter:
    def __init__(
        self,
        target: ClickHouseTarget,
        builder: RowBuilder,
        private_key: Ed25519PrivateKey,
        writer: str,
    ) -> None:
        self.target = target
        self.builder = builder
        self.private_key = private_key
        self.writer = writer
        self.chain = Chain(new_chain_id(writer))
        self.stopping = False
        self.rows_written = 0
        self.batches_written = 0
        self._lock = asyncio.Lock()
        self._client: Client | None = None
        # True while an insert was sent and not confirmed: the chain head in
        # memory may then lag the table, so no final checkpoint is signed.
        self._unconfirmed = False
        # Checkpoints also go to the JetStream seal stream (outside the writer's reach in
        # ClickHouse), in order, once `publish_seal` is set (the app sets it once the bus
        # is connected); a batch is acked only after its seal is kept there too.
        self.publish_seal: Callable[[Checkpoint], Awaitable[None]] | None = None
        self._unpublished: list[Checkpoint] = []

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Apply the schema and sign the chain's genesis, waiting for ClickHouse if needed."""
        await self._until_done("check schema", lambda: ensure_schema(self.target))
        await self._until_done("seal genesis", lambda: self._seal(final=False))
        log.info(
            "audit sink %s writing chain %s to %s",
            self.writer,
            self.chain.chain_id,
            self.target.display(),
        )

    async def close(self) -> None:
        """Sign a final checkpoint, so rows appended to this chain later are caught."""
        self.stopping = True
        async with self._lock:
            if self._unconfirmed:
                log.warning("last insert unconfirmed: chain %s left open", self.chain.chain_id)
                return
            try:
                await asyncio.to_thread(self._seal, True)
                await self.publish_seals()
            except Exception as exc:
                log.warning("no final checkpoint for %s: %r", self.chain.chain_id, exc)

    # -- one batch --------------------------------------------------------------------
    async def write(self, messages: Sequence[JetStreamMessage]) -> None:
        if not messages:
            return
        stored = [stored_message(m) for m in messages]
        # CPU work in a thread: it overlaps the other source's insert (which
        # waits on ClickHouse with the GIL released), and the loop stays free.
        rows, digests = await asyncio.to_thread(self._rows, stored)
        async with self._lock:
            await self._write_locked(rows, digests)

    async def _write_locked(self, rows: list[dict[str, Any]], digests: list[bytes]) -> None:
        """Link, insert, seal: one batch at a time, since each extends the chain."""
        linked = await asyncio.to_thread(self.chain.link, rows, digests)
        first, last = linked[0]["chain_seq"], linked[-1]["chain_seq"]
        # The token names the chain positions, not only the stream sequences: a
        # retry of this very block is dropped, while the same messages written
        # again by another sink (another chain) are not, or that chain would
        # have a hole. Those copies are what the `events` view dedupes.
        token = f"{self.chain.chain_id}:{first}-{last}"
        await self._until_done("insert", lambda: self._insert(linked, token))
        self.chain.commit(linked)
        await self._until_done("seal", lambda: self._seal(final=False))
        await self.publish_seals()
        self.rows_written += len(linked)
        self.batches_written += 1

    def _rows(self, stored: list[StoredMessage]) -> tuple[list[dict[str, Any]], list[bytes]]:
        """The batch's rows and each one's content digest, made together: the digest
        while its row is fresh in the cache (hashing them apart, over a batch of
        thousands, read every row back from memory), and outside the chain's lock."""
        builder, rows, digests = self.builder, [], []
        for message in stored:
            try:
                row = builder.row_for(message)
            except Exception as exc:  # a bug here must not stop the audit of everything else
                log.exception("cannot build a row for %s:%s", message.stream, message.sequence)
                row = builder.fallback_row(message, exc)
            rows.append(row)
            digests.append(content_digest(row))
        return rows, digests

    # -- ClickHouse (run in a worker thread: clickhouse-connect blocks) --------------------
    def _db(self) -> Client:
        if self._client is None:
            self._client = self.target.client()
        return self._client

    def _insert(self, linked: list[dict[str, Any]], token: str) -> None:
        self._unconfirmed = True
        db = self._db()
        context = db.create_insert_context(
            "event_log",
            list(INSERT_COLUMNS),
            column_type_names=list(NATIVE_TYPES.values()),
            column_oriented=True,
            settings={"insert_deduplication_token": token},
        )
        # One Native block per insert, as the JSON lines were one: the dedupe token names
        # this block (clickhouse-connect would otherwise cut it into ~2 MB blocks).
        context.req_block_size = max(len(linked), 1)
        db.insert(context=context, data=insert_columns(linked))
        self._unconfirmed = False

    async def publish_seals(self) -> None:
        """Every checkpoint not yet in the seal stream, in order (retried until kept)."""
        if self.publish_seal is None:
            return
        while self._unpublished:
            checkpoint = self._unpublished[0]
            publish = self.publish_seal
            delay, attempt = RETRY_FIRST_S, 0
            while True:
                attempt += 1
                try:
                    await publish(checkpoint)
                    break
                except Exception as exc:
                    if self.stopping:
                        raise
                    if attempt == 1 or attempt % 10 == 0:
                        log.warning("seal to JetStream failed (attempt %d): %r", attempt, exc)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
            self._unpublished.pop(0)

    def _seal(self, final: bool) -> None:
        checkpoint = sign_checkpoint(
            Checkpoint(
                chain_id=self.chain.chain_id,
                chain_seq=self.chain.seq,
                chain_hash=self.chain.head,
                final=final,
                writer=self.writer,
                signed_at=utc_now(),
            ),
            self.private_key,
        )
        token = f"{self.chain.chain_id}:checkpoint:{self.chain.seq}:{int(final)}"
        self._db().insert(
            "chain_checkpoints",
            [checkpoint.row()],
            column_names=list(CHECKPOINT_COLUMNS),
            settings={"insert_deduplication_token": token},
        )
        if not self._unpublished or self._unpublished[-1] != checkpoint:
            self._unpublished.append(checkpoint)

    async def _until_done(self, what: str, step: Callable[[], Any]) -> None:
        delay, attempt, since = RETRY_FIRST_S, 0, time.monotonic()
        while True:
            attempt += 1
            try:
                await asyncio.to_thread(step)
            except Exception as exc:
                if self.stopping:
                    raise
                if attempt == 1 or attempt % 10 == 0:
                    log.warning(
                        "ClickHouse at %s: %s failed (attempt %d, %.0fs): %r; retrying",
                        self.target.display(),
                        what,
                        attempt,
                        time.monotonic() - since,
                        exc,
                    )
                self._client = None  # a fresh connection after a server restart
                await asyncio.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            if attempt > 1:
                log.info(
                    "%s succeeded after %d attempts, %.1fs", what, attempt, time.monotonic() - since
                )
            return
