"""Fairness between agents: one agent's burst does not starve another's call.

A's burst and then B's one call are stored while the validator is down, so both
wait in the calls stream in that order; then the validator starts. The results
stream stores each call's result once, in the order the calls ended: its
sequence numbers say how many of A's calls ended before B's. With
first-in-first-out stages, B's call ended behind nearly all of A's; with fair
admission, behind at most a few of A's per-agent shares (no clock involved).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.errors import NotFoundError

from tests.harness import Gateway, make_test_registry
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.runtime.creds import connect_options
from toolgate.services.validator.admission import DEFAULT_IN_FLIGHT, DEFAULT_WAITING

pytestmark = pytest.mark.system

A = Principal(tenant="acme", user="u-a", agent="burster", session="s")
B = Principal(tenant="globex", user="u-b", agent="steady", session="s")
# More than A's share plus its waiting room: some of A's calls are turned away for later.
BURST = DEFAULT_IN_FLIGHT + DEFAULT_WAITING + 80
WAIT_FOR_RESULTS_S = 240.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base: Path = tmp_path_factory.mktemp("fair")
    gateway = Gateway(data_dir=base / "data", registry_dir=make_test_registry(base / "registry"))
    gateway.start()
    yield gateway
    gateway.stop()


async def publish(gateway: Gateway, who: Principal, call_ids: list[str]) -> None:
    creds = await gateway.agent_creds(who.tenant, who.agent)
    nc = await nats.connect(gateway.url, **connect_options(creds))
    try:
        js = nc.jetstream()
        subject = subjects.calls_subject(who.tenant, who.agent)
        for call_id in call_ids:
            call = ToolCall(call_id=call_id, tool="echo", arguments={}, principal=who)
            await js.publish(subject, msgspec.json.encode(call), stream=subjects.CALLS_STREAM)
    finally:
        await nc.close()


async def result_sequences(gateway: Gateway, calls: dict[str, Principal]) -> dict[str, int]:
    """The results stream's sequence of each call's result, once every one is stored."""
    nc = await gateway.connect("admin")
    found: dict[str, int] = {}
    deadline = time.monotonic() + WAIT_FOR_RESULTS_S
    try:
        js = nc.jetstream()
        while len(found) < len(calls):
            for call_id, who in calls.items():
                if call_id in found:
                    continue
                subject = subjects.results_subject(who.tenant, who.agent, call_id)
                try:
                    msg = await js.get_last_msg(subjects.RESULTS_STREAM, subject)
                except NotFoundError:
                    continue
                assert msg.data is not None and b'"ok":true' in msg.data, msg.data
                found[call_id] = msg.seq
            if len(found) < len(calls):
                assert time.monotonic() < deadline, f"{len(calls) - len(found)} results missing"
                await asyncio.sleep(0.5)
    finally:
        await nc.close()
    return found


async def test_a_call_is_not_queued_behind_another_agents_burst(gateway: Gateway) -> None:
    validator = gateway.service("validator")
    validator.stop()
    a_calls = [f"a-{i}" for i in range(BURST)]
    await publish(gateway, A, a_calls)
    await publish(gateway, B, ["b-0"])  # stored after every one of A's
    validator.start()

    seqs = await result_sequences(gateway, {**dict.fromkeys(a_calls, A), "b-0": B})
    before_b = sum(1 for call_id in a_calls if seqs[call_id] < seqs["b-0"])
    # First in, first out, B's call ended behind all but the last few dozen of A's.
    # Fairly admitted, it waits behind at most A's share in the pipeline and what is
    # already on its way through the stages; most of A's burst ends after it.
    assert before_b <= 2 * DEFAULT_IN_FLIGHT, (before_b, BURST)
    assert BURST - before_b >= BURST // 2
