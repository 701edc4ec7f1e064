"""`toolgate audit verify`: recompute every sink's chain and check it against the signatures.

Finds, and names by chain position and event_id:
  altered    a row whose content no longer hashes to its link
  deleted    a missing chain position (a gap, or rows a signed checkpoint says existed)
  inserted   a row no sink chained: no chain, a chain nobody signed, a second row at
             one position, or a row after a chain's final checkpoint
  rewritten  links recomputed by someone without the key: they disagree with a signature
  forged     a checkpoint whose signature does not verify
and, as a warning only, `unsealed`: rows after the last checkpoint of a chain
whose sink stopped without a final one (it died between insert and seal).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from clickhouse_connect.driver.client import Client
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from toolgate.services.audit.chain import (
    CHECKPOINT_COLUMNS,
    Checkpoint,
    checkpoint_is_genuine,
    content_bytes,
    genesis_hash,
    link_hash,
)
from toolgate.services.audit.rows import INSERT_COLUMNS

TAMPER_KINDS = ("altered", "deleted", "inserted", "rewritten", "forged")


@dataclass(frozen=True)
class Finding:
    kind: str
    chain_id: str
    chain_seq: str  # one position "17" or a range "17-20"
    event_id: str = ""
    call_id: str = ""
    event_type: str = ""
    detail: str = ""

    def line(self) -> str:
        row = (
            f" event {self.event_id} ({self.event_type}, call {self.call_id})"
            if self.event_id
            else ""
        )
        return (
            f"{self.kind.upper():9} chain {self.chain_id} seq {self.chain_seq}{row}: {self.detail}"
        )


@dataclass
class Report:
    rows: int = 0
    chains: int = 0
    checkpoints: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def tampered(self) -> list[Finding]:
        return [f for f in self.findings if f.kind in TAMPER_KINDS]

    @property
    def ok(self) -> bool:
        return not self.tampered


def _named(kind: str, row: dict[str, Any], detail: str) -> Finding:
    return Finding(
        kind,
        row["chain_id"],
        str(row["chain_seq"]),
        row["event_id"],
        row["call_id"],
        row["event_type"],
        detail,
    )


def verify(
    rows: Iterable[dict[str, Any]], checkpoints: Iterable[Checkpoint], public_key: Ed25519PublicKey
) -> Report:
    """`rows` ordered by (chain_id, chain_seq), as `read_rows` yields them."""
    report = Report()
    signed: dict[str, dict[int, Checkpoint]] = {}
    closed: dict[str, int] = {}  # chain -> position of its final checkpoint
    for checkpoint in checkpoints:
        report.checkpoints += 1
        if not checkpoint_is_genuine(checkpoint, public_key):
            report.findings.append(
                Finding(
                    "forged",
                    checkpoint.chain_id,
                    str(checkpoint.chain_seq),
                    detail="checkpoint signature does not verify",
                )
            )
            continue
        signed.setdefault(checkpoint.chain_id, {})[checkpoint.chain_seq] = checkpoint
        if checkpoint.final:
            closed[checkpoint.chain_id] = min(
                checkpoint.chain_seq, closed.get(checkpoint.chain_id, checkpoint.chain_seq)
            )
    seen: set[str] = set()
    for chain_id, group in itertools.groupby(rows, key=lambda r: r["chain_id"]):
        chain_rows = list(group)
        report.rows += len(chain_rows)
        report.chains += 1
        seen.add(chain_id)
        marks = signed.get(chain_id, {})
        if 0 not in marks:
            reason = "no chain" if not chain_id else "a chain no sink signed"
            report.findings += [_named("inserted", r, f"row in {reason}") for r in chain_rows]
            continue
        report.findings += _verify_chain(chain_id, chain_rows, marks, closed.get(chain_id))
    for chain_id, marks in signed.items():
        if chain_id not in seen and max(marks) > 0:
            report.findings.append(
                Finding(
                    "deleted",
                    chain_id,
                    f"1-{max(marks)}",
                    detail="every row of this signed chain is gone",
                )
            )
    return report


def _verify_chain(
    chain_id: str, rows: list[dict[str, Any]], marks: dict[int, Checkpoint], closed_at: int | None
) -> list[Finding]:
    findings: list[Finding] = []
    previous: str | None = genesis_hash(chain_id)  # None: unknown, after a gap
    expected, last_row = 1, None
    last_signed = max(marks)
    checked_since = 0  # the last signed position the chain agreed with
    for seq, group in itertools.groupby(rows, key=lambda r: r["chain_seq"]):
        # Exact copies (a retried insert the dedupe window missed) are one row.
        candidates = list({(content_bytes(r), r["chain_hash"]): r for r in group}.values())
        if seq < 1:
            findings += [
                _named("inserted", r, "position 0 is the genesis, never a row") for r in candidates
            ]
            continue
        if seq > expected:
            after = f"after event {last_row['event_id']}" if last_row else "at the start"
            findings.append(
                Finding(
                    "deleted",
                    chain_id,
                    f"{expected}-{seq - 1}" if seq - 1 > expected else str(expected),
                    detail=f"{seq - expected} row(s) missing {after}, before "
                    f"event {candidates[0]['event_id']}",
                )
            )
            previous = None
        if closed_at is not None and seq > closed_at:
            findings += [
                _named("inserted", r, f"after the final checkpoint at {closed_at}")
                for r in candidates
            ]
            continue
        chosen = _choose(candidates, previous, seq, last_row, findings)
        previous, expected, last_row = chosen["chain_hash"], seq + 1, chosen
        mark = marks.get(seq)
        if mark is not None:
            if mark.chain_hash != chosen["chain_hash"]:
                findings.append(
                    Finding(
                        "rewritten",
                        chain_id,
                        f"{checked_since + 1}-{seq}",
                        detail="stored links disagree with the signed "
                        f"checkpoint at {seq}: rows were re-hashed",
                    )
                )
            checked_since = seq
    end = last_row["chain_seq"] if last_row else 0
    if last_signed > end:
        findings.append(
            Finding(
                "deleted",
                chain_id,
                f"{end + 1}-{last_signed}",
                detail=f"the signed checkpoint at {last_signed} says the chain "
                f"went that far; it ends at {end}",
            )
        )
    elif end > last_signed and closed_at is None:
        findings.append(
            Finding(
                "unsealed",
                chain_id,
                f"{last_signed + 1}-{end}",
                detail="rows after the last checkpoint (the sink stopped before sealing them)",
            )
        )
    return findings


def _choose(
    candidates: list[dict[str, Any]],
    previous: str | None,
    seq: int,
    last_row: dict[str, Any] | None,
    findings: list[Finding],
) -> dict[str, Any]:
    """The row that holds position `seq`; every other candidate is reported."""
    if previous is None:  # after a gap nothing links back: take the stored link as anchor
        for extra in candidates[1:]:
            findings.append(_named("inserted", extra, "a second row at this position"))
        return candidates[0]
    linked = [r for r in candidates if link_hash(previous, seq, r) == r["chain_hash"]]
    if linked:
        for extra in candidates:
            if extra is not linked[0]:
                findings.append(
                    _named(
                        "inserted", extra, "a second row at this position, not linked to the chain"
                    )
                )
        return linked[0]
    before = f" (or event {last_row['event_id']} before it was re-hashed)" if last_row else ""
    for row in candidates:
        findings.append(
            _named(
                "altered" if len(candidates) == 1 else "inserted",
                row,
                "content does not hash to its chain link" + before,
            )
        )
    return candidates[0]


# -- reading from ClickHouse --------------------------------------------------------------


def read_rows(client: Client) -> Iterator[dict[str, Any]]:
    """Every physical row of event_log, chain order, streamed in blocks."""
    columns = ", ".join(INSERT_COLUMNS)
    with client.query_row_block_stream(
        f"SELECT {columns} FROM event_log ORDER BY chain_id, chain_seq"
    ) as stream:
        for block in stream:
            for values in block:
                yield dict(zip(INSERT_COLUMNS, values, strict=True))


def read_checkpoints(client: Client) -> list[Checkpoint]:
    columns = ", ".join(CHECKPOINT_COLUMNS)
    result = client.query(f"SELECT DISTINCT {columns} FROM chain_checkpoints")
    return [
        Checkpoint(
            chain_id=r[0],
            chain_seq=int(r[1]),
            chain_hash=r[2],
            final=bool(r[3]),
            writer=r[4],
            signed_at=r[5],
            key_id=r[6],
            signature=r[7],
        )
        for r in result.result_rows
    ]


def verify_store(
    client: Client, public_key: Ed25519PublicKey, seals: list[Checkpoint] | None = None
) -> Report:
    """Verify what is in ClickHouse, in ClickHouse (verify_sql.py), against `seals` too
    when given (the checkpoints kept in JetStream)."""
    from toolgate.services.audit.verify_sql import verify_in_clickhouse

    return verify_in_clickhouse(client, public_key, seals)
