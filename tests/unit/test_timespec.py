"""The one `--since` format: spans back from now and ISO 8601 times, always UTC."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from toolgate.runtime.timespec import TimeSpecError, parse_since

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "back"),
    [
        ("90s", timedelta(seconds=90)),
        ("30m", timedelta(minutes=30)),
        ("24h", timedelta(hours=24)),
        ("7d", timedelta(days=7)),
        ("0m", timedelta(0)),
        (" 2h ", timedelta(hours=2)),
    ],
)
def test_spans_count_back_from_now(text, back):
    assert parse_since(text, NOW) == NOW - back


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-03-01", datetime(2026, 3, 1, tzinfo=UTC)),
        ("2026-03-01T09:00:00", datetime(2026, 3, 1, 9, tzinfo=UTC)),
        ("2026-03-01T09:00:00Z", datetime(2026, 3, 1, 9, tzinfo=UTC)),
        ("2026-03-01 09:00:00+02:00", datetime(2026, 3, 1, 7, tzinfo=UTC)),
        ("2026-03-01T09:00:00.250000-05:00", datetime(2026, 3, 1, 14, 0, 0, 250000, tzinfo=UTC)),
    ],
)
def test_iso_times_are_utc_unless_they_say(text, expected):
    found = parse_since(text, NOW)
    assert found == expected and found.utcoffset() == timedelta(0)


def test_the_clock_is_the_default_now():
    before = datetime.now(UTC)
    assert (
        before - timedelta(hours=1, seconds=1)
        <= parse_since("1h")
        <= datetime.now(UTC) - timedelta(hours=1)
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "yesterday",
        "24",
        "h",
        "-1h",
        "1.5h",
        "24 h",
        "2w",
        "24H",
        "1h30m",
        "2026-13-01",
        "0001-01-01",
        "9999999d",
        "3000-01-01",
    ],
)
def test_anything_else_is_one_clear_line(text):
    with pytest.raises(TimeSpecError) as raised:
        parse_since(text, NOW)
    message = str(raised.value)
    assert "\n" not in message and repr(text) in message
    assert "30m, 24h, 7d or an ISO 8601 time" in message
