"""The seed's order example through the whole gateway: `toolgate up --example orders`.

A support agent of tenant acme, acting for u-alice, reads her order o-1001
(ok) and not u-bob's o-2002 (denied, naming ownership); with the orders
database gone the lookup fails and the call is denied (fail closed); a refund
of 900 from an automated session at night waits for two approvers. "Night"
is configuration, not waiting: the test's copy of the example bundle puts
acme in a time zone where it is now about 03:00.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from tests.harness import Gateway, events_of, make_test_registry
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ToolCall, ToolResult
from toolgate.contracts.events import (
    ApprovalRequested,
    CallAuthorized,
    CallDenied,
    Event,
)
from toolgate.infra.examples import orders
from toolgate.runtime.creds import connect_options
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.services.approvals.protocol import ApprovalView
from toolgate.services.policy.bundle import SETTINGS_FILE, read_bundle_dir

pytestmark = pytest.mark.system

EXAMPLE_TOOLS = ["query_order", "refund_order"]
# The example's cache holds an order 5 s; the test's bundle 0.5 s, so the
# provider-down case needs no long wait.
TEST_CACHE_TTL_S = 0.5


def zone_where_it_is(hour: int, now: datetime | None = None) -> str:
    """An IANA zone (Etc/GMT±N) whose clock shows `hour` (or the next) right now."""
    offset = (hour - (now or datetime.now(UTC)).hour) % 24
    if offset > 14:
        offset -= 24
    # POSIX sign: Etc/GMT-3 is three hours ahead of UTC.
    return "Etc/GMT" if offset == 0 else f"Etc/GMT{'-' if offset > 0 else '+'}{abs(offset)}"


def night_bundle(target: Path) -> Path:
    """The example's bundle, with acme's clock at about 03:00 and a short cache."""
    files = read_bundle_dir(orders.POLICY_DIR)
    settings = yaml.safe_load(files[SETTINGS_FILE])
    settings["tenant_time_zones"]["acme"] = zone_where_it_is(3)
    settings["entities"]["Order"]["cache_ttl_s"] = TEST_CACHE_TTL_S
    files[SETTINGS_FILE] = yaml.safe_dump(settings)
    target.mkdir(parents=True)
    for name, text in files.items():
        (target / name).write_text(text)
    return target


@dataclass
class OrdersGateway(Gateway):
    """The test gateway with `--example orders` (its tools, data, bundle) beside it."""

    policy_dir: Path | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.stack.example = "orders"
        self.stack.policy_dir = self.policy_dir

    def tool_names(self) -> list[str]:
        return sorted(super().tool_names() + EXAMPLE_TOOLS)


@pytest.fixture(scope="module")
def example(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OrdersGateway]:
    base = tmp_path_factory.mktemp("orders")
    gateway = OrdersGateway(
        data_dir=base / "data",
        registry_dir=make_test_registry(base / "registry"),
        policy_dir=night_bundle(base / "bundle"),
    )
    gateway.start()
    yield gateway
    gateway.stop()


async def ask(
    gateway: Gateway,
    tool: str,
    arguments: dict[str, object],
    user: str = "u-alice",
    session_kind: str | None = None,
    timeout: float = 30,
) -> ToolResult:
    async with await gateway.client("acme", "support") as client:
        context = {} if session_kind is None else {"session_kind": session_kind}
        return await client.call(
            tool, arguments, user=user, session="s-1", context=context, timeout=timeout
        )


def decision_of(events: list[Event], call_id: str) -> Event:
    return next(
        e
        for e in events_of(events, call_id)
        if isinstance(e, CallAuthorized | CallDenied | ApprovalRequested)
    )


async def test_alice_reads_her_own_order(example: OrdersGateway) -> None:
    result = await ask(example, "query_order", {"order_id": "o-1001"})
    assert result.ok, result
    assert result.data["owner"] == "u-alice" and result.data["amount"] == 1200
    authorized = decision_of(await example.events(), result.call_id)
    assert isinstance(authorized, CallAuthorized)
    [seen] = authorized.resources  # what the policy knew, recorded for the auditor
    assert (seen.type, seen.id, seen.found, seen.provider) == ("Order", "o-1001", True, "sql")
    assert seen.attributes["owner"] == "u-alice" and seen.attributes["tenant"] == "acme"


async def test_alice_cannot_read_bobs_order(example: OrdersGateway) -> None:
    result = await ask(example, "query_order", {"order_id": "o-2002"})
    assert result.status == "denied" and result.error is not None, result
    assert result.error.code == "NOT_RESOURCE_OWNER"
    assert "only that user's own orders" in result.error.message
    assert "belongs to another user" in result.error.message
    denied = decision_of(await example.events(), result.call_id)
    assert isinstance(denied, CallDenied) and denied.policy_ids == ["orders-owner-only"]
    assert denied.resources[0].attributes["owner"] == "u-bob"
    # Bob's own agent session reads it.
    assert (await ask(example, "query_order", {"order_id": "o-2002"}, user="u-bob")).ok


async def test_an_unknown_order_is_denied(example: OrdersGateway) -> None:
    result = await ask(example, "query_order", {"order_id": "o-9999"})
    assert result.status == "denied" and result.error is not None
    assert result.error.code == "POLICY_DENIED"
    assert "Order 'o-9999' is not known" in result.error.message


async def test_with_the_provider_down_the_call_is_denied(example: OrdersGateway) -> None:
    database = orders.database_path(example.data_dir)
    assert (await ask(example, "query_order", {"order_id": "o-1001"})).ok
    away = database.with_name("orders.sqlite3.away")
    database.rename(away)
    try:
        await asyncio.sleep(TEST_CACHE_TTL_S + 0.2)  # what was cached has expired
        result = await ask(example, "query_order", {"order_id": "o-1001"})
    finally:
        away.rename(database)
    assert result.status == "denied" and result.error is not None, result
    assert result.error.code == "POLICY_ERROR" and result.error.retryable
    assert "Order 'o-1001' could not be looked up" in result.error.message
    assert "cannot open" in result.error.message
    denied = decision_of(await example.events(), result.call_id)
    assert isinstance(denied, CallDenied)
    assert not denied.resources[0].found and "cannot open" in denied.resources[0].error
    assert (await ask(example, "query_order", {"order_id": "o-1001"})).ok  # back


async def pending_approval(approvals: ApprovalsClient, key: str) -> ApprovalView:
    for _ in range(300):
        state = await approvals.get(key)
        if state is not None:
            return state
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no approval request for {key}")


async def test_a_900_refund_from_an_automated_session_at_night_waits_for_two_approvers(
    example: OrdersGateway,
) -> None:
    tokens = [
        add_approver(example.data_dir, f"{name}-{uuid.uuid4().hex[:6]}", ["acme"])
        for name in ("ann", "bea")
    ]
    arguments = {"order_id": "o-1001", "amount": 900, "reason": "damaged in transit"}
    call_id = new_call_id()
    options = connect_options(example.stack.creds_of("inbox"))
    async with (
        await example.client("acme", "support") as client,
        await ApprovalsClient.connect(example.url, token=tokens[0], **options) as approvals,
    ):
        call = ToolCall(
            call_id=call_id,
            tool="refund_order",
            arguments=arguments,
            principal=client.principal("u-alice", "s-night"),
            context={"session_kind": "automated"},
        )
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await pending_approval(approvals, f"acme.support.{call_id}")
        assert state.required_approvals == 2
        requested = decision_of(await example.events(), call_id)
        assert isinstance(requested, ApprovalRequested) and requested.required_approvals == 2
        assert {"refund-two-approvers-above-500", "refund-automated-off-hours"} <= set(
            requested.policy_ids
        )
        assert requested.resources[0].attributes["amount"] == 1200
        sha = arguments_sha256(arguments)
        first = await approvals.vote(state.key, "approve", arguments_sha256=sha, reason="ok")
        assert first.accepted and not first.quorum_reached
        assert not submitted.done()
        second = await approvals.vote(
            state.key, "approve", arguments_sha256=sha, reason="ok", token=tokens[1]
        )
        assert second.accepted and second.quorum_reached
        result = await submitted
    assert result.ok, result
    assert result.data["refunded_total"] >= 900 and not result.data["duplicate"]
    events = events_of(await example.events(), call_id)
    authorized = next(e for e in events if isinstance(e, CallAuthorized))
    assert len(authorized.authorization.approvals) == 2
    assert authorized.resources[0].id == "o-1001"  # looked up again before it ran


async def test_at_night_an_automated_small_refund_needs_two_an_interactive_one(
    example: OrdersGateway,
) -> None:
    async def required(session_kind: str) -> ApprovalRequested:
        call_id = new_call_id()
        async with await example.client("acme", "support") as client:
            call = ToolCall(
                call_id=call_id,
                tool="refund_order",
                arguments={"order_id": "o-2002", "amount": 10},
                principal=client.principal("u-bob", "s-2"),
                context={"session_kind": session_kind},
            )
            await client.publish(call)
        for _ in range(300):
            found = [
                e
                for e in events_of(await example.events(), call_id)
                if isinstance(e, ApprovalRequested | CallDenied)
            ]
            if found:
                assert isinstance(found[0], ApprovalRequested), found[0]
                return found[0]
            await asyncio.sleep(0.1)
        raise TimeoutError(call_id)

    automated = await required("automated")
    interactive = await required("interactive")
    assert automated.required_approvals == 2
    assert "refund-automated-off-hours" in automated.policy_ids
    assert interactive.required_approvals == 1
    assert "refund-automated-off-hours" not in interactive.policy_ids


def test_toolgate_up_example_orders_from_the_command_line(tmp_path: Path) -> None:
    """What docs/policy-examples.md tells an operator to run, and the call it suggests."""
    data = tmp_path / "data"
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolgate.cli.main",
            "up",
            "--example",
            "orders",
            "--nats-port",
            "0",
            "--no-audit",
            "--data-dir",
            str(data),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        printed = []
        for line in up.stdout:  # bounded by the test timeout
            printed.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        text = "".join(printed)
        assert "example orders: agent acme.support" in text, text
        # Nothing pushed in this folder: the example's bundle, as version 0.
        assert "  policy bundle: version 0 (example orders, bundle " in text, text
        creds = data / "creds" / "agents" / "acme.support.creds"
        assert creds.exists() and orders.database_path(data).exists()
        env = {**os.environ, "TOOLGATE_DATA_DIR": str(data)}

        def call(order_id: str) -> dict[str, object]:
            done = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "toolgate.cli.main",
                    "call",
                    "query_order",
                    json.dumps({"order_id": order_id}),
                    "--user",
                    "u-alice",
                    "--creds",
                    str(creds),
                    "--timeout",
                    "60",
                ],
                cwd=tmp_path,
                env=env,
                capture_output=True,
                text=True,
                timeout=90,
            )
            assert done.returncode in (0, 1), done.stderr
            return json.loads(done.stdout)  # type: ignore[no-any-return]

        assert call("o-1001")["status"] == "ok"
        assert call("o-2002")["status"] == "denied"
        search = subprocess.run(  # the built-in tools are still there
            [
                sys.executable,
                "-m",
                "toolgate.cli.main",
                "call",
                "echo",
                '{"payload": "hi"}',
                "--timeout",
                "60",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert search.returncode == 0, search.stdout + search.stderr
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
