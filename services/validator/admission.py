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
  validator, held (un-acked; the pull loop keeps them with `in_progress`), and
  enter in arrival order as that agent's earlier calls leave. The room keeps a
  busy agent's share of the pipeline full, so a lone agent loses no throughput.
- **Past the room, later**: a call for a full room is nak'ed with a delay and
  comes back (JetStream redelivers it); the pull loop moves on, so B's call,
  stored behind A's burst, is reached after the validator has only looked at
  A's backlog, not worked through it. The delay doubles with each delivery
  (RETRY_FIRST_S .. RETRY_MAX_S, jittered), so a long backlog costs a few
  redeliveries per call, not one per interval.

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
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_IN_FLIGHT = 64
DEFAULT_WAITING = 256
# All agents' waiting rooms together (each held message holds one pull slot).
DEFAULT_WAITING_TOTAL = 1024
# A slot whose call's end was never heard is taken back after this long.
DEFAULT_LEASE_S = 60.0
RETRY_FIRST_S = 0.25
RETRY_MAX_S = 8.0
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


def retry_later_s(deliveries: int, rand: Callable[[], float] = random.random) -> float:
    """How long a call turned away (its agent's room full) stays out: doubling per
    delivery, capped, with +-25 % jitter so a burst does not come back all at once."""
    base = min(RETRY_FIRST_S * 2 ** max(0, deliveries - 1), RETRY_MAX_S)
    return base * (0.75 + 0.5 * rand())


@dataclass(eq=False)  # each slot is itself (hashed by identity)
class Slot:
    """One admitted call's place in its agent's share of the pipeline."""

    agent: str
    admitted_at: float
    key: str = ""
    released: bool = False


@dataclass
class _Agent:
    in_flight: set[Slot] = field(default_factory=set)
    waiting: deque[asyncio.Future[Slot | None]] = field(default_factory=deque)


class FairAdmission:
    """Who may put a call into the pipeline now (see the module's docstring)."""

    def __init__(
        self,
        in_flight: int = DEFAULT_IN_FLIGHT,
        waiting: int = DEFAULT_WAITING,
        waiting_total: int = DEFAULT_WAITING_TOTAL,
        lease_s: float = DEFAULT_LEASE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.in_flight, self.waiting, self.waiting_total = in_flight, waiting, waiting_total
        self.lease_s, self.clock = lease_s, clock
        self._agents: dict[str, _Agent] = {}
        self._by_key: dict[str, Slot] = {}
        self._waiting_now = 0
        self._closed = False

    def _agent(self, agent: str) -> _Agent:
        found = self._agents.get(agent)
        if found is None:
            found = self._agents[agent] = _Agent()
        return found

    def _expire(self, state: _Agent) -> None:
        """Take back slots whose end was never heard."""
        oldest = self.clock() - self.lease_s
        for slot in [s for s in state.in_flight if s.admitted_at < oldest]:
            self.release(slot)

    def _admit(self, agent: str, state: _Agent) -> Slot:
        slot = Slot(agent, self.clock())
        state.in_flight.add(slot)
        return slot

    async def enter(self, agent: str) -> Slot | None:
        """A slot for one call of `agent`, once it has one free (waiting in its room
        meanwhile); None if the room is full: turn the call away for later."""
        if self._closed:
            return None
        state = self._agent(agent)
        if len(state.in_flight) >= self.in_flight:
            self._expire(state)
            state = self._agent(agent)  # (an agent left with nothing is forgotten)
        if len(state.in_flight) < self.in_flight and not state.waiting:
            return self._admit(agent, state)
        if len(state.waiting) >= self.waiting or self._waiting_now >= self.waiting_total:
            return None
        turn: asyncio.Future[Slot | None] = asyncio.get_running_loop().create_future()
        state.waiting.append(turn)
        self._waiting_now += 1
        try:
            return await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                admitted = turn.result()
                if admitted is not None:  # admitted as it was cancelled: give it back
                    self.release(admitted)
            elif turn in state.waiting:
                state.waiting.remove(turn)
                self._waiting_now -= 1
            raise

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
        state.in_flight.discard(slot)
        while state.waiting and len(state.in_flight) < self.in_flight:
            turn = state.waiting.popleft()
            self._waiting_now -= 1
            if not turn.done():
                turn.set_result(self._admit(slot.agent, state))
        if not state.in_flight and not state.waiting:
            del self._agents[slot.agent]

    def close(self) -> None:
        """Shutting down: every waiting call is turned away (redelivered, to another
        replica or after the restart), and none is let in any more."""
        self._closed = True
        for state in self._agents.values():
            while state.waiting:
                turn = state.waiting.popleft()
                self._waiting_now -= 1
                if not turn.done():
                    turn.set_result(None)

    def counts(self, agent: str) -> tuple[int, int]:
        """(in the pipeline, waiting) for `agent`."""
        state = self._agents.get(agent)
        return (len(state.in_flight), len(state.waiting)) if state else (0, 0)
