"""`python -m toolgate.bench.audit_rows`: the audit sink's Python CPU per row, part by part.

The sink's work between a batch of stored messages and ClickHouse, without NATS or
ClickHouse: the messages `bench audit-queries` loads (the same templates), read from
their ack subjects (stored_message), built into rows with their content digests
(AuditWriter._rows), linked into a chain (Chain.link), turned into the insert's columns
(insert_columns) and serialized as clickhouse-connect sends them (Native, lz4), each
part timed on its own in CPU seconds of this process (the machine is shared: CPU per
row is the figure to trust, not wall time). Best of --repeat runs. `--profile` prints
cProfile's top frames of the whole path instead.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Any

from toolgate.bench.audit_queries import _templates, story_messages

BATCH_ROWS = 10_000


def messages_of(rows: int) -> list[Any]:
    templates = _templates()
    stories = max(1, rows // 5)
    seq = [0]
    out: list[Any] = []
    i = 0
    while len(out) < rows:
        out += story_messages(templates, i, seq, stories)
        i += 1
    return out[:rows]


def _writer() -> Any:
    """An AuditWriter that is never started: its builder, chain and row making, no I/O."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry
    from toolgate.services.audit.connection import ClickHouseTarget
    from toolgate.services.audit.rows import RowBuilder
    from toolgate.services.audit.writer import AuditWriter

    return AuditWriter(
        ClickHouseTarget.from_url("http://127.0.0.1:9/audit"),
        RowBuilder(load_registry(BUILTIN_TOOLS_DIR)),
        Ed25519PrivateKey.generate(),
        "bench-rows",
    )


def _native(columns: list[Any], rows: int) -> int:
    """The insert's body as clickhouse-connect makes it (Native, lz4: the client's
    default), without sending it. Returns its size."""
    from clickhouse_connect.datatypes.registry import get_from_name
    from clickhouse_connect.driver.insert import InsertContext
    from clickhouse_connect.driver.transform import NativeTransform

    from toolgate.services.audit.rows import INSERT_COLUMNS
    from toolgate.services.audit.writer import NATIVE_TYPES

    context = InsertContext(
        "event_log",
        list(INSERT_COLUMNS),
        [get_from_name(name) for name in NATIVE_TYPES.values()],
        data=columns,
        column_oriented=True,
        compression="lz4",
    )
    context.req_block_size = max(rows, 1)
    return sum(len(chunk) for chunk in NativeTransform.build_insert(context))


PARTS = ("stored", "rows", "link", "columns", "native")


def measure(rows: int, repeat: int) -> dict[str, float]:
    """Microseconds of CPU per row of each part (best of `repeat`), as AuditWriter.write
    runs them: stored_message, _rows (rows and content digests), Chain.link,
    insert_columns, and clickhouse-connect's Native serialization of the columns."""
    from toolgate.services.audit.writer import insert_columns, stored_message

    messages = messages_of(rows)
    writer = _writer()
    best: dict[str, float] = {}
    for _ in range(repeat):
        spent: dict[str, float] = dict.fromkeys(PARTS, 0.0)
        for start in range(0, len(messages), BATCH_ROWS):
            batch = messages[start : start + BATCH_ROWS]
            t0 = time.process_time()
            stored = [stored_message(m) for m in batch]
            t1 = time.process_time()
            built, digests = writer._rows(stored)
            t2 = time.process_time()
            linked = writer.chain.link(built, digests)
            t3 = time.process_time()
            columns = insert_columns(linked)
            t4 = time.process_time()
            _native(columns, len(linked))
            t5 = time.process_time()
            writer.chain.commit(linked)
            laps = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)
            for part, seconds in zip(PARTS, laps, strict=True):
                spent[part] += seconds
        for part, seconds in spent.items():
            best[part] = min(best.get(part, float("inf")), 1e6 * seconds / len(messages))
    best["total"] = sum(best.values())
    return best


def profile(rows: int, top: int) -> None:
    from toolgate.services.audit.writer import insert_columns, stored_message

    messages = messages_of(rows)
    writer = _writer()

    def path() -> None:
        for start in range(0, len(messages), BATCH_ROWS):
            built, digests = writer._rows(
                [stored_message(m) for m in messages[start : start + BATCH_ROWS]]
            )
            linked = writer.chain.link(built, digests)
            writer.chain.commit(linked)
            _native(insert_columns(linked), len(linked))

    profiler = cProfile.Profile()
    profiler.runcall(path)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolgate.bench.audit_rows")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per run")
    parser.add_argument("--repeat", type=int, default=5, help="runs; the best is printed")
    parser.add_argument("--profile", action="store_true", help="cProfile's top frames instead")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    if args.rows < 1 or args.repeat < 1:
        print("audit_rows: --rows and --repeat must be >= 1")
        return 2
    if args.profile:
        profile(args.rows, args.top)
        return 0
    figures = measure(args.rows, args.repeat)
    print(f"audit sink CPU per row, best of {args.repeat} runs of {args.rows} rows:")
    for part, us in figures.items():
        print(f"  {part:8s} {us:7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
