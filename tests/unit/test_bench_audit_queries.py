"""The synthetic stories of `toolgate bench audit-queries`: each has its own time, in the
raw call's stored time and in every event (a call's events in the hour of its raw call,
as the pipeline makes them)."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from toolgate.bench.audit_queries import START, _templates, story_messages


def _times(i: int, total: int) -> tuple[datetime, set[str]]:
    messages = story_messages(_templates(), i, [0], total)
    stored_ns = int(messages[0].reply.split(".")[-2])
    stored = datetime.fromtimestamp(stored_ns / 1e9, UTC)
    occurred = {msgspec.json.decode(m.data)["occurred_at"] for m in messages[1:]}
    return stored, occurred


def test_every_event_of_a_story_carries_the_story_time():
    total = 1_000_000
    for i in (0, 123_457, 999_999):
        stored, occurred = _times(i, total)
        assert stored >= START
        assert occurred == {stored.strftime("%Y-%m-%dT%H:%M:%S.%fZ")}, (i, stored, occurred)
    assert _times(1, total)[1] != _times(500_000, total)[1]  # spread over the days
