"""`toolgate bench audit-queries` at a size CI affords: it loads through the sink's insert
path, times trace, every QUERIES.md query and verify (figures printed, never asserted)."""

from __future__ import annotations

import pytest

from toolgate.bench.audit_queries import queries_of, run_audit_queries_bench
from toolgate.services.audit.schema import ddl_root


@pytest.mark.slow  # a benchmark: every auditor query over a filled store
def test_the_bench_runs_every_auditor_query_and_verify(capsys) -> None:
    figures = run_audit_queries_bench(events=3000, processes=1)
    out = capsys.readouterr().out
    titles = [title for title, _ in queries_of(ddl_root() / "QUERIES.md")]  # type: ignore[operator]
    assert len(titles) >= 8
    assert all(f"query: {t}" in figures for t in titles)
    assert "audit verify" in out and "OK," in out  # the loaded chains verify
    assert figures["rows"] > 2500 and figures["ingest_per_s"] > 0
