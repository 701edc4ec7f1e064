"""The audit benchmark runs end to end (figures are printed, never asserted)."""

from __future__ import annotations

import pytest

from toolgate.bench.audit import ROWS_PER_CALL, run_audit_bench


@pytest.mark.slow  # a sink process, ClickHouse and 300 calls' events
def test_audit_bench_measures_a_sink_process(capsys):
    figures = run_audit_bench(calls=300, pipeline_events_per_s=1000.0)
    assert figures.rows == 300 * ROWS_PER_CALL
    assert figures.sink_rows_per_s > 0 and figures.ratio == figures.sink_rows_per_s / 1000.0
    assert "rows/s sustained into ClickHouse" in capsys.readouterr().out
