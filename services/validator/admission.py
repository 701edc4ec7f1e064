"""Fair admission: one agent's burst does not starve another agent's calls.

Every stage consumes its JetStream input first in, first out. Without a gate, a
burst of 1,500 calls from agent A sits ahead of agent B's one call at every
stage: B waited 0.4-3 s (p50) and up to 12 s while A's burst drained. The
validator, the first stage, is where a call enters the pipeline, so it decides
who enters:

- **A cap per agent on calls in the pipeline** (`in_flight`, default
  DEFAULT_IN_FLIGHT): a call is in the pipeline from its admission until its
  result is attached (`ResultAttached`) or it waits for a human
  (`ApprovalRequested`: parked, out of every queue). Whatever one agent
  publishes, at most `in_flight` of its calls are queued ahead of another's at
  any later stage, so B's call waits behind at most (active agents x in_flight)
  calls, not behind A's whole burst.
- **A waiting room per agent** (`waiting`): calls over the cap wait in the
  validator, held (un-acked), and enter in arrival order as that agent's
  earlier calls leave, for at most `hold_s` (then they are turned away as
  below). The room keeps a busy agent's share of the pipeline full, so a lone
  agent keeps its rate. The rooms together hold a bounded number of calls and
  bytes. An agent past its own room borrows the places no one else uses, and
  gives one back (its latest arrival, turned away as below) when an agent still
  within its own room needs it: a lone agent's burst waits for its releases
  rather than being turned away and coming back to a full room (1.5-1.7 naks
  per call in a 1,000-call burst, counted by `toolgate bench trips`).
- **Past the room, later**: a call for a full room is nak'ed with a delay and
  comes back (JetStream redelivers it); the pull loop moves on, so B's call,
  stored behind A's burst, is reached after the validator has only looked at
  A's backlog, not worked through it. Each call turned away gets a return time
  of its own in a virtual queue behind the agent's room, spaced at the rate
  the agent's calls have been leaving the pipeline while it was backlogged
  (`later`, at most LATER_MAX_S): the calls come back about when there is room
  for them, a few deliveries each. (Backing off per message instead, 0.25 s
  doubling to 8 s, left the room empty for seconds while the calls slept: a
  lone agent's burst ran at half its rate.)

Why this and not the alternatives: per-agent consumers (a durable per
`toolgate.calls.<tenant>.<agent>`) would leave the queueing to the server, but
need a consumer per agent, discovered and created at run time (thousands of
agents: thousands of pull requests outstanding); deficit round robin over one
pulled batch alone cannot see past a backlog longer than the batch, and does
nothing for the FIFO stages after it. A cap on what each agent has inside is
what bounds every later stage at once; it is the per-key concurrency limit API
gateways ship. Per-agent token buckets (calls per second) would throttle a lone
agent for no one's sake; the cap only holds an agent back while its own calls
are still inside.

Soft state, by design: each validator replica counts the calls it admitted (N
replicas admit up to N x in_flight per agent), and forgets a slot whose end it
never heard (a release lost in a reconnect) after `lease_s`. Losing the counts
(a restart) loses fairness for a moment, never a call: admission happens before
any output, so a held or nak'ed message simply runs later, and every invariant
of the stage (ack after the outputs are stored, one claim per call_id) holds.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_IN_FLIGHT = 32
DEFAULT_WAITING = 256
# All agents' waiting rooms together (each held message holds one pull slot), in
# calls and in bytes (a call may be up to 8 MiB: 1,024 of those would not fit).
DEFAULT_WAITING_TOTAL = 1024
DEFAULT_WAITING_BYTES = 64 * 1024 * 1024
# A call waits in its agent's room at most this long (then: turned away, for later);
# well inside the validator's AckWait, so a held call needs one `in_progress` at most.
DEFAULT_HOLD_S = 5.0
# A slot whose call's end was never heard is taken back after this long.
DEFAULT_LEASE_S = 60.0
# A call turned away comes back after at least LATER_MIN_S, at most LATER_MAX_S.
LATER_MIN_S = 0.05
LATER_MAX_S = 10.0
LATER_EARLY = 0.8
# How often an agent's calls leave the pipeline, until measured (then: a moving
# average of the time between releases, each gap counted up to RELEASE_GAP_MAX_S).
DEFAULT_RELEASE_INTERVAL_S = 0.005
RELEASE_GAP_MAX_S = 1.0
RELEASE_AVERAGING = 0.1
# Agents whose rate is remembered while idle (then the idle ones are forgotten).
MAX_AGENTS_KEPT = 10_000
IN_FLIGHT_ENV = "TOOLGATE_AGENT_IN_FLIGHT"


def in_flight_from_env(environ: dict[str, str] | None = None) -> int:
    """$TOOLGATE_AGENT_IN_FLIGHT (a positive integer), else DEFAULT_IN_FLIGHT."""
    raw = (os.environ if environ is None else environ).get(IN_FLIGHT_ENV, "").strip()
    if not raw:
        return DEFAULT_IN_FLIGHT
    value = int(raw)
    if value < 1:
        raise ValueError(f"${IN_FLIGHT_ENV}={raw!r}: give a positive integer")
    return value


@dataclass(eq=False)  # each slot is itself (hashed by identity)
class Slot:
    """One admitted call's place in its agent's share of the pipeline."""

    agent: str
    admitted_at: float
    key: str = ""
    released: bool = False


@dataclass
class _Agent:
    # Its calls in the pipeline, oldest first (a dict keeps the order they were admitted in).
    in_flight: dict[Slot, None] = field(default_factory=dict)
    # Seconds between two of its calls leaving (a moving average), the last time one
    # left, and the return time the next call turned away gets.
    interval: float = DEFAULT_RELEASE_INTERVAL_S
    last_release: float | None = None
    next_return: float = 0.0
    waiting: deque[asyncio.Future[Slot | None]] = field(default_factory=deque)


class FairAdmission:
    """Who may put a call into the pipeline now (see the module's docstring)."""

    def __init__(
        self,
        in_flight: int = DEFAULT_IN_FLIGHT,
        waiting: int = DEFAULT_WAITING,
        waiting_total: int = DEFAULT_WAITING_TOTAL,
        waiting_bytes: int = DEFAULT_WAITING_BYTES,
        hold_s: float = DEFAULT_HOLD_S,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.in_flight, self.waiting, self.waiting_total = in_flight, waiting, waiting_total
        self.waiting_bytes, self.hold_s = waiting_bytes, hold_s
        self.lease_s, self.clock = lease_s, clock
        self._agents: dict[str, _Agent] = {}
        self._by_key: dict[str, Slot] = {}
        self._waiting_now = 0
        self._sizes: dict[asyncio.Future[Slot | None], int] = {}
        self._bytes_now = 0
        self._closed = False

    def _agent(self, agent: str) -> _Agent:
        found = self._agents.get(agent)
        if found is None:
            if len(self._agents) >= MAX_AGENTS_KEPT:  # forget the idle ones
                for name in [
                    n for n, a in self._agents.items() if not a.in_flight and not a.waiting
                ]:
                    del self._agents[name]
            found = self._agents[agent] = _Agent()
        return found

    def _expire(self, state: _Agent) -> None:
        """Take back slots whose end was never heard."""
        oldest = self.clock() - self.lease_s
        # The oldest first, and only those: this runs for every call of an agent at its
        # cap (scanning every slot each time was 3-4% of the validator's CPU in a burst).
        while state.in_flight:
            slot = next(iter(state.in_flight))
            if slot.admitted_at >= oldest:
                return
            self.release(slot)
            state.in_flight.pop(slot, None)  # (released already: gone all the same)

    def _admit(self, agent: str, state: _Agent) -> Slot:
        slot = Slot(agent, self.clock())
        state.in_flight[slot] = None
        return slot

    def _left_room(self, turn: asyncio.Future[Slot | None]) -> None:
        self._waiting_now -= 1
        self._bytes_now -= self._sizes.pop(turn, 0)

    async def enter(self, agent: str, size: int = 0) -> Slot | None:
        """A slot for one call of `agent`, once it has one free (waiting in its room
        meanwhile); None if the room is full: turn the call away for later."""
        if self._closed:
            return None
        state = self._agent(agent)
        if len(state.in_flight) >= self.in_flight:
            self._expire(state)
        if len(state.in_flight) < self.in_flight and not state.waiting:
            return self._admit(agent, state)
        if not self._room_for(state, size):
            return None
        turn: asyncio.Future[Slot | None] = asyncio.get_running_loop().create_future()
        state.waiting.append(turn)
        self._waiting_now += 1
        self._sizes[turn] = size
        self._bytes_now += size
        timer = asyncio.get_running_loop().call_later(
            self.hold_s, self._held_too_long, agent, state, turn
        )
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                admitted = turn.result()
                if admitted is not None:  # admitted as it was cancelled: give it back
                    self.release(admitted)
            elif turn in state.waiting:
                state.waiting.remove(turn)
                self._left_room(turn)
            raise
        finally:
            timer.cancel()

    def _room_for(self, state: _Agent, size: int) -> bool:
        """Is there a place in the rooms for one more call of this agent (`size` bytes)?

        Each agent's own share of the rooms is `waiting` calls; past it, an agent borrows
        places nobody else is using (a lone agent's burst waits for its releases instead
        of being turned away and coming back to a full room, again and again). A borrowed
        place is given back when an agent within its share needs it: the borrower's
        latest arrival is turned away for later, as a call for a full room always was."""

        def fits() -> bool:
            return (
                self._waiting_now < self.waiting_total
                and self._bytes_now + size <= self.waiting_bytes
            )

        if len(state.waiting) >= self.waiting:
            return fits()  # borrowing: only what is free
        while not fits():
            if not self._give_back_a_borrowed_place(state):
                return False
        return True

    def _give_back_a_borrowed_place(self, asking: _Agent) -> bool:
        """Turn away the latest waiting call of the agent furthest past its share (not
        `asking`); False if no agent is past its share."""
        borrowers = [
            a for a in self._agents.values() if a is not asking and len(a.waiting) > self.waiting
        ]
        if not borrowers:
            return False
        borrower = max(borrowers, key=lambda a: len(a.waiting))
        turn = borrower.waiting.pop()
        self._left_room(turn)
        if not turn.done():
            turn.set_result(None)
        return True

    def _held_too_long(self, agent: str, state: _Agent, turn: asyncio.Future[Slot | None]) -> None:
        """A call waited `hold_s` in the room: out it goes, for later (and slots whose
        end was never heard are looked for: nothing waits for ever on a lost release)."""
        if turn.done() or turn not in state.waiting:
            return
        state.waiting.remove(turn)
        self._left_room(turn)
        turn.set_result(None)
        self._expire(state)

    def bind(self, slot: Slot, key: str) -> None:
        """The admitted call is `key` (tenant.agent.call_id): its end releases the slot."""
        if slot.released:
            return
        older = self._by_key.get(key)
        if older is not None and older is not slot:
            self.release(older)  # the same call admitted again (a redelivery): one slot
        slot.key = key
        self._by_key[key] = slot

    def finished(self, key: str) -> None:
        """The call `key` left the pipeline (its result attached, or it waits for a human)."""
        slot = self._by_key.get(key)
        if slot is not None:
            self.release(slot)

    def release(self, slot: Slot) -> None:
        """Give the slot back and let the agent's next waiting call in."""
        if slot.released:
            return
        slot.released = True
        if slot.key and self._by_key.get(slot.key) is slot:
            del self._by_key[slot.key]
        state = self._agents.get(slot.agent)
        if state is None:
            return
        state.in_flight.pop(slot, None)
        now = self.clock()
        # Measured only while calls wait: the rate the pipeline takes this agent's
        # calls at, not how often a quiet agent sends one.
        if state.waiting and state.last_release is not None:
            gap = min(now - state.last_release, RELEASE_GAP_MAX_S)
            state.interval += RELEASE_AVERAGING * (gap - state.interval)
        state.last_release = now if state.waiting else None
        while state.waiting and len(state.in_flight) < self.in_flight:
            turn = state.waiting.popleft()
            self._left_room(turn)
            if not turn.done():
                turn.set_result(self._admit(slot.agent, state))

    def later(self, agent: str) -> float:
        """How long a call of `agent` turned away stays out: until its own place in a
        queue behind the agent's room, spaced at the rate the agent's calls leave."""
        state = self._agents.get(agent)
        if state is None or self._closed:
            return LATER_MIN_S
        now = self.clock()
        # A little early rather than late: one too early is turned away again, one
        # too late leaves the room empty.
        spacing = state.interval * LATER_EARLY
        drained = now + (len(state.waiting) + 1) * spacing
        ticket = max(drained, state.next_return)
        state.next_return = ticket + spacing
        return min(max(ticket - now, LATER_MIN_S), LATER_MAX_S)

    def close(self) -> None:
        """Shutting down: every waiting call is turned away (redelivered, to another
        replica or after the restart), and none is let in any more."""
        self._closed = True
        for state in self._agents.values():
            while state.waiting:
                turn = state.waiting.popleft()
                self._left_room(turn)
                if not turn.done():
                    turn.set_result(None)

    def counts(self, agent: str) -> tuple[int, int]:
        """(in the pipeline, waiting) for `agent`."""
        state = self._agents.get(agent)
        return (len(state.in_flight), len(state.waiting)) if state else (0, 0)
