"""Policy bundles only move forward (DESIGN.md invariant 12), through the whole gateway.

The orders example (tests/system/test_orders_example.py): u-alice may not read
u-bob's order o-2002. A writer of the policies bucket who has no signing key
puts back an older signed bundle from the bucket's own history (one under
which she could), deletes the key, or rewrites the bucket while the policy
service is down: she still cannot. An operator's `toolgate policy rollback`
is the one way back, as a new version. `toolgate up --example refund` in a
folder where another bundle was pushed runs the example's rules (as a new
version) and says which version it replaced.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.errors import BadRequestError

from tests.harness import Gateway, events_of, make_test_registry
from tests.system.test_orders_example import OrdersGateway, ask
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts.calls import ToolCall
from toolgate.contracts.events import ApprovalRequested, CallAuthorized, CallDenied
from toolgate.infra.examples import orders
from toolgate.services.policy.bundle import read_bundle_dir
from toolgate.services.policy.bundle_store import ACTIVE_KEY, POLICIES_BUCKET

pytestmark = pytest.mark.system

OWNER_RULE = "unless { resource.owner == principal };"


def toolgate(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as an operator runs it beside `toolgate up` (what it recorded in data_dir)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli.main", *args],
        cwd=data_dir.parent,
        env={**env, "TOOLGATE_DATA_DIR": str(data_dir)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def bundle_dir(target: Path, owner_rule: bool) -> Path:
    """The orders example's bundle; without its owner rule, anyone's order is readable."""
    files = read_bundle_dir(orders.POLICY_DIR)
    if not owner_rule:
        assert files["orders.cedar"].count(OWNER_RULE) == 1
        files["orders.cedar"] = files["orders.cedar"].replace(OWNER_RULE, "when { false };")
    target.mkdir(parents=True)
    for name, text in files.items():
        (target / name).write_text(text)
    return target


@pytest.fixture
def example(tmp_path: Path) -> Iterator[OrdersGateway]:
    gateway = OrdersGateway(  # (/healthz too: `toolgate status` asks each service's)
        data_dir=tmp_path / "data",
        registry_dir=make_test_registry(tmp_path / "registry"),
        with_http=True,
    )
    gateway.start()
    yield gateway
    gateway.stop()


async def bobs_order_for_alice(gateway: Gateway) -> str:
    return (await ask(gateway, "query_order", {"order_id": "o-2002"})).status


async def until_alice_gets(gateway: Gateway, status: str) -> None:
    for _ in range(200):  # a push lands within a moment
        if await bobs_order_for_alice(gateway) == status:
            return
    raise AssertionError(f"o-2002 never became {status} for u-alice")


def policy_errors(gateway: Gateway, offset: int) -> list[str]:
    text = gateway.service("policy").log_path.read_bytes()[offset:].decode()
    return [line for line in text.splitlines() if " ERROR " in line]


async def until_policy_errors(gateway: Gateway, offset: int, count: int) -> list[str]:
    for _ in range(600):
        found = policy_errors(gateway, offset)
        if len(found) >= count:
            return found
        await bobs_order_for_alice(gateway)  # a round trip, instead of a sleep
    raise AssertionError(f"fewer than {count} ERROR lines: {policy_errors(gateway, offset)}")


async def test_an_older_bundle_never_comes_back_unless_an_operator_rolls_back(
    example: OrdersGateway, tmp_path: Path
) -> None:
    data = example.data_dir
    assert await bobs_order_for_alice(example) == "denied"  # the example's own bundle
    open_ = toolgate(data, "policy", "push", str(bundle_dir(tmp_path / "open", False)))
    assert open_.returncode == 0 and "as version 1 " in open_.stdout, open_.stderr
    await until_alice_gets(example, "ok")
    strict = toolgate(data, "policy", "push", str(bundle_dir(tmp_path / "strict", True)))
    assert strict.returncode == 0 and "as version 2 " in strict.stdout, strict.stderr
    await until_alice_gets(example, "denied")

    # Someone with write access to the bucket and no signing key: version 1 put back
    # from the bucket's own history, then the key deleted.
    log = example.service("policy").log_path
    offset = log.stat().st_size
    nc = await example.connect()
    kv = await nc.jetstream().key_value(POLICIES_BUCKET)
    [version_1, *_] = await kv.history(ACTIVE_KEY)
    await kv.put(ACTIVE_KEY, version_1.value)
    put_back, *_ = await until_policy_errors(example, offset, 1)
    await kv.delete(ACTIVE_KEY)
    _, deleted = await until_policy_errors(example, offset, 2)
    assert await bobs_order_for_alice(example) == "denied"
    assert "its version 1 is not higher than the active version 2" in put_back
    assert "keeping version 2" in put_back and "keeping version 2" in deleted

    # The same while the policy service is down: its record of version 2 stands.
    policy = example.service("policy")
    policy.stop()
    await kv.purge(ACTIVE_KEY)
    await kv.put(ACTIVE_KEY, version_1.value)
    await nc.close()
    offset = log.stat().st_size
    policy.start()
    [restarted] = await until_policy_errors(example, offset, 1)
    assert "keeping version 2" in restarted and "not higher than the active version 2" in restarted
    assert await bobs_order_for_alice(example) == "denied"

    status = toolgate(data, "status")
    assert status.returncode == 0, status.stderr
    assert "policy bundle: version 2 (pushed from " in status.stdout
    assert "the bucket's newest write is refused: its version 1 is not higher" in status.stdout

    # The operator's way back: version 1's content, signed again as version 3.
    back = toolgate(data, "policy", "rollback", "1")
    assert back.returncode == 0, back.stderr
    assert back.stdout.startswith("version 3 (content of 1) active")
    await until_alice_gets(example, "ok")
    status = toolgate(data, "status")
    assert "policy bundle: version 3 (rollback: content of version 1, bundle " in status.stdout
    missing = toolgate(data, "policy", "rollback", "9")
    assert missing.returncode == 1 and "no version 9" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def refund_call(client_principal: object, call_id: str) -> ToolCall:
    return ToolCall(
        call_id=call_id,
        tool="refund_payment",
        arguments={"payment_id": "pay_1001", "amount": 900, "reason": "damaged"},
        principal=client_principal,  # type: ignore[arg-type]
    )


async def first_decision(gateway: Gateway, call_id: str) -> object:
    for _ in range(300):
        try:
            events = await gateway.events()
        except BadRequestError:  # an empty stream (first_seq 0) until the first event
            events = []
        found = [
            e
            for e in events_of(events, call_id)
            if isinstance(e, CallAuthorized | CallDenied | ApprovalRequested)
        ]
        if found:
            return found[0]
        await asyncio.sleep(0.1)
    raise TimeoutError(call_id)


async def refund_of_900(gateway: Gateway) -> object:
    call_id = new_call_id()
    async with await gateway.client("acme", "support") as client:
        await client.publish(refund_call(client.principal("u-carol", "s-1"), call_id))
        return await first_decision(gateway, call_id)


def test_up_example_refund_after_a_push_runs_the_examples_rules_and_says_so(
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    registry = make_test_registry(tmp_path / "registry")
    plain = Gateway(data_dir=data, registry_dir=registry).start()
    try:
        assert getattr(plain.stack, "policy_line", "").startswith("version 0 (built-in default")
        pushed = toolgate(data, "policy", "push", str(bundle_dir(tmp_path / "mine", True)))
        assert pushed.returncode == 0, pushed.stderr
    finally:
        plain.stop()

    refund = Gateway(data_dir=data, registry_dir=registry)
    refund.stack.example = "refund"
    refund.start()
    try:
        decided = asyncio.run(refund_of_900(refund))
        assert isinstance(decided, ApprovalRequested), decided  # the finding: authorized
        assert decided.required_approvals == 2
        assert refund.stack.policy_line.startswith("version 2 (example refund, bundle ")
        assert refund.stack.policy_replaced.startswith("replaces version 1 (pushed from ")
        assert "`toolgate policy rollback 1` brings it back" in refund.stack.policy_replaced
    finally:
        refund.stop()

    # Started again the same way: the example's bundle is active already; no new version.
    again = Gateway(data_dir=data, registry_dir=registry)
    again.stack.example = "refund"
    again.start()
    try:
        assert again.stack.policy_line.startswith("version 2 (example refund, bundle ")
        assert again.stack.policy_replaced == ""
    finally:
        again.stop()
