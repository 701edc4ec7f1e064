"""A three-node NATS cluster that loses a node: every call one result, every event audited once.

`toolgate up --nats-cluster 3` as the harness runs it: three real nats-servers routed on
loopback, every stream and bucket with 3 replicas, the services connected with all three
URLs. In the middle of 2,000 calls the node that leads one stream (the calls stream, or
the stream behind the outcomes bucket) is SIGKILLed, as a machine losing power; the
gateway carries on with the other two; the node comes back later and catches up.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.harness import Gateway, make_test_registry
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.contracts.events import decode_event
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.stack.nats_server import NatsCluster

pytestmark = [pytest.mark.system, pytest.mark.timeout(900)]

CALLS = 2000
BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-1")


@pytest.fixture
def clustered(tmp_path: Path) -> Iterator[Gateway]:
    gateway = Gateway(
        data_dir=tmp_path / "data",
        registry_dir=make_test_registry(tmp_path / "registry"),
        with_audit=True,
    )
    gateway.stack.nats_cluster = 3
    gateway.start(timeout=180)
    yield gateway
    gateway.stop()


async def _wait_for(predicate: Callable[[], Awaitable[bool]], timeout: float = 300.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            if await predicate():
                return
        except Exception:  # a request that met the dead node: ask again
            pass
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.3)


async def _asking_again(request: Callable[[], Awaitable[Any]]) -> Any:
    """A request while a node fails over: asked again until some node answers."""
    for _ in range(100):
        try:
            return await request()
        except Exception:
            await asyncio.sleep(0.5)
    return await request()


async def _publish_until_stored(js: Any, subject: str, body: bytes) -> None:
    """What a careful client does while a node fails over: publish again until acked.
    (A call stored twice is answered once: the validator claims its call_id.)"""
    while True:
        try:
            await js.publish(subject, body, stream=subjects.CALLS_STREAM, timeout=5)
            return
        except Exception:
            await asyncio.sleep(0.5)


async def _stream_event_ids(nc: Any) -> list[str]:
    """Every event id in the events stream, duplicates included, in one pass."""
    js = nc.jetstream()
    last = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
    sub = await js.pull_subscribe(
        f"{subjects.EVENTS_PREFIX}.>",
        stream=subjects.EVENTS_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
    )
    ids: list[str] = []
    seen = 0
    while seen < last:
        for msg in await sub.fetch(1000, timeout=10):
            event = decode_event(msg.data)
            ids.append(event.event_id)
            seen = msg.metadata.sequence.stream
    await sub.unsubscribe()
    return ids


async def _result_attached_per_call(nc: Any) -> Counter[str]:
    """Distinct ResultAttached events per call_id, as the audit would count them."""
    js = nc.jetstream()
    pattern = f"{subjects.EVENTS_PREFIX}.ResultAttached.>"
    info = await js.stream_info(subjects.EVENTS_STREAM, subjects_filter=pattern)
    stored = sum((info.state.subjects or {}).values())
    sub = await js.pull_subscribe(
        pattern,
        stream=subjects.EVENTS_STREAM,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
    )
    seen: dict[str, str] = {}
    read = 0
    while read < stored:
        for msg in await sub.fetch(1000, timeout=10):
            event = decode_event(msg.data)
            seen[event.event_id] = event.call_id
            read += 1
    await sub.unsubscribe()
    return Counter(seen.values())


def _audit_differences(audit: Any, event_ids: set[str]) -> str:
    """What a failed count is made of: events shown twice by the view (copies that
    differ), and events the audit holds that the stream did not when it was read."""
    copies = audit.query(
        "SELECT event_type, count() FROM (SELECT event_id, any(event_type) AS event_type"
        " FROM events GROUP BY event_id HAVING count() > 1) GROUP BY event_type"
    ).result_rows
    differing = audit.query(
        "SELECT event_id, groupArray(occurred_at), groupArray(service), groupArray(note),"
        " groupArray(status) FROM events GROUP BY event_id HAVING count() > 1 LIMIT 3"
    ).result_rows
    unknown = Counter(
        event_type
        for event_id, event_type in audit.query(
            "SELECT event_id, event_type FROM events WHERE event_type != 'CallRequested'"
        ).result_rows
        if event_id not in event_ids
    )
    return f"shown twice: {copies} e.g. {differing}; not in the stream read: {dict(unknown)}"


@pytest.mark.parametrize(
    "stream", [subjects.CALLS_STREAM, f"KV_{subjects.OUTCOMES_BUCKET}"], ids=["calls", "outcomes"]
)
async def test_losing_the_node_that_leads_a_stream_loses_and_repeats_nothing(
    clustered: Gateway, stream: str
) -> None:
    cluster = clustered.stack.cluster
    assert isinstance(cluster, NatsCluster)
    admin = await clustered.connect()
    js_admin = admin.jetstream(timeout=5)
    info = await js_admin.stream_info(stream)
    assert info.config.num_replicas == 3
    creds = await clustered.agent_creds(BOB.tenant, BOB.agent)
    agent = await nats.connect(
        nats_servers(clustered.url),
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        **connect_options(creds),
    )
    js = agent.jetstream(timeout=5)
    calls = [
        ToolCall(call_id=f"cl-{i:04d}", tool="echo", arguments={"payload": i}, principal=BOB)
        for i in range(CALLS)
    ]
    subject = subjects.calls_subject(BOB.tenant, BOB.agent)

    killed = asyncio.Event()

    async def publish_all() -> None:
        # The rest only once the node is down: the pipeline is fast enough to
        # answer a whole run between two looks at the results stream.
        for i, call in enumerate(calls):
            if i == 400:
                await killed.wait()
            await _publish_until_stored(js, subject, msgspec.json.encode(call))

    async def results_stored() -> int:
        return int((await js_admin.stream_info(subjects.RESULTS_STREAM)).state.messages)

    publishing = asyncio.create_task(publish_all())

    async def some_answered() -> bool:
        return await results_stored() >= 200

    await _wait_for(some_answered)
    leader = (await js_admin.stream_info(stream)).cluster.leader
    victim = cluster.node_named(leader)
    # Read while every node is up: read after the kill, it may only come once the
    # admin connection has failed over, by when a fast machine has answered every call.
    # At most the 400 published so far: the other 1,600 go out after the kill.
    answered_at_kill = await results_stored()
    cluster.kill(victim)
    killed.set()

    async def more_answered_without_it() -> bool:
        return await results_stored() >= min(answered_at_kill + 300, CALLS)

    # The gateway carries on with two nodes: a new leader, calls answered meanwhile.
    await _wait_for(more_answered_without_it)
    new_leader = (await _asking_again(lambda: js_admin.stream_info(stream))).cluster.leader
    await publishing
    cluster.start_node(victim)

    async def all_answered() -> bool:
        return await results_stored() >= CALLS

    await _wait_for(all_answered)

    async def caught_up() -> bool:  # the restarted node is a current replica again
        for name in (stream, subjects.CALLS_STREAM, subjects.EVENTS_STREAM):
            peers = (await js_admin.stream_info(name)).cluster.replicas or []
            if len(peers) != 2 or not all(p.current and not p.offline for p in peers):
                return False
        return True

    await _wait_for(caught_up)

    assert new_leader != leader

    # Every call exactly one result, and the right one. (Each read is asked again if
    # it meets a node that is not ready yet: the restarted one has only just caught up.)
    async def stored_results() -> list[ToolResult]:
        found = []
        for call in calls:
            stored = await js_admin.get_last_msg(
                subjects.RESULTS_STREAM,
                subjects.results_subject(BOB.tenant, BOB.agent, call.call_id),
                direct=True,
            )
            found.append(msgspec.json.decode(stored.data, type=ToolResult))
        return found

    results = await _asking_again(stored_results)
    assert [r.status for r in results] == ["ok"] * CALLS, Counter(r.status for r in results)
    assert [r.data for r in results] == [{"payload": i} for i in range(CALLS)]
    attached = await _asking_again(lambda: _result_attached_per_call(admin))
    assert set(attached) == {c.call_id for c in calls}
    assert set(attached.values()) == {1}

    # Every event reaches the audit once: one row per distinct event id of the stream,
    # plus one per stored call message. The stream is read again once the audit has
    # caught up with it, until the two reads agree: a message the failover left unacked
    # may be redelivered late (after its AckWait), and its events come after a first read.
    audit = clustered.audit_client()

    async def stream_now() -> tuple[set[str], int]:
        ids = set(await _asking_again(lambda: _stream_event_ids(admin)))
        info = await _asking_again(lambda: js_admin.stream_info(subjects.CALLS_STREAM))
        return ids, int(info.state.messages)

    async def audited(expected: int) -> bool:
        rows = audit.query("SELECT count() FROM events").result_rows[0][0]
        return bool(rows >= expected)

    event_ids, stored_calls = await stream_now()
    for _ in range(10):
        expected = len(event_ids) + stored_calls
        await _wait_for(lambda: audited(expected))  # noqa: B023 (awaited here, in this pass)
        again = await stream_now()
        if again == (event_ids, stored_calls):
            break
        event_ids, stored_calls = again
    count, distinct = audit.query("SELECT count(), uniqExact(event_id) FROM events").result_rows[0]
    assert count == distinct == len(event_ids) + stored_calls, _audit_differences(audit, event_ids)
    in_audit = {
        r[0]
        for r in audit.query(
            "SELECT event_id FROM events WHERE source_stream = 'TOOLGATE_EVENTS'"
        ).result_rows
    }
    assert in_audit == event_ids
    await agent.close()
    await admin.close()


def test_toolgate_up_nats_cluster_3_as_an_operator_types_it(tmp_path: Path) -> None:
    """The command itself: three nodes, streams on 3 replicas, a call answered, status."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOOLGATE_DATA_DIR": str(tmp_path / ".toolgate")}
    env.pop("TOOLGATE_NATS_URL", None)
    env.pop("TOOLGATE_NATS_CREDS", None)
    toolgate = [sys.executable, "-m", "toolgate.cli.main"]
    up = subprocess.Popen(
        [*toolgate, "up", "--nats-cluster", "3", "--nats-port", "0", "--no-audit"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        said = []
        for line in up.stdout:  # bounded by the test timeout
            said.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        nats_line = next(line for line in said if line.strip().startswith("NATS:"))
        urls = nats_line.split(":", 1)[1].strip().split(",")
        assert len(urls) == 3, said
        context = json.loads((tmp_path / ".toolgate" / "context.json").read_text())
        assert context["nats_url"] == ",".join(urls)

        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*toolgate, *args], cwd=tmp_path, env=env, capture_output=True, text=True
            )

        called = run("call", "echo", '{"payload": "three nodes"}')
        assert called.returncode == 0, called.stderr
        assert json.loads(called.stdout)["data"] == {"payload": "three nodes"}
        status = run("status")
        assert status.returncode == 0, status.stderr
        assert "executor-echo" in status.stdout and "validator    up" in status.stdout

        async def replicas() -> set[int]:
            nc = await nats.connect(
                nats_servers(context["nats_url"]), **connect_options(context["creds"]["admin"])
            )
            js = nc.jetstream()
            found = {
                (await js.stream_info(name)).config.num_replicas or 0
                for name in (
                    subjects.CALLS_STREAM,
                    subjects.EVENTS_STREAM,
                    subjects.RESULTS_STREAM,
                    f"KV_{subjects.OUTCOMES_BUCKET}",
                )
            }
            await nc.close()
            return found

        assert asyncio.run(replicas()) == {3}
    finally:
        up.terminate()
        up.wait(60)
    assert up.returncode == 0


