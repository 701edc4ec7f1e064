"""Fair admission's rules (services/validator/admission.py), on a fake clock."""

from __future__ import annotations

import asyncio

from toolgate.services.validator.admission import (
    LATER_MAX_S,
    FairAdmission,
    in_flight_from_env,
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_an_agent_at_its_cap_waits_and_another_agent_goes_first() -> None:
    gate = FairAdmission(in_flight=2, waiting=10)
    a1, a2 = await gate.enter("A"), await gate.enter("A")
    assert a1 is not None and a2 is not None
    a3 = asyncio.ensure_future(gate.enter("A"))
    await asyncio.sleep(0)
    assert not a3.done() and gate.counts("A") == (2, 1)
    b1 = await gate.enter("B")  # B is not held behind A's calls
    assert b1 is not None and gate.counts("B") == (1, 0)
    gate.bind(a1, "t.A.c1")
    gate.finished("t.A.c1")  # A's first call's result is attached: its next one enters
    assert (await a3) is not None and gate.counts("A") == (2, 0)


async def test_waiting_calls_enter_in_arrival_order() -> None:
    gate = FairAdmission(in_flight=1, waiting=10)
    first = await gate.enter("A")
    assert first is not None
    order: list[int] = []

    async def wait(i: int) -> None:
        slot = await gate.enter("A")
        assert slot is not None
        order.append(i)
        gate.release(slot)

    waiters = [asyncio.ensure_future(wait(i)) for i in range(5)]
    await asyncio.sleep(0)
    gate.release(first)
    await asyncio.gather(*waiters)
    assert order == [0, 1, 2, 3, 4]
    assert gate.counts("A") == (0, 0)


async def test_full_rooms_turn_calls_away_for_later() -> None:
    gate = FairAdmission(in_flight=1, waiting=2, waiting_total=2)
    assert await gate.enter("A") is not None
    held = [asyncio.ensure_future(gate.enter("A")) for _ in range(2)]
    await asyncio.sleep(0)
    assert await gate.enter("A") is None  # A's room is full, and no place is free
    assert await gate.enter("B") is not None  # B's is its own
    for h in held:
        h.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert gate.counts("A") == (1, 0)


async def test_an_agent_past_its_room_waits_in_places_no_one_else_uses() -> None:
    """A lone agent's burst waits for its releases instead of being turned away (and
    coming back to a full room, a nak each time)."""
    gate = FairAdmission(in_flight=1, waiting=2, waiting_total=6)
    first = await gate.enter("A")
    assert first is not None
    held = [asyncio.ensure_future(gate.enter("A")) for _ in range(6)]
    await asyncio.sleep(0)
    assert not any(h.done() for h in held) and gate.counts("A") == (1, 6)
    assert await gate.enter("A") is None  # every place is taken: later
    gate.release(first)
    assert (await held[0]) is not None and gate.counts("A") == (1, 5)
    for h in held[1:]:
        h.cancel()
    await asyncio.gather(*held[1:], return_exceptions=True)


async def test_a_borrowed_place_goes_back_to_an_agent_within_its_room() -> None:
    gate = FairAdmission(in_flight=1, waiting=2, waiting_total=4)
    assert await gate.enter("A") is not None
    a_held = [asyncio.ensure_future(gate.enter("A")) for _ in range(4)]  # 2 borrowed
    await asyncio.sleep(0)
    assert await gate.enter("B") is not None  # B's share of the pipeline: no room needed
    b_held = asyncio.ensure_future(gate.enter("B"))  # B's own room: A gives a place back
    await asyncio.sleep(0)
    assert (await a_held[-1]) is None  # A's latest arrival, turned away for later
    assert not b_held.done() and not any(h.done() for h in a_held[:-1])
    assert gate.counts("A") == (1, 3) and gate.counts("B") == (1, 1)
    c_first = await gate.enter("C")
    assert c_first is not None
    c_held = asyncio.ensure_future(gate.enter("C"))  # A's last borrowed place
    await asyncio.sleep(0)
    assert (await a_held[-2]) is None and not c_held.done()
    assert await gate.enter("A") is None  # A is at its own room's size, and all is taken
    for h in [*a_held[:-2], b_held, c_held]:
        h.cancel()
    await asyncio.gather(*a_held, b_held, c_held, return_exceptions=True)


async def test_all_rooms_together_are_bounded() -> None:
    gate = FairAdmission(in_flight=1, waiting=5, waiting_total=3)
    for agent in ("A", "B", "C"):
        assert await gate.enter(agent) is not None
    held = [asyncio.ensure_future(gate.enter(agent)) for agent in ("A", "B", "C")]
    await asyncio.sleep(0)
    assert await gate.enter("A") is None
    for h in held:
        h.cancel()
    await asyncio.gather(*held, return_exceptions=True)


async def test_the_rooms_hold_a_bounded_number_of_bytes() -> None:
    gate = FairAdmission(in_flight=1, waiting=10, waiting_total=10, waiting_bytes=100)
    assert await gate.enter("A", 60) is not None
    held = asyncio.ensure_future(gate.enter("A", 60))
    await asyncio.sleep(0)
    assert await gate.enter("B", 0) is not None
    assert await gate.enter("B", 60) is None  # 120 bytes would be held: later
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    late = asyncio.ensure_future(gate.enter("B", 60))  # room again
    await asyncio.sleep(0)
    assert not late.done()
    late.cancel()
    await asyncio.gather(late, return_exceptions=True)


async def test_a_slot_whose_end_is_never_heard_is_taken_back_after_its_lease() -> None:
    clock = Clock()
    gate = FairAdmission(in_flight=1, waiting=5, lease_s=60, clock=clock)
    slot = await gate.enter("A")
    assert slot is not None
    gate.bind(slot, "t.A.lost")
    clock.now = 61.0
    assert await gate.enter("A") is not None  # the lost one no longer counts
    gate.finished("t.A.lost")  # heard late: nothing to give back twice
    assert gate.counts("A") == (1, 0)


async def test_a_slot_is_given_back_once() -> None:
    gate = FairAdmission(in_flight=1, waiting=5)
    slot = await gate.enter("A")
    assert slot is not None
    gate.bind(slot, "t.A.c")
    gate.finished("t.A.c")
    gate.finished("t.A.c")
    gate.release(slot)
    assert gate.counts("A") == (0, 0)
    second = await gate.enter("A")
    assert second is not None and gate.counts("A") == (1, 0)


async def test_calls_turned_away_come_back_spaced_at_the_agents_rate() -> None:
    clock = Clock()
    gate = FairAdmission(in_flight=1, waiting=2, waiting_total=2, clock=clock)
    slot = await gate.enter("A")
    assert slot is not None
    room = [asyncio.ensure_future(gate.enter("A")) for _ in range(2)]
    await asyncio.sleep(0)
    for _ in range(40):  # A is backlogged; its calls leave one every 0.1 s
        clock.now += 0.1
        gate.release(slot)
        slot = await room.pop(0)
        assert slot is not None
        room.append(asyncio.ensure_future(gate.enter("A")))
        await asyncio.sleep(0)
    assert await gate.enter("A") is None
    returns = [gate.later("A") for _ in range(4)]
    # After the room (2 calls) has drained, a little under one interval apart, in order.
    assert returns == sorted(returns) and returns[0] > 0.2
    gaps = [b - a for a, b in zip(returns, returns[1:], strict=False)]
    assert all(abs(g - gaps[0]) < 1e-9 for g in gaps) and 0.07 < gaps[0] <= 0.08
    assert max(returns) <= LATER_MAX_S
    gate.close()
    assert [await r for r in room] == [None, None]


async def test_a_call_held_too_long_is_turned_away_and_lost_releases_are_found() -> None:
    clock = Clock()
    gate = FairAdmission(in_flight=1, waiting=5, hold_s=0.01, lease_s=60, clock=clock)
    slot = await gate.enter("A")
    assert slot is not None
    gate.bind(slot, "t.A.lost")  # its ResultAttached never comes
    assert await gate.enter("A") is None  # held 10 ms, then turned away
    assert gate.counts("A") == (1, 0)
    clock.now = 61.0
    waiting = asyncio.ensure_future(gate.enter("A"))  # the lost slot is taken back
    assert (await waiting) is not None and gate.counts("A") == (1, 0)


def test_the_cap_comes_from_the_environment() -> None:
    assert in_flight_from_env({"TOOLGATE_AGENT_IN_FLIGHT": "8"}) == 8
    assert in_flight_from_env({}) >= 1
