"""`toolgate audit verify` in ClickHouse: every link recomputed by the server, rows never
pulled out.

What comes back to Python is small: the signed checkpoints (one per insert
batch, their signatures checked here), one line per chain, and the findings.
The per-row work runs in one query: each row's content digest is computed as
the table is read (chain.content_sql), then only the short links, sorted by
chain position, are compared with their predecessor.

Seals (the checkpoints the sink also wrote to the JetStream stream
TOOLGATE_AUDIT_SEALS, which no toolgate role but the operator can delete or
purge) are checked against ClickHouse too: a chain, a checkpoint or a tail
removed from ClickHouse is named even when every trace of it there is gone.
The finding kinds are those of verify.py, which stays the reference
implementation over rows in memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from clickhouse_connect.driver.client import Client
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from toolgate.services.audit.chain import Checkpoint, checkpoint_is_genuine, content_sql
from toolgate.services.audit.verify import Finding, Report, read_checkpoints

MAX_NAMED = 1000  # findings of one kind named row by row; more are counted
# The sort of the links may spill to disk rather than fail on a small machine.
QUERY_SETTINGS = {
    "max_bytes_before_external_sort": 2_000_000_000,
    "max_execution_time": 0,
}

GENESIS_SQL = "lower(hex(SHA256(concat('toolgate-audit-chain/', chain_id))))"


def links_sql() -> str:
    """One row per broken link: a gap, a conflicting second row, a link that does not
    hash, a position below 1. Exact copies of a row (a retried insert) are no finding."""
    link = "lower(hex(SHA256(concat(prev_hash, '/', toString(chain_seq), '/', digest))))"
    return f"""
