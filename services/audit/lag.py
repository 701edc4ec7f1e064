"""How far behind the audit sink is: the age of the oldest message it has not written.

For each source (the audit's rows of the handler table: a durable on a
stream), the durable's ack floor says what was written (every message up to
it is acked, and a message is acked only once its row is in ClickHouse);
the next stored message after it is the oldest unwritten,
and its storage time says for how long it has waited. `toolgate status` or a
metric can show `audit_lag`; the sink logs a warning itself past a threshold.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.client import Client
from nats.js.errors import NotFoundError

from toolgate.runtime.topology import rows_of

WARN_AFTER_S = 60.0


@dataclass(frozen=True)
class SourceLag:
    stream: str
    unwritten: int  # messages stored and not yet acked by the sink
    oldest_unwritten_s: float  # age of the oldest of them; 0 when none

    def line(self) -> str:
        return (
            f"{self.stream}: {self.unwritten} message(s) not yet in ClickHouse, "
            f"oldest {self.oldest_unwritten_s:.1f} s"
        )


def lag_seconds(stored_at: datetime, now: datetime) -> float:
    return max(0.0, (now - stored_at).total_seconds())


async def audit_lag(nc: Client, now: datetime | None = None) -> list[SourceLag]:
    """The sink's lag on each source stream (a stream or durable not there: no lag)."""
    jsm = nc.jsm()
    lags = []
    for row in rows_of("audit"):
        stream = row.stream
        try:
            info = await jsm.consumer_info(stream, row.durable)
            state = (await jsm.stream_info(stream)).state
        except NotFoundError:
            continue
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        unwritten = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        oldest = 0.0
        seq = max(int(floor or 0) + 1, int(state.first_seq or 0))
        while unwritten and seq <= int(state.last_seq or 0):
            try:
                first = await jsm.get_msg(stream, seq=seq)
            except NotFoundError:  # deleted: the next one is the oldest
                seq += 1
                continue
            stored = _stored_at(first.time)
            if stored is not None:
                oldest = lag_seconds(stored, now or datetime.now(UTC))
            break
        lags.append(SourceLag(stream, unwritten, oldest))
    return lags


def _stored_at(raw: object) -> datetime | None:
    """JetStream's storage time, RFC 3339 with nanoseconds ("...T08:00:00.123456789Z")."""
    if isinstance(raw, datetime):
        return raw if raw.tzinfo else raw.replace(tzinfo=UTC)
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?", str(raw or ""))
    if match is None:
        return None
    whole = datetime.fromisoformat(match[1]).replace(tzinfo=UTC)
    return whole.replace(microsecond=int((match[2] or "0")[:6].ljust(6, "0")))