def test_an_existing_cluster_named_by_several_urls_is_used_with_3_replicas(
    tmp_path: Path,
) -> None:
    """`--nats-url a,b,c`: a cluster someone else runs (here: three nodes that trust this
    data dir's operator, as a cluster configured with its nats-auth.conf would)."""
    from toolgate.stack.nats_auth import create_credentials

    data = tmp_path / "data"
    registry = make_test_registry(tmp_path / "registry")
    auth = create_credentials(data, tools=sorted(p.stem for p in registry.glob("*.yaml")))
    cluster = NatsCluster(tmp_path / "theirs", 3, config_file=auth.auth_config).start()
    try:
        gateway = Gateway(data_dir=data, registry_dir=registry)
        gateway.stack.nats_url = cluster.url
        gateway.start()
        try:
            assert gateway.stack.cluster is None and gateway.stack.nats is None  # not ours

            async def call_and_look() -> Any:
                async with await gateway.client() as client:
                    assert (await client.call("echo", {"payload": 3}, principal=BOB)).ok
                nc = await gateway.connect()
                info = await nc.jetstream().stream_info(subjects.CALLS_STREAM)
                await nc.close()
                return info

            info = asyncio.run(call_and_look())
            assert info.config.num_replicas == 3
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        finally:
            gateway.stop()
    finally:
        cluster.stop()


