"""Per-agent storage quotas and the size cap: refused by the server before anything is stored.

The calls stream holds one subject per agent, capped at `max_calls_per_agent`
messages (discard new per subject), and refuses a message over the size cap.
Each call has at most one result and one outcome record, so capping calls
caps what a tenant's agents can make the gateway store.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, make_test_registry
from toolgate.contracts import subjects
from toolgate.contracts.calls import MAX_CALL_BYTES
from toolgate.runtime.topology import Topology

pytestmark = pytest.mark.system

QUOTA = 3


@pytest.fixture(scope="module")
def small_quota_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base: Path = tmp_path_factory.mktemp("quota")
    gateway = Gateway(data_dir=base / "data", registry_dir=make_test_registry(base / "registry"))
    gateway.stack.topology = Topology(max_calls_per_agent=QUOTA)
    gateway.start()
    yield gateway
    gateway.stop()


async def stored_calls(gateway: Gateway, tenant: str, agent: str) -> int:
    nc = await gateway.connect("admin")
    try:
        info = await nc.jsm().stream_info(subjects.CALLS_STREAM, subjects_filter=">")
        return (info.state.subjects or {}).get(subjects.calls_subject(tenant, agent), 0)
    finally:
        await nc.close()


async def test_an_agent_over_its_quota_is_refused_and_others_are_not(
    small_quota_gateway: Gateway,
) -> None:
    gateway = small_quota_gateway
    async with await gateway.client("globex", "flooder") as flooder:
        answers = [
            await flooder.call("echo", {"payload": f"n{i}"}, user="u-1", session="s")
            for i in range(QUOTA + 2)
        ]
    assert [a.status for a in answers[:QUOTA]] == ["ok"] * QUOTA
    for refused in answers[QUOTA:]:
        assert refused.status == "denied" and refused.error is not None
        assert refused.error.code == "QUOTA_EXCEEDED" and refused.error.retryable is True
    assert await stored_calls(gateway, "globex", "flooder") == QUOTA

    async with await gateway.client("acme", "researcher") as victim:
        mine = await victim.call("echo", {"payload": "still served"}, user="u-alice", session="s-1")
    assert mine.ok and mine.data == {"payload": "still served"}


async def test_a_call_over_the_size_cap_is_refused_before_it_is_stored(
    small_quota_gateway: Gateway,
) -> None:
    gateway = small_quota_gateway
    before = await stored_calls(gateway, "acme", "big")
    async with await gateway.client("acme", "big") as client:
        result = await client.call(
            "echo", {"payload": "x" * (MAX_CALL_BYTES + 10)}, user="u", session="s"
        )
    assert result.status == "invalid_arguments" and result.error is not None
    assert result.error.code == "PAYLOAD_TOO_LARGE"
    assert await stored_calls(gateway, "acme", "big") == before == 0
