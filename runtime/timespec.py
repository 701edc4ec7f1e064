"""The one time format of every `--since`: a span back from now, or an ISO 8601 time.

    90s  30m  24h  7d          that long before now (seconds, minutes, hours, days)
    2026-03-01                 midnight UTC of that day
    2026-03-01T09:00:00        UTC unless it says otherwise
    2026-03-01T09:00:00Z       the same
    2026-03-01 09:00:00+02:00  07:00 UTC

`parse_since` returns an aware UTC datetime; anything else raises
`TimeSpecError`, whose message is one line saying what is accepted.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

FORMS = "90s, 30m, 24h, 7d or an ISO 8601 time such as 2026-03-01T09:00:00Z"
_SPAN = re.compile(r"(\d{1,9})([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}
# What a time column of the audit can hold (DateTime64 spans 1900..2299).
EARLIEST = datetime(1900, 1, 1, tzinfo=UTC)
LATEST = datetime(2299, 12, 31, tzinfo=UTC)


class TimeSpecError(ValueError):
    """Not a span or an ISO 8601 time; the message is one line."""


def parse_since(text: str, now: datetime | None = None) -> datetime:
    """`text` as the UTC time it names; spans count back from `now` (default: the clock)."""
    value = text.strip()
    span = _SPAN.fullmatch(value)
    if span:
        try:
            moment = (now or datetime.now(UTC)) - timedelta(**{_UNITS[span[2]]: int(span[1])})
        except OverflowError:
            moment = datetime.min.replace(tzinfo=UTC)  # before year 1: refused below
    else:
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise TimeSpecError(f"{text!r} is not a time: give {FORMS}") from None
        moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    if not EARLIEST <= moment <= LATEST:
        raise TimeSpecError(f"{text!r} is {moment:%Y-%m-%d}, outside 1900..2299: give {FORMS}")
    return moment
