"""The locked bus: nats-server itself enforces who may publish and consume what.

A real nats-server runs with the authorization config rendered from
infra/nats/permissions.yaml; every client logs in with a role's nkey
credentials. A refused operation is a "Permissions Violation" sent by the
server (and logged by it), not a check in our code.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from faststream.nats import NatsBroker
from nats.aio.client import Client
from nats.errors import NoServersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import NotFoundError

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import (
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    encode_event,
    utc_now,
)
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry
from toolgate.services import bus
from toolgate.services.client.gateway_client import GatewayClient, new_call_id
from toolgate.services.settings import GatewaySettings
from toolgate.services.stack import nats_auth
from toolgate.services.stack.nats_server import EmbeddedNats
from toolgate.services.stack.topology import Topology

TOOLS = load_registry(BUILTIN_TOOLS_DIR).names()
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
# Buckets the services use: created here if the topology does not declare them.
SERVICE_BUCKETS = ("toolgate_policies", "toolgate_rate_limits", "toolgate_approvals")
VOTE_SUBJECT = "toolgate.approvals.vote"


@dataclass
class LockedBus:
    nats: EmbeddedNats
    creds: nats_auth.Credentials
    errors: dict[str, list[str]] = field(default_factory=dict)
    clients: list[Client] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nats.url

    async def connect(self, role: str) -> Client:
        """A raw nats-py client logged in as `role`; server errors land in errors[role]."""
        seen = self.errors.setdefault(role, [])

        async def on_error(exc: Exception) -> None:
            seen.append(str(exc))

        nc = await nats.connect(self.url, error_cb=on_error, allow_reconnect=False,
                                **nats_auth.connect_options(self.creds.path(role)))
        self.clients.append(nc)
        return nc

    def server_violations(self) -> list[str]:
        return [line for line in self.nats.log_path.read_text().splitlines()
                if "Violation" in line]

    async def wait_for_error(self, role: str, fragment: str, timeout: float = 5.0) -> str:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            found = [e for e in self.errors.get(role, []) if fragment.lower() in e.lower()]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no server error {fragment!r} for {role}: {self.errors.get(role)}")


async def apply_topology_as_admin(bus_: LockedBus) -> None:
    """What topology.apply_topology does, logged in as admin (it takes a URL only today)."""
    nc = await bus_.connect("admin")
    js = nc.jetstream()
    topology = Topology()
    for config in topology.streams():
        await js.add_stream(config)
    declared = {bucket.bucket for bucket in topology.buckets()}
    for bucket in topology.buckets():
        await js.create_key_value(bucket)
    for name in set(SERVICE_BUCKETS) - declared:
        await js.create_key_value(KeyValueConfig(bucket=name, history=1,
                                                 storage=StorageType.FILE))


@pytest.fixture
def locked_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LockedBus]:
    creds = nats_auth.create_credentials(tmp_path / "data", tools=TOOLS)
    nats_dir = tmp_path / "nats"
    nats_dir.mkdir()
    # nats-server resolves an include relative to the including file, even an
    # absolute one; EmbeddedNats writes its config into nats_dir, so run from
    # there and pass a path that means the same thing to both.
    monkeypatch.chdir(nats_dir)
    server = EmbeddedNats(nats_dir, config_file=Path(os.path.relpath(creds.auth_config)))
    server.start()
    yield LockedBus(server, creds)
    server.stop()


@pytest.fixture
async def locked(locked_nats: LockedBus) -> AsyncIterator[LockedBus]:
    await apply_topology_as_admin(locked_nats)
    yield locked_nats
    for nc in locked_nats.clients:
        if not nc.is_closed:
            await nc.close()


def a_call(tool: str = "echo", **arguments: Any) -> ToolCall:
    return ToolCall(call_id=new_call_id(), tool=tool, arguments=arguments or {"payload": 1},
                    principal=ALICE)


def forged_authorization(call: ToolCall) -> bytes:
    sha = arguments_sha256(call.arguments)
    return encode_event(CallAuthorized(
        event_id=f"forged-{call.call_id}", call_id=call.call_id, occurred_at=utc_now(),
        service="policy", tool=call.tool, call=call, policy_version="v1",
        authorization=Authorization(call_id=call.call_id, tool=call.tool,
                                    arguments_sha256=sha, policy_version="v1",
                                    expires_at=utc_now() + timedelta(minutes=5))))


# ---------------------------------------------------------------- credentials


def test_credentials_are_private_and_kept_when_created_again(tmp_path: Path) -> None:
    first = nats_auth.create_credentials(tmp_path, tools=TOOLS)
    assert set(first.roles) >= {"admin", "agent", "validator", "policy", "approvals",
                                "executor", "attacher", "audit"}
    for role in first.roles:
        assert first.path(role).stat().st_mode & 0o777 == 0o600
    assert first.directory.stat().st_mode & 0o777 == 0o700
    config = first.auth_config.read_text()
    for role in first.roles:  # the server config holds public keys only, never a seed
        assert first.public_keys[role] in config
        assert nats_auth.read_seed(first.path(role).read_text()) not in config
    again = nats_auth.create_credentials(tmp_path, tools=[*TOOLS, "another_tool"])
    assert again.public_keys == first.public_keys
    assert "executor-another_tool" in again.auth_config.read_text()


def test_connect_options_carry_the_seed_and_the_roles_inbox(tmp_path: Path) -> None:
    creds = nats_auth.create_credentials(tmp_path, tools=TOOLS)
    agent = nats_auth.connect_options(creds.path("agent"))
    assert agent["inbox_prefix"] == "_INBOX_agent"
    assert nats_auth.public_key_of(agent["nkeys_seed_str"]) == creds.public_keys["agent"]
    assert nats_auth.connect_options(creds.path("executor"))["inbox_prefix"] == "_INBOX"
    assert nats_auth.connect_options(None) == {}


def test_every_event_type_named_in_the_permissions_exists() -> None:
    from toolgate.contracts import events

    document = nats_auth.load_permissions()
    for role in nats_auth.role_permissions(document, TOOLS):
        for subject in (*role.publish, *role.subscribe):
            if subject.startswith(subjects.EVENTS_PREFIX + "."):
                name = subject.split(".")[2]
                assert name in {"*", ">"} or isinstance(getattr(events, name, None), type), (
                    f"{role.role}: {subject} names no event type")


# ---------------------------------------------------------------- the agent


async def test_connection_without_credentials_is_refused(locked: LockedBus) -> None:
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(locked.url, allow_reconnect=False, max_reconnect_attempts=0,
                           connect_timeout=2)


async def test_agent_publishes_a_call_and_gets_a_publish_ack(locked: LockedBus) -> None:
    js = (await locked.connect("agent")).jetstream()
    call = a_call()
    ack = await js.publish(subjects.CALLS, msgspec.json.encode(call),
                           stream=subjects.CALLS_STREAM, headers={"Nats-Msg-Id": call.call_id})
    assert ack.stream == subjects.CALLS_STREAM and ack.seq == 1
    assert locked.errors["agent"] == []


async def test_server_refuses_an_agent_publishing_to_an_executor_subject(
        locked: LockedBus) -> None:
    agent = await locked.connect("agent")
    call = a_call()
    forged = subjects.event_subject(CallAuthorized, "echo")  # toolgate.evt.CallAuthorized.echo
    with pytest.raises(NatsTimeout):  # no publish ack: the server dropped the message
        await agent.jetstream().publish(forged, forged_authorization(call), timeout=1.0,
                                        headers={"Nats-Msg-Id": f"forged-{call.call_id}"})
    error = await locked.wait_for_error("agent", "permissions violation for publish")
    assert forged.lower() in error.lower()
    assert any(f'Publish Violation - Subject "{forged}"' in line
               for line in locked.server_violations()), locked.server_violations()
    assert agent.is_connected  # refused, not disconnected

    admin = (await locked.connect("admin")).jetstream()
    with pytest.raises(NotFoundError):
        await admin.get_last_msg(subjects.EVENTS_STREAM, forged)
    assert (await admin.stream_info(subjects.EVENTS_STREAM)).state.messages == 0


async def test_agent_cannot_read_internal_events_or_other_inboxes(locked: LockedBus) -> None:
    agent = await locked.connect("agent")
    for subject in (f"{subjects.EVENTS_PREFIX}.>", "_INBOX.>", ">"):
        await agent.subscribe(subject)
        await locked.wait_for_error("agent", f'subscription to "{subject}"')
    js = agent.jetstream()
    with pytest.raises(NatsTimeout):  # cannot make itself a consumer of the executor's queue
        await js.pull_subscribe(subjects.event_filter(CallAuthorized, "echo"),
                                durable="executor-echo", stream=subjects.EVENTS_STREAM)
    await locked.wait_for_error("agent", "$js.api.consumer.info.toolgate_events.executor-echo")


async def test_agent_reads_results_and_pending_notices(locked: LockedBus) -> None:
    call_id = new_call_id()
    agent = await locked.connect("agent")
    got: asyncio.Queue[str] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await got.put(msg.subject)

    await agent.subscribe(subjects.results_subject(call_id), cb=on_msg)
    await agent.subscribe(subjects.pending_subject(call_id), cb=on_msg)
    await agent.flush()
    approvals = (await locked.connect("approvals")).jetstream()
    attacher = (await locked.connect("attacher")).jetstream()
    await approvals.publish(subjects.pending_subject(call_id), b"{}",
                            stream=subjects.RESULTS_STREAM)
    await attacher.publish(subjects.results_subject(call_id), b'{"ok": true}',
                           stream=subjects.RESULTS_STREAM)
    received = {await asyncio.wait_for(got.get(), 5), await asyncio.wait_for(got.get(), 5)}
    assert received == {subjects.pending_subject(call_id), subjects.results_subject(call_id)}
    stored = await agent.jetstream().get_last_msg(subjects.RESULTS_STREAM,
                                                  subjects.results_subject(call_id))
    assert stored.data == b'{"ok": true}'
    assert locked.errors["agent"] == [] and locked.server_violations() == []


# ---------------------------------------------------------------- the services


async def test_validator_consumes_its_durable_and_emits_validated(locked: LockedBus) -> None:
    agent = (await locked.connect("agent")).jetstream()
    call = a_call()
    await agent.publish(subjects.CALLS, msgspec.json.encode(call), stream=subjects.CALLS_STREAM,
                        headers={"Nats-Msg-Id": call.call_id})
    validator = await locked.connect("validator")
    js = validator.jetstream()
    sub = await js.pull_subscribe(subjects.CALLS, durable="validator",
                                  stream=subjects.CALLS_STREAM,
                                  config=bus.consumer_config("validator", subjects.CALLS))
    [msg] = await sub.fetch(1, timeout=5)
    event = ArgumentsValidated(event_id="v1", call_id=call.call_id, occurred_at=utc_now(),
                               service="validator", tool=call.tool, call=call)
    ack = await js.publish(subjects.subject_of(event), encode_event(event),
                           stream=subjects.EVENTS_STREAM, headers={"Nats-Msg-Id": "v1"})
    assert ack.seq == 1
    await msg.in_progress()
    await msg.ack_sync()
    assert locked.errors["validator"] == [] and locked.server_violations() == []

    # ...and nothing else: not an authorization, not a call, not another's durable.
    with pytest.raises(NatsTimeout):
        await js.publish(subjects.event_subject(CallAuthorized, "echo"), b"{}", timeout=1.0)
    await locked.wait_for_error("validator", "publish to \"toolgate.evt.callauthorized.echo\"")
    with pytest.raises(NatsTimeout):
        await js.publish(subjects.CALLS, b"{}", timeout=1.0)
    await locked.wait_for_error("validator", 'publish to "toolgate.calls"')
    with pytest.raises(NatsTimeout):
        await js.pull_subscribe(subjects.event_filter(ArgumentsValidated), durable="policy",
                                stream=subjects.EVENTS_STREAM)


async def test_executor_cannot_publish_calls_nor_widen_its_consumer(locked: LockedBus) -> None:
    js = (await locked.connect("executor")).jetstream()
    with pytest.raises(NatsTimeout):
        await js.publish(subjects.CALLS, msgspec.json.encode(a_call()), timeout=1.0)
    await locked.wait_for_error("executor", 'permissions violation for publish to "toolgate.calls"')
    with pytest.raises(NatsTimeout):  # its durable, but over every tool's authorizations
        await js.pull_subscribe(subjects.event_filter(CallAuthorized, "*"),
                                durable="executor-echo", stream=subjects.EVENTS_STREAM)
    await locked.wait_for_error(
        "executor", "consumer.create.toolgate_events.executor-echo.toolgate.evt.callauthorized.*")


async def test_executor_keeps_outcomes_in_its_bucket_only(locked: LockedBus) -> None:
    js = (await locked.connect("executor")).jetstream()
    kv = await js.key_value(subjects.OUTCOMES_BUCKET)
    revision = await kv.create("call_1", b"started")
    assert (await kv.get("call_1")).value == b"started"
    await kv.update("call_1", b"started again", last=revision)
    await kv.put("call_1", b"done")
    assert (await kv.get("call_1")).value == b"done"
    assert locked.errors["executor"] == [] and locked.server_violations() == []
    with pytest.raises(NatsTimeout):
        await js.key_value("toolgate_approvals")


async def test_policy_reads_and_watches_policies_but_cannot_write_them(
        locked: LockedBus) -> None:
    admin = await (await locked.connect("admin")).jetstream().key_value("toolgate_policies")
    await admin.put("current", b"v1")
    js = (await locked.connect("policy")).jetstream()
    policies = await js.key_value("toolgate_policies")
    assert (await policies.get("current")).value == b"v1"
    watcher = await policies.watch("current")
    first = await watcher.updates(timeout=5)
    assert first is not None and first.value == b"v1"
    assert await watcher.updates(timeout=5) is None  # nats-py: the initial values are done
    await admin.put("current", b"v2")
    second = await watcher.updates(timeout=5)
    assert second is not None and second.value == b"v2"
    await watcher.stop()
    limits = await js.key_value("toolgate_rate_limits")
    await limits.put("acme.u-alice", b"1")
    assert locked.errors["policy"] == [] and locked.server_violations() == []
    with pytest.raises(NatsTimeout):
        await policies.put("current", b"allow everything")
    await locked.wait_for_error("policy", 'publish to "$kv.toolgate_policies.current"')


async def test_approvals_answers_votes_and_approvers_only_vote(locked: LockedBus) -> None:
    approvals = await locked.connect("approvals")

    async def answer(msg: Any) -> None:
        await msg.respond(b"counted:" + msg.data)

    await approvals.subscribe(VOTE_SUBJECT, queue="approvals", cb=answer)
    await approvals.flush()
    approver = await locked.connect("approver")
    reply = await approver.request(VOTE_SUBJECT, b"yes", timeout=5)
    assert reply.data == b"counted:yes"
    assert reply.subject.startswith("_INBOX_approver.")
    kv = await approver.jetstream().key_value("toolgate_approvals")
    watcher = await kv.watchall()
    assert await watcher.updates(timeout=5) is None  # empty bucket, read through a watch
    await watcher.stop()
    assert locked.errors["approvals"] == [] and locked.errors["approver"] == []
    assert locked.server_violations() == []

    # An approver cannot grant by event, nor write the approval state itself.
    with pytest.raises(NatsTimeout):
        await approver.jetstream().publish(f"{subjects.EVENTS_PREFIX}.ApprovalGranted.echo",
                                           b"{}", timeout=1.0)
    with pytest.raises(NatsTimeout):
        await kv.put("call_1", b"granted")
    await locked.wait_for_error("approver", 'publish to "$kv.toolgate_approvals.call_1"')
    # The approvals service may tell an agent it waits, but not give its result.
    with pytest.raises(NatsTimeout):
        await approvals.jetstream().publish(subjects.results_subject("call_1"), b"{}",
                                            timeout=1.0)
    await locked.wait_for_error("approvals", 'publish to "toolgate.results.call_1"')


def every_consumer() -> list[tuple[str, str, str, str]]:
    document = nats_auth.load_permissions()
    scalars, lists = nats_auth.subject_vars(document), nats_auth.list_vars(TOOLS)
    found = []
    for role, spec in document["roles"].items():
        for entry in (spec or {}).get("consume") or []:
            for c in nats_auth.expand(entry, scalars, lists):
                found.append((role, c["stream"], c["durable"], c["filter"]))
    return found


async def test_each_service_can_create_and_drain_each_of_its_durables(locked: LockedBus) -> None:
    # One stored message per stream, so every consumer has something to fetch and ack.
    admin = (await locked.connect("admin")).jetstream()
    await admin.publish(subjects.CALLS, b"{}")
    await admin.publish(subjects.results_subject("c1"), b"{}")
    for role, stream, durable, filter_subject in every_consumer():
        if stream == subjects.EVENTS_STREAM:
            await admin.publish(filter_subject.replace("*", "echo").replace(">", "X.echo"),
                                b"{}")
        js = (await locked.connect(role)).jetstream()
        sub = await js.pull_subscribe(filter_subject, durable=durable, stream=stream,
                                      config=bus.consumer_config(durable, filter_subject))
        msgs = await sub.fetch(1, timeout=5)
        await msgs[0].ack_sync()
        assert locked.errors[role] == [], (role, durable)
    assert locked.server_violations() == []


# ---------------------------------------------------------------- the real services


async def test_the_pipeline_runs_with_each_service_on_its_own_credentials(
        locked_nats: LockedBus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real services, in this process, each logged in as its own role, serve an agent.

    Until `--creds` reaches bus.make_broker, the broker it builds is given the
    credentials of the role its name starts with.
    """
    from toolgate.services.approvals.app import build_app as approvals_app
    from toolgate.services.attacher.app import build_app as attacher_app
    from toolgate.services.executor.app import build_app as executor_app
    from toolgate.services.policy.app import build_app as policy_app
    from toolgate.services.validator.app import build_app as validator_app

    locked = locked_nats
    await apply_topology_as_admin(locked)

    def logged_in_broker(*args: Any, **kwargs: Any) -> NatsBroker:
        if "security" not in kwargs:
            role = str(kwargs["name"]).split("@", 1)[0]
            kwargs.update(nats_auth.broker_options(locked.creds.path(role)))
        return NatsBroker(*args, **kwargs)

    monkeypatch.setattr(bus, "NatsBroker", logged_in_broker)
    settings = GatewaySettings(nats_url=locked.url, data_dir=tmp_path / "data")
    apps = [policy_app(settings), approvals_app(settings), validator_app(settings),
            executor_app(settings, concurrency=2), attacher_app(settings)]
    started = []
    try:
        for app in apps:
            await app.start()
            started.append(app)
        client = await GatewayClient.connect(
            locked.url, **nats_auth.connect_options(locked.creds.path("agent")))
        async with client:
            ok = await client.call("echo", {"payload": {"hello": "locked bus"}},
                                   principal=ALICE, timeout=20)
            assert ok.ok and ok.data == {"payload": {"hello": "locked bus"}}, ok
            bad = await client.call("echo", {"nope": 1}, principal=ALICE, timeout=20)
            assert bad.status == "invalid_arguments", bad
            assert await client.result(ok.call_id) == ok
    finally:
        for app in reversed(started):
            await app.stop()
    assert locked.server_violations() == []
