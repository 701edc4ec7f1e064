"""Fast recovery from a dead worker, and no second run of a slow tool.

Two executors serve the same durables (scaled out as an SRE would). Each tool's
durable holds a delivery for the tool's timeout plus a margin, capped
(runtime/topology.py), and the executor says `in_progress` while a tool runs.
The waits below are test timeouts, set under JetStream's 30 s default AckWait:
with that default these tests could not pass.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.harness import Gateway, count_types, events_of, make_test_registry
from tests.tools.faulty import runs_of
from toolgate.client.gateway_client import GatewayClient, new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.runtime.topology import EXECUTOR_ACK_WAIT_CAP_S
from toolgate.stack.supervisor import ServiceProcess, serve_command

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
# count_runs, declared slower than the AckWait cap: only heartbeats keep it with one worker.
LONG_TIMEOUT_S = 60
# Under JetStream's default AckWait (30 s): a redelivery must come sooner than that.
UNDER_THE_DEFAULT_S = 25.0


@pytest.fixture
def scaled(tmp_path: Path) -> Iterator[Gateway]:
    registry = make_test_registry(tmp_path / "registry")
    spec_path = registry / "count_runs.yaml"
    spec = yaml.safe_load(spec_path.read_text())
    spec["timeout_s"] = LONG_TIMEOUT_S
    spec_path.write_text(yaml.safe_dump(spec))
    gateway = Gateway(data_dir=tmp_path / "data", registry_dir=registry).start()
    stack = gateway.stack
    second = ServiceProcess(
        "executor",
        serve_command(
            "executor",
            stack.url,
            stack.data_dir,
            stack.registry_dirs,
            ["--concurrency", "4"],
            creds=stack.creds_of("executor"),
            builtin_tools=stack.builtin_tools,
        ),
        stack.data_dir / "logs" / "executor-2.log",
    )
    second.start()
    stack.services.append(second)  # stopped with the rest
    yield gateway
    gateway.stop()


def executors(gateway: Gateway) -> list[ServiceProcess]:
    return [s for s in gateway.stack.services if s.name == "executor"]


async def _wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.2)


async def _both_consuming(gateway: Gateway) -> None:
    """Both executors have asked for work on count_runs' durable."""
    nc = await gateway.connect()
    try:

        async def two_waiting() -> bool:
            info = await nc.jsm().consumer_info(subjects.EVENTS_STREAM, "executor-count_runs")
            return (info.num_waiting or 0) >= 2

        await _wait_for(two_waiting)
    finally:
        await nc.close()


async def _result(client: GatewayClient, call_id: str, timeout: float) -> ToolResult:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        found = await client.result(call_id)
        if found is not None:
            return found
        await asyncio.sleep(0.2)
    raise TimeoutError(f"no result for {call_id} within {timeout} s")


def _runner_of(gateway: Gateway, call_id: str) -> ServiceProcess:
    """The executor process that ran `call_id` (count_runs logs its pid)."""
    path = gateway.data_dir / "tools" / "count_runs" / "runs.log"
    pid = next(int(line.split()[1]) for line in path.read_text().splitlines() if call_id in line)
    return next(s for s in executors(gateway) if s.process and s.process.pid == pid)


async def test_a_sigkilled_workers_message_goes_to_another_worker_in_seconds(
    scaled: Gateway,
) -> None:
    await _both_consuming(scaled)
    call = ToolCall(
        call_id=new_call_id(), tool="count_runs", arguments={"sleep_s": 20}, principal=BOB
    )
    async with await scaled.client() as client:
        await client.publish(call)

        async def started() -> bool:
            return call.call_id in runs_of(scaled.data_dir)

        await _wait_for(started)
        _runner_of(scaled, call.call_id).kill()
        # The survivor gets the message once the tool's AckWait runs out (not after 30 s),
        # finds the run started and never finished, and (count_runs is not idempotent)
        # answers OUTCOME_UNKNOWN instead of running it again.
        result = await _result(client, call.call_id, timeout=UNDER_THE_DEFAULT_S)
    assert result.status == "execution_error"
    assert result.error is not None and result.error.code == "OUTCOME_UNKNOWN"
    assert runs_of(scaled.data_dir).count(call.call_id) == 1


async def test_a_tool_slower_than_its_ack_wait_runs_once(scaled: Gateway) -> None:
    await _both_consuming(scaled)
    sleep_s = EXECUTOR_ACK_WAIT_CAP_S * 1.5  # redelivered at the cap, but for heartbeats
    call = ToolCall(
        call_id=new_call_id(), tool="count_runs", arguments={"sleep_s": sleep_s}, principal=BOB
    )
    async with await scaled.client() as client:
        result = await client.submit(call, timeout=LONG_TIMEOUT_S)
    assert result.ok, result
    assert runs_of(scaled.data_dir).count(call.call_id) == 1
    types = count_types(events_of(await scaled.events(), call.call_id))
    assert types["ExecutionStarted"] == 1 and types["ExecutionSucceeded"] == 1
    nc = await scaled.connect()
    info = await nc.jsm().consumer_info(subjects.EVENTS_STREAM, "executor-count_runs")
    await nc.close()
    assert info.config.ack_wait == EXECUTOR_ACK_WAIT_CAP_S
    assert info.num_redelivered == 0
