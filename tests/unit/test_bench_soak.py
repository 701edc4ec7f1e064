"""The soak's figures from its samples: slopes, flatness, levelling off, slices, the report."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from toolgate.bench import soak
from toolgate.bench.soak import ConsumerLag, Driven, Sample, SoakReport, StreamHeld


def test_the_slope_is_the_least_squares_fit() -> None:
    assert soak.slope_per_s([(0, 10.0), (10, 20.0), (20, 30.0)]) == pytest.approx(1.0)
    assert soak.slope_per_s([(0, 10.0), (10, 12.0), (20, 10.0)]) == pytest.approx(0.0)
    assert soak.slope_per_s([(5, 10.0)]) == 0.0
    assert soak.slope_per_s([(5, 10.0), (5, 20.0)]) == 0.0


def samples(series: dict[str, list[float]], every: float = 10.0) -> list[Sample]:
    length = len(next(iter(series.values())))
    return [
        Sample(i * every, i * 100, {name: values[i] for name, values in series.items()})
        for i in range(length)
    ]


def test_a_process_is_flat_unless_its_second_half_grows_past_the_tolerance() -> None:
    taken = samples(
        {
            "validator": [50, 80, 80, 80.5, 80, 80.4, 80.2, 80.3, 80.1],  # warm-up, then flat
            "nats-server": [50, 60, 70, 80, 90, 100, 110, 120, 130],  # 10 MiB every 10 s
            "client": [30, 31, 32, 33, 34, 35, 36, 37, 38],
        }
    )
    rows = {row.name: row for row in soak.memory_rows(taken, warm_end_s=10)}
    assert list(rows) == ["validator", "nats-server", "client"]  # the bench's order
    assert rows["validator"].warm_mb == 80  # the sample at warm-up end, not the first
    assert rows["validator"].end_mb == pytest.approx(80.1)
    assert rows["validator"].flat
    nats = rows["nats-server"]
    assert nats.slope_mb_per_min == pytest.approx(60.0)
    assert nats.half_growth_mb == pytest.approx(40.0)  # from 40 s to 80 s
    assert nats.tolerance_mb == pytest.approx(soak.FLAT_MIB)
    assert not nats.flat
    assert soak.tolerance_mb(1000.0) == pytest.approx(1000.0 * soak.FLAT_FRACTION)


def test_a_series_levels_off_where_nothing_after_outgrows_it() -> None:
    rising_then_flat = [(t * 10.0, min(50.0 + t * 20, 150.0)) for t in range(20)]
    assert soak.levels_off(rising_then_flat) == (50.0, 150.0)
    still_rising = [(t * 10.0, 50.0 + t * 20) for t in range(20)]
    assert soak.levels_off(still_rising) is None
    wobbling = [(0.0, 100.0), (10.0, 101.0), (20.0, 100.5), (30.0, 101.2)]
    assert soak.levels_off(wobbling) == (0.0, 100.0)
    assert soak.levels_off([]) is None


def test_slices_count_what_was_lost_and_take_percentiles_of_the_rest() -> None:
    figures = soak.slice_figures("first 4", [4.0, math.nan, 1.0, 2.0])
    assert (figures.calls, figures.answered) == (4, 3)
    assert (figures.p50_ms, figures.max_ms) == (2.0, 4.0)
    assert soak.slice_size(300) == 30
    assert soak.slice_size(100_000) == soak.SLICE
    assert soak.slice_size(3) == 1


def test_the_table_shows_at_most_a_dozen_evenly_spread_samples() -> None:
    taken = samples({"nats-server": [float(i) for i in range(100)]})
    shown = soak.over_time(taken)
    assert len(shown) == soak.OVER_TIME_ROWS
    assert shown[0] is taken[0] and shown[-1] is taken[-1]
    assert soak.over_time(taken[:5]) == taken[:5]


def test_stored_messages_per_call_come_from_the_first_and_last_samples() -> None:
    taken = samples({"nats-server": [50.0, 60.0, 70.0]})
    for sample, stored in zip(taken, (1000, None, 3000), strict=True):
        sample.stored = stored
    assert soak.stored_per_call(taken) == pytest.approx(2000 / 200)
    assert soak.stored_per_call(taken[:1]) is None


def report(**changes: object) -> SoakReport:
    latencies = [2.0] * 100
    latencies[-1] = math.nan
    given: dict[str, object] = {
        "calls": 100,
        "rate": 10.0,
        "rate_how": "the rate given",
        "target": "a private gateway",
        "load_at_start": (0.4, 0.5, 0.6),
        "driven": Driven(latencies, 10.0, ok=98, not_ok=1, lost=1),
        "samples": samples(
            {
                "validator": [80.0] * 6,
                "audit": [100.0, 120, 140, 160, 180, 200],
                "nats-server": [60.0, 70, 75, 75, 75, 75],
                "client": [40.0] * 6,
            },
            every=2.0,
        ),
        "sample_every_s": 2.0,
        "consumers_at_end": [
            ConsumerLag("TOOLGATE_CALLS", "validator", 3, 1),
            ConsumerLag("TOOLGATE_EVENTS", "audit", 0, 40),
        ],
        "caught_up_after_s": 1.5,
        "consumers_after": [
            ConsumerLag("TOOLGATE_CALLS", "validator", 0, 0),
            ConsumerLag("TOOLGATE_EVENTS", "audit", 0, 0),
        ],
        "streams_at_end": [StreamHeld("TOOLGATE_CALLS", 500, 2 * 1024 * 1024)],
        "cpu_s": {"validator": 0.2, "client": 0.1},
    }
    given.update(changes)
    return SoakReport(**given)  # type: ignore[arg-type]


def checks(text: str) -> dict[str, str]:
    table = text.split("| check | result |")[1].split("\n\n")[0]
    rows = [line.split(" | ", 1) for line in table.strip().splitlines()[1:]]
    return {name.lstrip("| "): value.rstrip(" |") for name, value in rows}


def test_the_report_gives_its_verdicts_from_the_figures() -> None:
    text = soak.render(report())
    verdicts = checks(text)
    assert verdicts["every call answered"] == "no: 99 of 100 (98 ok, 1 not ok, 1 lost, 0 errors)"
    assert verdicts["memory flat after warm-up (each gateway process)"].startswith("no: audit +")
    assert verdicts["first and last 10 calls within 20%"] == (
        "yes: p50 1.00x, p99 1.00x (last / first)"
    )
    assert verdicts["no consumer behind at the end"] == (
        "yes: all caught up 1.5 s after the calls ended"
    )
    assert verdicts["nats-server's memory levels off"] == "yes: at 75.0 MiB from 4 s"
    assert "Warning" not in text
    for row in (
        "| validator | 80.0 | 80.0 | +0.00 | +0.0 | yes | 2.00 |",
        "| client (this bench) | 40.0 | 40.0 |",
        "| TOOLGATE_CALLS | validator | 3 | 1 | 0 | 0 |",
        "| TOOLGATE_EVENTS | audit | 0 | 40 | 0 | 0 |",
        "| TOOLGATE_CALLS | 500 | 2.0 |",
        "| last 10 | 10 | 9 | 2.00 | 2.00 | 2.00 |",
        "| not ok (the result said so) | 1 |",
        "| lost (no result within 60 s) | 1 |",
    ):
        assert row in text, row


def test_a_busy_machine_and_a_consumer_behind_are_said() -> None:
    text = soak.render(
        report(
            load_at_start=(2.5, 2.0, 1.0),
            caught_up_after_s=None,
            consumers_after=[ConsumerLag("TOOLGATE_EVENTS", "audit", 7, 0)],
            driven=Driven([2.0] * 100, 10.0, ok=100, errors=Counter({"NoRespondersError": 0})),
        )
    )
    assert "**Warning:** the load average was 2.50 at the start" in text
    verdicts = checks(text)
    assert verdicts["every call answered"].startswith("yes: 100 of 100")
    assert verdicts["no consumer behind at the end"].startswith("no: 1 consumers still behind")
    assert "\nNone.\n" in text  # no errors


def test_without_the_operator_s_connection_consumers_are_not_measured() -> None:
    text = soak.render(report(consumers_at_end=[], consumers_after=[], caught_up_after_s=None))
    assert checks(text)["no consumer behind at the end"] == (
        "not measured (no operator connection: --creds)"
    )
