"""Progress lines of long operator commands: a fake clock, no waiting."""

from __future__ import annotations

import io

from toolgate.services.audit.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def progress(total: int | None = 10) -> tuple[Progress, Clock, io.StringIO]:
    clock, out = Clock(), io.StringIO()
    return (
        Progress("toolgate audit verify", "rows read", total, out=out, interval_s=2.0, clock=clock),
        clock,
        out,
    )


def test_quick_work_prints_nothing():
    p, clock, out = progress()
    for _ in range(10):
        clock.now += 0.1
        p.advance()
    p.finish()
    assert out.getvalue() == ""


def test_slow_work_prints_a_line_per_interval_and_the_last_count():
    p, clock, out = progress()
    for _ in range(10):
        clock.now += 0.9  # 1 line per ~3 items
        p.advance()
    p.finish()
    lines = out.getvalue().splitlines()
    assert lines == [
        "toolgate audit verify: 3/10 rows read (30%), 3 s",
        "toolgate audit verify: 6/10 rows read (60%), 5 s",
        "toolgate audit verify: 9/10 rows read (90%), 8 s",
        "toolgate audit verify: 10/10 rows read (100%), 9 s",
    ]


def test_a_line_even_when_nothing_finishes_and_counts_without_a_total():
    p, clock, out = progress(None)
    clock.now += 5
    p.maybe_report()  # e.g. replay's ticker while every call still waits
    p.maybe_report()  # not again within the interval
    assert out.getvalue() == "toolgate audit verify: 0 rows read, 5 s\n"


def test_counted_advances_as_items_are_taken():
    p, clock, out = progress(3)
    taken = []
    for item in p.counted("abc"):
        clock.now += 3
        taken.append((item, p.done))
    assert taken == [("a", 0), ("b", 1), ("c", 2)] and p.done == 3
    assert [line.split(" (")[0] for line in out.getvalue().splitlines()] == [
        f"toolgate audit verify: {n}/3 rows read" for n in (1, 2, 3)
    ]
