"""What a stage may publish: its row of the handler table, checked as it publishes.

The stage runner (runtime/stage.py) names, in the task that handles a message, the
row of the handler table (runtime/topology.py) the message came in on; the
Publisher calls `check` with the name of everything it publishes. A name the row
does not list is a mistake in the code or in the table: with TOOLGATE_STRICT_EMITS=1
(the tests) it fails the message's work, so a test that goes through that path
fails; otherwise it is logged, once per durable and name, and published anyway:
a table that lags the code must not end calls. Outside a durable's handler (a
request/reply handler, a sweeper) nothing is checked.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar

from toolgate.runtime.topology import GIVE_UP_EMITS, Handler

log = logging.getLogger("toolgate")
STRICT_ENV = "TOOLGATE_STRICT_EMITS"

_row: ContextVar[Handler | None] = ContextVar("toolgate_stage_row", default=None)
_logged: set[tuple[str, str]] = set()


class UndeclaredEmit(RuntimeError):
    """A handler published a message its row of the handler table does not list."""


def handling(row: Handler | None) -> None:
    """This task handles a message of `row`'s durable (its own task: nothing to undo)."""
    _row.set(row)


def current() -> Handler | None:
    return _row.get()


def check(kind: str) -> None:
    """`kind` (an event type's name, `ToolResult`, ...) is about to be published."""
    row = _row.get()
    if row is None or kind in row.emits or kind in GIVE_UP_EMITS:
        return
    reason = (
        f"{row.service}'s durable {row.durable} published {kind}, which its row of the "
        "handler table (runtime/topology.py) does not list"
    )
    if os.environ.get(STRICT_ENV) == "1":
        raise UndeclaredEmit(reason)
    if (row.durable, kind) not in _logged:
        _logged.add((row.durable, kind))
        log.error("%s", reason)
