"""`toolgate bench policy` measures decisions with an entity lookup, cached and not."""

from __future__ import annotations

import pytest

from toolgate.bench.policy import run_resource_bench


def test_the_resource_bench_reports_cached_and_uncached_lookups(
    capsys: pytest.CaptureFixture[str],
) -> None:
    figures = run_resource_bench(200)
    for kind in ("none", "cached", "uncached"):
        assert figures[f"resource_{kind}_p50_us"] > 0
    # A cached lookup costs less than reading the database (generous: CI boxes are noisy).
    assert figures["resource_cached_p50_us"] < figures["resource_uncached_p50_us"]
    printed = capsys.readouterr().out
    assert "one Order, cached" in printed and "the cached lookup adds" in printed