async def test_the_lag_a_scaler_reads_is_the_consumer_leaders(tmp_path: Path) -> None:
    """What KEDA's nats-jetstream trigger reads: /jsz on the monitoring port. On a cluster
    only the node leading the durable reports its lag as consumer info does (checked
    here: the followers said 0 pending), so the scaler must ask the leader by name
    (`<server_name>.<endpoint>`: in infra/k8s server_name is the pod's name and the
    endpoint the headless service)."""
    import json
    import urllib.request

    from nats.js.api import ConsumerConfig as Config

    cluster = NatsCluster(tmp_path / "nats", 3).start()
    try:
        nc = await nats.connect(nats_servers(cluster.url))
        js = nc.jetstream()
        await js.add_stream(name="WORK", subjects=["work.>"], num_replicas=3)
        await js.add_consumer(
            "WORK",
            Config(
                durable_name="executor-x", ack_policy=AckPolicy.EXPLICIT, filter_subject="work.>"
            ),
        )
        for _ in range(50):
            await js.publish("work.x", b"x")
        sub = await js.pull_subscribe_bind("executor-x", "WORK")
        for msg in await sub.fetch(20, timeout=10):
            await msg.ack_sync()
        info = await js.consumer_info("WORK", "executor-x")
        await nc.close()
        assert info.cluster is not None and info.num_pending == 30 and info.num_ack_pending == 0

        def jsz(node: int) -> dict[str, Any]:
            url = f"{cluster.nodes[node].monitor_url}/jsz?consumers=true&accounts=true"
            with urllib.request.urlopen(url, timeout=5) as answer:
                found = json.loads(answer.read())
            for account in found.get("account_details") or []:
                for stream in account.get("stream_detail") or []:
                    for consumer in stream.get("consumer_detail") or []:
                        if consumer["name"] == "executor-x":
                            return dict(consumer)
            raise AssertionError(f"node {node} does not list the durable")

        async def leader_reports_the_acks() -> bool:  # its own view settles at once
            return jsz(cluster.node_named(info.cluster.leader))["num_pending"] == 30

        await _wait_for(leader_reports_the_acks, timeout=30)
        leader = jsz(cluster.node_named(info.cluster.leader))
        assert leader["num_pending"] == info.num_pending
        assert leader["num_ack_pending"] == info.num_ack_pending
        assert leader["cluster"]["leader"] == info.cluster.leader
    finally:
        cluster.stop()
