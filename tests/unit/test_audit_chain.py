"""The hash chain and its signed checkpoints: each kind of tampering is found and named."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import load_registry
from toolgate.services.audit.chain import Chain, Checkpoint, link_hash, sign_checkpoint
from toolgate.services.audit.rows import RowBuilder, StoredMessage
from toolgate.services.audit.verify import Report, verify

KEY = Ed25519PrivateKey.generate()
T0 = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
P = Principal(tenant="acme", user="u", agent="a", session="s")


BUILDER = RowBuilder(load_registry())


def rows(n: int, start: int = 1) -> list[dict]:  # type: ignore[type-arg]
    return [
        BUILDER.row_for(
            StoredMessage(
                "TOOLGATE_CALLS",
                seq,
                T0,
                "toolgate.calls.acme.a",
                msgspec.json.encode(
                    ToolCall(
                        call_id=f"c-{seq}", tool="search_sources", arguments={"n": seq}, principal=P
                    )
                ),
            )
        )
        for seq in range(start, start + n)
    ]


def seal(chain: Chain, final: bool = False, key: Ed25519PrivateKey = KEY) -> Checkpoint:
    return sign_checkpoint(Checkpoint(chain.chain_id, chain.seq, chain.head, final, "w", T0), key)


def written(
    batches: tuple[int, ...] = (4, 3, 5), final: bool = False, chain_id: str = "sink-a"
) -> tuple[list[dict], list[Checkpoint]]:  # type: ignore[type-arg]
    """A chain as a sink writes it: genesis checkpoint, then a checkpoint per batch."""
    chain, table, marks = Chain(chain_id), [], []
    marks.append(seal(chain))
    start = 1
    for size in batches:
        linked = chain.link(rows(size, start))
        chain.commit(linked)
        table += linked
        marks.append(seal(chain))
        start += size
    if final:
        marks.append(seal(chain, final=True))
    return table, marks


def check(table, marks) -> Report:  # type: ignore[no-untyped-def]
    ordered = sorted(table, key=lambda r: (r["chain_id"], r["chain_seq"]))
    return verify(ordered, marks, KEY.public_key())


def kinds(report: Report) -> list[tuple[str, str, str]]:
    return [(f.kind, f.chain_seq, f.event_id) for f in report.findings]


def test_an_untouched_chain_verifies():
    table, marks = written()
    report = check(table, marks)
    assert report.ok and report.findings == [] and report.rows == 12


def test_link_is_tentative_until_commit():
    chain = Chain("c")
    linked = chain.link(rows(2))
    assert chain.seq == 0
    chain.commit(linked)
    assert (chain.seq, chain.head) == (2, linked[-1]["chain_hash"])


def test_an_altered_row_is_named():
    table, marks = written()
    table[5] = {**table[5], "user": "u-mallory"}
    report = check(table, marks)
    assert kinds(report) == [("altered", "6", table[5]["event_id"])]
    assert not report.ok


def test_a_deleted_row_is_named_by_its_position_and_neighbours():
    table, marks = written()
    gone = table.pop(6)
    report = check(table, marks)
    assert [(f.kind, f.chain_seq) for f in report.findings] == [("deleted", "7")]
    assert table[5]["event_id"] in report.findings[0].detail
    assert gone["event_id"] not in report.findings[0].detail


def test_deleting_the_tail_is_caught_by_the_last_checkpoint():
    table, marks = written()
    report = check(table[:-2], marks)
    assert [(f.kind, f.chain_seq) for f in report.findings] == [("deleted", "11-12")]


def test_an_inserted_row_is_named_wherever_it_claims_to_be():
    table, marks = written(final=True)
    forged = rows(1, start=99)[0]
    in_no_chain = {**forged, "chain_id": "", "chain_seq": 0, "chain_hash": ""}
    unsigned_chain = {
        **forged,
        "event_id": "f2",
        "chain_id": "sink-x",
        "chain_seq": 1,
        "chain_hash": link_hash("x", 1, forged),
    }
    second_at_3 = {
        **forged,
        "event_id": "f3",
        "chain_id": "sink-a",
        "chain_seq": 3,
        "chain_hash": table[2]["chain_hash"],
    }
    after_final = {
        **forged,
        "event_id": "f4",
        "chain_id": "sink-a",
        "chain_seq": 13,
        "chain_hash": link_hash(table[-1]["chain_hash"], 13, forged),
    }
    report = check(table + [in_no_chain, unsigned_chain, second_at_3, after_final], marks)
    assert sorted(kinds(report)) == sorted(
        [
            ("inserted", "0", forged["event_id"]),
            ("inserted", "1", "f2"),
            ("inserted", "3", "f3"),
            ("inserted", "13", "f4"),
        ]
    )


def test_rehashing_without_the_key_disagrees_with_the_signature():
    table, marks = written()
    # Change row 2 and recompute every link after it, as someone without the key could.
    table[1] = {**table[1], "status": "ok"}
    previous = table[0]["chain_hash"]
    for i in range(1, len(table)):
        table[i] = {**table[i], "chain_hash": link_hash(previous, i + 1, table[i])}
        previous = table[i]["chain_hash"]
    report = check(table, marks)
    assert ("rewritten", "1-4", "") in kinds(report)
    assert not report.ok


def test_a_forged_checkpoint_is_reported_and_ignored():
    table, marks = written()
    forged = seal(Chain("sink-a"), key=Ed25519PrivateKey.generate())
    report = check(table, [*marks, forged])
    assert [f.kind for f in report.findings] == ["forged"]


def test_rows_after_the_last_checkpoint_of_a_crashed_sink_are_only_a_warning():
    table, marks = written()
    report = check(table, marks[:-1])
    assert [(f.kind, f.chain_seq) for f in report.findings] == [("unsealed", "8-12")]
    assert report.ok


def test_an_exact_copy_of_a_row_is_not_tampering():
    table, marks = written()
    assert check(table + [dict(table[3])], marks).findings == []


@pytest.mark.parametrize("replicas", [2, 3])
def test_several_writers_each_verify_on_their_own(replicas):
    table, marks = [], []
    for i in range(replicas):
        t, m = written(chain_id=f"sink-{i}")
        table += t
        marks += m
    report = check(table, marks)
    assert report.ok and report.chains == replicas


def test_replicas_creating_the_seal_key_at_once_all_load_one_whole_key(tmp_path):
    """Several sinks starting together on one host: none may read a half-written key."""
    import multiprocessing

    from toolgate.services.audit.chain import ensure_seal_key, load_seal_public_key

    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        keys = pool.map(_key_id_of, [tmp_path] * 8)
    public = load_seal_public_key(tmp_path)
    assert len(set(keys)) == 1
    assert keys[0] == _key_id_of(tmp_path)
    assert ensure_seal_key(tmp_path).public_key().public_bytes_raw() == public.public_bytes_raw()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit-seal.key", "audit-seal.pub"]


def _key_id_of(path):  # type: ignore[no-untyped-def]
    from toolgate.services.audit.chain import ensure_seal_key

    return ensure_seal_key(path).public_key().public_bytes_raw().hex()


def test_the_bytes_a_link_hashes_are_pinned():
    """Stored chains must keep verifying: the content encoding and the inserted time text
    are pinned byte for byte, whatever makes them faster (an aware time in any zone, or a
    naive one as read back, is the same instant)."""
    from datetime import timedelta, timezone

    from toolgate.services.audit.chain import content_bytes, time_text
    from toolgate.services.audit.rows import CONTENT_COLUMNS, to_micros

    at = datetime(2026, 3, 1, 9, 0, 0, 5, tzinfo=UTC)
    row = dict.fromkeys(CONTENT_COLUMNS, "")
    row.update(event_id="é1", occurred_at=at, duration_ms=1.25, source_seq=7, note=None)
    # As computed by the encoding every stored chain was written with.
    expected = (
        b"3:\xc3\xa910:0:16:1772355600000005" + b"0:" * 15 + b"19:46083083187068600321:N0:0:1:7"
    )
    assert content_bytes(row) == expected
    for same in (at, at.astimezone(timezone(timedelta(hours=-5))), at.replace(tzinfo=None)):
        assert to_micros(same) == 1772355600000005
        assert time_text(same) == "2026-03-01 09:00:00.000005"
    assert time_text(datetime(1900, 1, 2, tzinfo=UTC)) == "1900-01-02 00:00:00.000000"