SELECT chain_id, chain_seq, event_id, event_type, call_id, prev_seq, kind FROM (
  SELECT chain_id, chain_seq, event_id, event_type, call_id, prev_seq,
    multiIf(
      chain_seq < 1, 'inserted:position 0 is the genesis, never a row',
      first AND chain_seq > 1, 'deleted:gap',
      NOT first AND chain_seq = prev_seq AND (chain_hash, digest) = (prev_hash, prev_digest), '',
      NOT first AND chain_seq = prev_seq, 'inserted:a second row at this position',
      NOT first AND chain_seq > prev_seq + 1, 'deleted:gap',
      first AND chain_hash != lower(hex(SHA256(concat({GENESIS_SQL}, '/1/', digest)))),
        'altered:content does not hash to its chain link',
      NOT first AND chain_hash != {link}, 'altered:content does not hash to its chain link',
      '') AS kind
  FROM (
    SELECT chain_id, chain_seq, chain_hash, digest, event_id, event_type, call_id,
      row_number() OVER w = 1 AS first,
      lagInFrame(chain_seq, 1, 0) OVER w AS prev_seq,
      lagInFrame(chain_hash, 1, '') OVER w AS prev_hash,
      lagInFrame(digest, 1, toFixedString('', 32)) OVER w AS prev_digest
    FROM (
      SELECT chain_id, chain_seq, chain_hash, SHA256({content_sql()}) AS digest,
             event_id, event_type, call_id
      FROM event_log
    )
    WINDOW w AS (PARTITION BY chain_id ORDER BY chain_seq, chain_hash, digest
                 ROWS BETWEEN 1 PRECEDING AND CURRENT ROW)
  )
)
WHERE kind != ''
ORDER BY chain_id, chain_seq
LIMIT {MAX_NAMED}
"""


@dataclass
class ChainStats:
    rows: int
    first: int
    last: int


@dataclass
class Seals:
    """What the JetStream seal stream holds (None: not checked)."""

    checkpoints: list[Checkpoint] = field(default_factory=list)


def verify_in_clickhouse(
    client: Client,
    public_key: Ed25519PublicKey,
    seals: Iterable[Checkpoint] | None = None,
) -> Report:
    report = Report()
    stored = read_checkpoints(client)
    signed: dict[str, dict[int, Checkpoint]] = {}
    closed: dict[str, int] = {}

    def admit(checkpoint: Checkpoint, where: str) -> bool:
        if not checkpoint_is_genuine(checkpoint, public_key):
            report.findings.append(
                Finding(
                    "forged",
                    checkpoint.chain_id,
                    str(checkpoint.chain_seq),
                    detail=f"checkpoint signature does not verify ({where})",
                )
            )
            return False
        signed.setdefault(checkpoint.chain_id, {})[checkpoint.chain_seq] = checkpoint
        if checkpoint.final:
            closed[checkpoint.chain_id] = min(
                checkpoint.chain_seq, closed.get(checkpoint.chain_id, checkpoint.chain_seq)
            )
        return True

    for checkpoint in stored:
        report.checkpoints += 1
        admit(checkpoint, "chain_checkpoints")
    if seals is not None:
        in_clickhouse = {(c.chain_id, c.chain_seq, c.chain_hash, c.final) for c in stored}
        for seal in seals:
            if not admit(seal, "JetStream seal"):
                continue
            if (seal.chain_id, seal.chain_seq, seal.chain_hash, seal.final) not in in_clickhouse:
                report.findings.append(
                    Finding(
                        "deleted",
                        seal.chain_id,
                        str(seal.chain_seq),
                        detail="a checkpoint sealed in JetStream is missing from "
                        "chain_checkpoints (removed)",
                    )
                )
    chains = {
        str(chain_id): ChainStats(int(rows), int(first), int(last))
        for chain_id, rows, first, last in client.query(
            "SELECT chain_id, count(), min(chain_seq), max(chain_seq) FROM event_log "
            "GROUP BY chain_id"
        ).result_rows
    }
    report.rows = sum(c.rows for c in chains.values())
    report.chains = len(chains)
    for chain_id, stats in sorted(chains.items()):
        marks = signed.get(chain_id, {})
        if 0 not in marks:
            reason = "no chain" if not chain_id else "a chain no sink signed"
            report.findings += _named_rows(
                client, "inserted", f"row in {reason}", "chain_id = {c:String}", {"c": chain_id}
            )
            continue
        last_signed = max(marks)
        if chain_id in closed and stats.last > closed[chain_id]:
            report.findings += _named_rows(
                client,
                "inserted",
                f"after the final checkpoint at {closed[chain_id]}",
                "chain_id = {c:String} AND chain_seq > {s:UInt64}",
                {"c": chain_id, "s": closed[chain_id]},
            )
        if last_signed > stats.last:
            report.findings.append(
                Finding(
                    "deleted",
                    chain_id,
                    f"{stats.last + 1}-{last_signed}",
                    detail=f"the signed checkpoint at {last_signed} says the chain went "
                    f"that far; it ends at {stats.last}",
                )
            )
        elif stats.last > last_signed and chain_id not in closed:
            report.findings.append(
                Finding(
                    "unsealed",
                    chain_id,
                    f"{last_signed + 1}-{stats.last}",
                    detail="rows after the last checkpoint (the sink stopped before sealing them)",
                )
            )
    for chain_id, marks in sorted(signed.items()):
        if chain_id not in chains and max(marks) > 0:
            report.findings.append(
                Finding(
                    "deleted",
                    chain_id,
                    f"1-{max(marks)}",
                    detail="every row of this signed chain is gone",
                )
            )
    report.findings += _broken_links(client, chains)
    report.findings += _rewritten(client, signed, chains)
    return report


def _named_rows(
    client: Client, kind: str, detail: str, where: str, parameters: dict[str, object]
) -> list[Finding]:
    rows = client.query(
        f"SELECT chain_id, chain_seq, event_id, call_id, event_type FROM event_log "
        f"WHERE {where} ORDER BY chain_seq LIMIT {MAX_NAMED}",
        parameters=parameters,
    ).result_rows
    return [Finding(kind, str(r[0]), str(r[1]), r[2], r[3], r[4], detail) for r in rows]


def _broken_links(client: Client, chains: dict[str, ChainStats]) -> list[Finding]:
    findings = []
    for chain_id, seq, event_id, event_type, call_id, prev_seq, kind in client.query(
        links_sql(), settings=QUERY_SETTINGS
    ).result_rows:
        what, detail = str(kind).split(":", 1)
        if what == "deleted":
            start = int(prev_seq) + 1 if int(prev_seq) else 1
            span = f"{start}-{seq - 1}" if seq - 1 > start else str(start)
            findings.append(
                Finding(
                    "deleted",
                    str(chain_id),
                    span,
                    detail=f"{seq - start} row(s) missing before event {event_id}",
                )
            )
            continue
        findings.append(
            Finding(what, str(chain_id), str(seq), event_id, call_id, event_type, detail)
        )
    return findings


def _quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _rewritten(
    client: Client, signed: dict[str, dict[int, Checkpoint]], chains: dict[str, ChainStats]
) -> list[Finding]:
    """Links re-hashed without the key: the stored link at a signed position differs."""
    wanted = [
        (chain_id, seq, mark.chain_hash)
        for chain_id, marks in signed.items()
        if chain_id in chains
        for seq, mark in marks.items()
        if 0 < seq <= chains[chain_id].last
    ]
    if not wanted:
        return []
    literal = ", ".join(f"({_quote(c)}, {int(s)}, {_quote(h)})" for c, s, h in wanted)
    found = client.query(
        "SELECT chain_id, chain_seq, chain_hash FROM event_log "
        f"WHERE (chain_id, chain_seq, chain_hash) IN ({literal})",
        settings=QUERY_SETTINGS,
    ).result_rows
    matched = {(str(c), int(s)) for c, s, _ in found}
    findings = []
    previous: dict[str, int] = {}
    for chain_id, seq, _ in sorted(wanted):
        if (chain_id, seq) not in matched:
            findings.append(
                Finding(
                    "rewritten",
                    chain_id,
                    f"{previous.get(chain_id, 0) + 1}-{seq}",
                    detail="stored links disagree with the signed checkpoint at "
                    f"{seq}: rows were re-hashed (or the row there is gone)",
                )
            )
        previous[chain_id] = seq
    return findings
