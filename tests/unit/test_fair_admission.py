"""Fair admission's rules (services/validator/admission.py), on a fake clock."""

from __future__ import annotations

import asyncio

from toolgate.services.validator.admission import (
    RETRY_FIRST_S,
    RETRY_MAX_S,
    FairAdmission,
    in_flight_from_env,
    retry_later_s,
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


async def test_a_full_room_turns_calls_away_for_later() -> None:
    gate = FairAdmission(in_flight=1, waiting=2, waiting_total=100)
    assert await gate.enter("A") is not None
    held = [asyncio.ensure_future(gate.enter("A")) for _ in range(2)]
    await asyncio.sleep(0)
    assert await gate.enter("A") is None  # A's room is full
    assert await gate.enter("B") is not None  # B's is its own
    for h in held:
        h.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    assert gate.counts("A") == (1, 0)


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


def test_later_doubles_per_delivery_up_to_a_cap() -> None:
    middle = lambda: 0.5  # noqa: E731 (no jitter)
    assert retry_later_s(1, middle) == RETRY_FIRST_S
    assert retry_later_s(3, middle) == RETRY_FIRST_S * 4
    assert retry_later_s(50, middle) == RETRY_MAX_S
    assert RETRY_FIRST_S * 0.75 <= retry_later_s(1) <= RETRY_FIRST_S * 1.25


def test_the_cap_comes_from_the_environment() -> None:
    assert in_flight_from_env({"TOOLGATE_AGENT_IN_FLIGHT": "8"}) == 8
    assert in_flight_from_env({}) >= 1
