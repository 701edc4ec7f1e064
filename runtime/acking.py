"""Held acks: a stage's ack goes out with the connection's next write, not on its own.

A stage acks its input once the input's outputs are stored (invariant 1), so the ack
can never ride on those outputs' own write: it waited for their publish acks. Sent at
once, every ack was a socket write of its own (a send in the stage, a read and a
wake-up in nats-server), one per message per stage; profiled, the stages' socket
writes were 28-40 % of their CPU. Held here, an ack is sent just before whatever the
connection sends next (the next message's outputs, a KV write, a pull request: nats-py
puts them in one write), or after HOLD_S if nothing is sent by then.

What holding changes: the ack reaches the server up to HOLD_S later. Nothing waits for
it (the next stage has its input as soon as it is stored); the message stays counted
as pending on its durable meanwhile. If the process dies with acks held, those messages
are redelivered after their AckWait, as a message whose ack was lost is, and the stage
handles them again the way it handles any redelivery: the same output ids, dropped as
duplicates. A stopping consumer sends what it holds before the connection closes.

Only connections whose consumers asked for it hold acks (`hold_acks_on`); any other
message is acked at once.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

from nats.aio.client import Client
from nats.aio.msg import Msg

log = logging.getLogger("toolgate")

# The longest an ack waits for a write to ride on. Long enough to cover the gap between
# two calls of one agent calling one at a time (a few ms), short next to any AckWait.
HOLD_S = 0.02


class HeldAcks:
    """The acks one connection holds until its next write (or HOLD_S)."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._msgs: list[Msg] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._msgs)

    def hold(self, msg: Msg) -> None:
        """Ack `msg` with the connection's next write, or within `hold_s`."""
        self._msgs.append(msg)
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.hold_s, self._due)

    def _due(self) -> None:
        self._timer = None
        if self._msgs:
            task = asyncio.ensure_future(self.send())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def send(self) -> None:
        """Send every ack held now (they go out in the connection's next write)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        msgs, self._msgs = self._msgs, []
        for msg in msgs:
            try:
                await msg.ack()
            except Exception as exc:  # the bus went away: AckWait redelivers it
                log.debug("ack on %s failed: %r", msg.subject, exc)


_held: weakref.WeakKeyDictionary[Client, HeldAcks] = weakref.WeakKeyDictionary()


def hold_acks_on(nc: Client, hold_s: float = HOLD_S) -> HeldAcks:
    """From now on, acks of messages delivered on `nc` (through `ack`) are held."""
    held = _held.get(nc)
    if held is None:
        held = _held[nc] = HeldAcks(hold_s)
    return held


async def ack(msg: Msg) -> None:
    """Ack `msg`: held if its connection holds acks (`hold_acks_on`), else at once."""
    client = getattr(msg, "_client", None)
    held = _held.get(client) if client is not None else None
    if held is None:
        await msg.ack()
        return
    held.hold(msg)


async def send_held(nc: Client) -> None:
    """Before a write on `nc`: the acks it holds go out with it."""
    held = _held.get(nc)
    if held is not None and held._msgs:
        await held.send()
