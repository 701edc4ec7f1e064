"""The locked bus: nats-server itself enforces who may publish and consume what.

A real nats-server runs in operator mode with the config rendered by
services/stack/nats_auth.py: the service roles are users of the account
TOOLGATE with the allow lists of infra/nats/permissions.yaml, the approvers'
user is in the account APPROVERS, and each agent is an account of its own
that imports only its calls subject and its own results. Every client logs
in with a standard creds file. A refused operation is a "Permissions
Violation" sent by the server (and logged by it), not a check in our code.

(Attacks by another tenant on a whole running gateway are in
tests/system/test_tenant_isolation.py; here each role and each agent
identity is held to its own allow list.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.errors import NoRespondersError, NoServersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import APIError, NotFoundError

from tests.harness import flushed
from toolgate.client.gateway_client import GatewayClient, new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import MAX_CALL_BYTES, Principal, ToolCall
from toolgate.contracts.events import (
    ApprovalGranted,
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    MessageDeadLettered,
    encode_event,
    utc_now,
)
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry
from toolgate.runtime import consumers
from toolgate.runtime import creds as creds_reading
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.topology import MAX_MESSAGE_BYTES, apply_topology
from toolgate.stack import nats_auth, nats_jwt
from toolgate.stack.nats_server import EmbeddedNats

TOOLS = load_registry(BUILTIN_TOOLS_DIR).names()
ACME = ("acme", "researcher")
# Another agent of the same tenant, and an agent of another tenant with the same name.
WRITER = ("acme", "writer")
GLOBEX = ("globex", "researcher")
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
VOTE_SUBJECT = "toolgate.approvals.vote"
# How long a refused request is waited on (no answer comes): never a figure under test.
REFUSED_S = 1.0
SERVICE_ROLES = ("validator", "policy", "approvals", "notifier", "executor", "attacher", "audit")


@dataclass
class LockedBus:
    nats: EmbeddedNats
    data_dir: Path
    creds: nats_auth.Credentials
    errors: dict[str, list[str]] = field(default_factory=dict)
    clients: list[Client] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.nats.url

    async def _login(self, who: str, creds: Path) -> Client:
        seen = self.errors.setdefault(who, [])

        async def on_error(exc: Exception) -> None:
            seen.append(str(exc))

        nc = await nats.connect(
            self.url,
            error_cb=on_error,
            allow_reconnect=False,
            **creds_reading.connect_options(creds),
        )
        self.clients.append(nc)
        return nc

    async def connect(self, role: str) -> Client:
        """A raw nats-py client logged in as `role`; server errors land in errors[role]."""
        return await self._login(role, self.creds.path(role))

    async def connect_agent(self, tenant: str, agent: str) -> Client:
        """A raw client of one agent identity; server errors land in errors["tenant.agent"]."""
        return await self._login(
            f"{tenant}.{agent}", nats_auth.agent_creds_path(self.data_dir, tenant, agent)
        )

    def server_violations(self) -> list[str]:
        return [line for line in self.nats.log_path.read_text().splitlines() if "Violation" in line]

    async def wait_for_error(self, who: str, fragment: str, timeout: float = 5.0) -> str:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            found = [e for e in self.errors.get(who, []) if fragment.lower() in e.lower()]
            if found:
                return found[0]
            await asyncio.sleep(0.05)
        raise AssertionError(f"no server error {fragment!r} for {who}: {self.errors.get(who)}")

    async def server_said(self, who: str, fragment: str, timeout: float = 5.0) -> str:
        """A line of the server's log about client `who` (its account name) with `fragment`."""

        def said() -> list[str]:
            return [
                line
                for line in self.nats.log_path.read_text().splitlines()
                if f"/{who}/" in line and fragment.lower() in line.lower()
            ]

        await until(lambda: bool(said()), timeout)
        return said()[0]

    async def refused_publish(self, who: str, subject: str) -> None:
        """The server's own word that `who` may not publish to `subject`."""
        await self.wait_for_error(who, f'permissions violation for publish to "{subject}"')
        assert any(
            f'Publish Violation - Subject "{subject}"' in line for line in self.server_violations()
        ), subject


async def until(condition: Any, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"not so within {timeout}s: {condition}")
        await asyncio.sleep(0.05)


@pytest.fixture
def locked_nats(tmp_path: Path) -> Iterator[LockedBus]:
    data_dir = tmp_path / "data"
    for tenant, agent in (ACME, WRITER, GLOBEX):  # minted first: preloaded by the server
        nats_auth.add_agent(data_dir, tenant, agent)
    creds = nats_auth.create_credentials(data_dir, tools=TOOLS)
    server = EmbeddedNats(data_dir / "nats", config_file=creds.auth_config).start()
    yield LockedBus(server, data_dir, creds)
    server.stop()


@pytest.fixture
async def locked(locked_nats: LockedBus) -> AsyncIterator[LockedBus]:
    await apply_topology(
        locked_nats.url, **creds_reading.connect_options(locked_nats.creds.path("admin"))
    )
    yield locked_nats
    for nc in locked_nats.clients:
        if not nc.is_closed:
            await nc.close()


def a_call(tool: str = "echo", principal: Principal = ALICE, **arguments: Any) -> ToolCall:
    return ToolCall(
        call_id=new_call_id(), tool=tool, arguments=arguments or {"payload": 1}, principal=principal
    )


def forged_authorization(call: ToolCall) -> bytes:
    sha = arguments_sha256(call.arguments)
    p = call.principal
    return encode_event(
        CallAuthorized(
            event_id=f"forged-{call.call_id}",
            call_id=call.call_id,
            occurred_at=utc_now(),
            service="policy",
            tool=call.tool,
            call=call,
            policy_version="v1",
            authorization=Authorization(
                call_id=call.call_id,
                tool=call.tool,
                arguments_sha256=sha,
                policy_version="v1",
                expires_at=utc_now() + timedelta(minutes=5),
                tenant=p.tenant,
                agent=p.agent,
                user=p.user,
                session=p.session,
            ),
        )
    )


def user_permissions(creds: Path) -> dict[str, Any]:
    token, _ = nats_jwt.read_creds(creds.read_text())
    return dict(nats_jwt.decode_claims(token)["nats"])


# ---------------------------------------------------------------- credentials


def test_credentials_are_private_and_kept_when_created_again(tmp_path: Path) -> None:
    agent_creds, _ = nats_auth.add_agent(tmp_path, *ACME)
    first = nats_auth.create_credentials(tmp_path, tools=TOOLS)
    # One user per service role, the approvers' user and the system user; no shared
    # "agent" role: each agent is an account of its own.
    assert set(first.roles) >= {"admin", "inbox", "sys", *SERVICE_ROLES}
    assert "agent" not in first.roles
    for role in first.roles:
        assert first.path(role).stat().st_mode & 0o777 == 0o600
    assert first.directory.stat().st_mode & 0o777 == 0o700
    assert agent_creds.stat().st_mode & 0o777 == 0o600
    assert agent_creds.parent.stat().st_mode & 0o777 == 0o700
    # The server config holds JWTs (public claims) only, never a seed.
    config = first.auth_config.read_text()
    seeds = [nats_jwt.read_creds(first.path(role).read_text())[1] for role in first.roles]
    seeds.append(nats_jwt.read_creds(agent_creds.read_text())[1])
    seeds += [p.read_text().strip() for p in (tmp_path / "auth").rglob("*.nk")]
    assert len(seeds) > len(first.roles) + 4  # operator, accounts, users, the agent
    assert all(seed not in config for seed in seeds)
    agent_account = nats_auth.list_agents(tmp_path)[0].account
    assert agent_account in config  # the agent's account JWT is preloaded

    again = nats_auth.create_credentials(tmp_path, tools=[*TOOLS, "another_tool"])
    assert again.public_keys == first.public_keys
    executor = user_permissions(again.path("executor"))["pub"]["allow"]
    assert any(".executor-another_tool." in s for s in executor), executor


def test_agent_creds_name_the_agent_and_allow_only_its_own_subjects(tmp_path: Path) -> None:
    creds, _ = nats_auth.add_agent(tmp_path, *ACME)
    assert creds_reading.identity_of_creds(creds) == ACME
    service = nats_auth.create_credentials(tmp_path, tools=TOOLS).path("validator")
    assert creds_reading.identity_of_creds(service) is None
    claims = user_permissions(creds)
    results = subjects.agent_results_prefix(*ACME)
    assert claims["pub"]["allow"] == [
        subjects.calls_subject(*ACME),
        f"{subjects.direct_get_prefix(subjects.RESULTS_STREAM)}.{results}.>",
        subjects.tools_listing_subject(*ACME),
    ]
    assert sorted(claims["sub"]["allow"]) == sorted(["_INBOX.>", f"{results}.>"])
    # Adding an agent again gives the same identity back; a bad name is refused.
    assert nats_auth.add_agent(tmp_path, *ACME)[0] == creds
    with pytest.raises(nats_auth.AgentError):
        nats_auth.add_agent(tmp_path, "acme", "research.*")


def test_connect_options_log_in_with_a_creds_file(tmp_path: Path) -> None:
    creds = nats_auth.create_credentials(tmp_path, tools=TOOLS)
    path = creds.path("executor")
    assert creds_reading.connect_options(path) == {"user_credentials": str(path)}
    assert creds_reading.connect_options(None) == {}
    with pytest.raises(creds_reading.CredentialsError):
        creds_reading.connect_options(tmp_path / "missing.creds")
    with pytest.raises(creds_reading.CredentialsError):
        creds.path("agent")  # no such role any more


def test_each_approver_and_the_inbox_read_replies_on_a_prefix_of_their_own(
    tmp_path: Path,
) -> None:
    alice, alice_key = nats_auth.mint_approver(tmp_path, "alice")
    bob, _ = nats_auth.mint_approver(tmp_path, "bob")
    own = f"{nats_auth.APPROVER_INBOX_PREFIX}.{alice_key}"
    assert user_permissions(alice)["sub"] == {"allow": [f"{own}.>"]}
    assert user_permissions(alice)["pub"] == {"allow": [f"{subjects.APPROVALS_PREFIX}.>"]}
    assert creds_reading.connect_options(alice)["inbox_prefix"] == own
    assert creds_reading.inbox_prefix_of(bob) not in (own, None, "_INBOX")
    inbox = nats_auth.create_credentials(tmp_path, tools=TOOLS).path("inbox")
    assert creds_reading.connect_options(inbox)["inbox_prefix"] == "_INBOX_approvals_inbox"
    assert user_permissions(inbox)["sub"] == {"allow": ["_INBOX_approvals_inbox.>"]}
    # Minting again (a rotation) is a new user with a new prefix.
    _, rotated = nats_auth.mint_approver(tmp_path, "alice")
    assert rotated != alice_key and creds_reading.inbox_prefix_of(alice) != own


def test_agent_limits_have_defaults_and_variables() -> None:
    assert nats_auth.agent_limits({}) == {
        "leaf": 0,
        "exports": 0,
        "subs": 512,
        "conn": 16,
        "payload": MAX_MESSAGE_BYTES,
    }
    changed = nats_auth.agent_limits(
        {"TOOLGATE_AGENT_MAX_SUBSCRIPTIONS": " 50 ", "TOOLGATE_AGENT_MAX_CONNECTIONS": "-1"}
    )
    assert (changed["subs"], changed["conn"]) == (50, -1)
    for bad in ("0", "many", "-2"):
        with pytest.raises(nats_auth.AgentError, match="TOOLGATE_AGENT_MAX_PAYLOAD"):
            nats_auth.agent_limits({"TOOLGATE_AGENT_MAX_PAYLOAD": bad})


def test_every_event_type_named_in_the_permissions_exists() -> None:
    from toolgate.contracts import events

    document = nats_auth.load_permissions()
    for role in nats_auth.role_permissions(document, TOOLS):
        for subject in (*role.publish, *role.subscribe):
            if subject.startswith(subjects.EVENTS_PREFIX + "."):
                name = subject.split(".")[2]
                assert name in {"*", ">"} or isinstance(getattr(events, name, None), type), (
                    f"{role.role}: {subject} names no event type"
                )


# ---------------------------------------------------------------- an agent


async def test_connection_without_credentials_is_refused(locked: LockedBus) -> None:
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):
        await nats.connect(
            locked.url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2
        )


async def test_agent_publishes_a_call_on_its_own_subject_and_gets_a_publish_ack(
    locked: LockedBus,
) -> None:
    js = (await locked.connect_agent(*ACME)).jetstream()
    call = a_call()
    ack = await js.publish(
        subjects.calls_subject(*ACME), msgspec.json.encode(call), stream=subjects.CALLS_STREAM
    )
    assert ack.stream == subjects.CALLS_STREAM and ack.seq == 1
    assert locked.errors["acme.researcher"] == []
    # Stored in toolgate's stream under the subject the server let this agent use.
    admin = (await locked.connect("admin")).jetstream()
    stored = await admin.get_msg(subjects.CALLS_STREAM, 1)
    assert stored.subject == subjects.calls_subject(*ACME)
    assert stored.data == msgspec.json.encode(call)


async def test_agent_cannot_publish_on_any_other_calls_subject(locked: LockedBus) -> None:
    agent = await locked.connect_agent(*ACME)
    js = agent.jetstream(timeout=REFUSED_S)
    for tenant, name in (WRITER, GLOBEX, ("acme", "*")):
        other = subjects.calls_subject(tenant, name)
        with pytest.raises((NatsTimeout, NoRespondersError)):  # no publish ack
            await js.publish(other, msgspec.json.encode(a_call()))
        await locked.refused_publish("acme.researcher", other)
    assert agent.is_connected  # refused, not disconnected
    admin = (await locked.connect("admin")).jetstream()
    assert (await admin.stream_info(subjects.CALLS_STREAM)).state.messages == 0


async def test_server_refuses_an_agent_publishing_to_an_executor_subject(locked: LockedBus) -> None:
    agent = await locked.connect_agent(*ACME)
    call = a_call()
    forged = subjects.event_subject(CallAuthorized, "echo")  # toolgate.evt.CallAuthorized.echo
    with pytest.raises(NatsTimeout):  # no publish ack: the server dropped the message
        await agent.jetstream().publish(
            forged,
            forged_authorization(call),
            timeout=REFUSED_S,
            headers={"Nats-Msg-Id": f"forged-{call.call_id}"},
        )
    await locked.refused_publish("acme.researcher", forged)
    # The server names the agent's own account in its log line.
    assert any(
        "/acme.researcher/" in line and forged in line for line in locked.server_violations()
    )
    assert agent.is_connected

    admin = (await locked.connect("admin")).jetstream()
    with pytest.raises(NotFoundError):
        await admin.get_last_msg(subjects.EVENTS_STREAM, forged)
    assert (await admin.stream_info(subjects.EVENTS_STREAM)).state.messages == 0


async def test_agent_cannot_read_internal_events_calls_or_other_agents_results(
    locked: LockedBus,
) -> None:
    agent = await locked.connect_agent(*ACME)
    for subject in (
        f"{subjects.EVENTS_PREFIX}.>",
        f"{subjects.CALLS_PREFIX}.>",
        f"{subjects.RESULTS_PREFIX}.>",
        f"{subjects.agent_results_prefix(*WRITER)}.>",
        f"{subjects.agent_results_prefix(*GLOBEX)}.>",
        ">",
    ):
        await agent.subscribe(subject)
        await locked.wait_for_error("acme.researcher", f'subscription to "{subject}"')
    js = agent.jetstream(timeout=REFUSED_S)
    with pytest.raises(NatsTimeout):  # cannot make itself a consumer of the executor's queue
        await js.pull_subscribe(
            subjects.event_filter(CallAuthorized, "echo"),
            durable="executor-echo",
            stream=subjects.EVENTS_STREAM,
        )
    await locked.wait_for_error(
        "acme.researcher", "$js.api.consumer.info.toolgate_events.executor-echo"
    )
    with pytest.raises(NatsTimeout):  # nor read toolgate's buckets
        await js.key_value(subjects.OUTCOMES_BUCKET)
    await locked.refused_publish(
        "acme.researcher", f"$JS.API.STREAM.INFO.KV_{subjects.OUTCOMES_BUCKET}"
    )


async def test_agent_reads_its_results_and_pending_notices_and_no_one_else_does(
    locked: LockedBus,
) -> None:
    call_id = new_call_id()
    result = subjects.results_subject(*ACME, call_id)
    pending = subjects.pending_subject(*ACME, call_id)
    agent = await locked.connect_agent(*ACME)
    got: asyncio.Queue[str] = asyncio.Queue()

    async def on_msg(msg: Any) -> None:
        await got.put(msg.subject)

    await agent.subscribe(result, cb=on_msg)
    await agent.subscribe(pending, cb=on_msg)
    await flushed(agent)
    approvals = (await locked.connect("approvals")).jetstream()
    attacher = (await locked.connect("attacher")).jetstream()
    await approvals.publish(pending, b"{}", stream=subjects.RESULTS_STREAM)
    await attacher.publish(result, b'{"ok": true}', stream=subjects.RESULTS_STREAM)
    received = {await asyncio.wait_for(got.get(), 5), await asyncio.wait_for(got.get(), 5)}
    assert received == {pending, result}
    # Read again later by subject, through the agent's own scoped direct get.
    stored = await agent.jetstream().get_last_msg(subjects.RESULTS_STREAM, result, direct=True)
    assert stored.data == b'{"ok": true}'
    assert locked.errors["acme.researcher"] == [] and locked.server_violations() == []

    # Written once: the first result stays.
    with pytest.raises(APIError):
        await attacher.publish(result, b'{"ok": false}', stream=subjects.RESULTS_STREAM)
    again = await agent.jetstream().get_last_msg(subjects.RESULTS_STREAM, result, direct=True)
    assert again.data == b'{"ok": true}'

    # Another agent of the same tenant, and one of another tenant, can neither
    # subscribe to it nor read it back.
    direct = f"{subjects.direct_get_prefix(subjects.RESULTS_STREAM)}.{result}"
    for tenant, name in (WRITER, GLOBEX):
        who = f"{tenant}.{name}"
        other = await locked.connect_agent(tenant, name)
        await other.subscribe(result)
        await locked.wait_for_error(who, f'subscription to "{result}"')
        with pytest.raises((NatsTimeout, NoRespondersError)):
            await other.jetstream(timeout=REFUSED_S).get_last_msg(
                subjects.RESULTS_STREAM, result, direct=True
            )
        await locked.refused_publish(who, direct)


async def test_an_agent_added_while_the_server_runs_can_call_at_once(locked: LockedBus) -> None:
    """`toolgate agents add` on a running gateway: the account JWT is pushed, no restart."""
    tenant, name = ("initech", "planner")
    creds, token = nats_auth.add_agent(locked.data_dir, tenant, name)
    with pytest.raises((NoServersError, nats.errors.Error, OSError)):  # not yet pushed
        await nats.connect(
            locked.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
            **creds_reading.connect_options(creds),
        )
    await nats_auth.push_account_jwts(locked.url, locked.data_dir, [token])
    js = (await locked.connect_agent(tenant, name)).jetstream()
    ack = await js.publish(subjects.calls_subject(tenant, name), b"{}")
    assert ack.stream == subjects.CALLS_STREAM
    with pytest.raises(NatsTimeout):
        await js.publish(subjects.calls_subject(*ACME), b"{}", timeout=REFUSED_S)
    await locked.refused_publish(f"{tenant}.{name}", subjects.calls_subject(*ACME))


async def test_an_agent_is_held_to_its_subscription_connection_and_payload_limits(
    locked: LockedBus,
) -> None:
    """NATS's own account limits, from the agent's account JWT: the server refuses (and
    says so in its log, naming the agent; nats-py closes a connection told -ERR)."""
    limits = nats_auth.agent_limits()
    connected = [await locked.connect_agent(*ACME) for _ in range(limits["conn"])]
    assert all(nc.is_connected for nc in connected)
    with pytest.raises(nats.errors.Error, match="maximum account active connections exceeded"):
        await nats.connect(
            locked.url,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=2,
            **creds_reading.connect_options(nats_auth.agent_creds_path(locked.data_dir, *ACME)),
        )
    # Another agent's account has limits of its own.
    other = await locked.connect_agent(*WRITER)
    assert other.is_connected

    agent = connected[1]
    results = subjects.agent_results_prefix(*ACME)
    for i in range(limits["subs"]):
        await agent.subscribe(f"{results}.call_{i}")
    await flushed(agent)
    assert locked.errors["acme.researcher"] == [] and agent.is_connected
    await agent.subscribe(f"{results}.one_too_many")
    await locked.server_said("acme.researcher", "maximum subscriptions exceeded")
    await until(lambda: agent.is_closed)


async def test_an_agent_whose_payload_limit_was_lowered_is_held_to_it(
    locked: LockedBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By default an agent may send what the server takes (so every call gets its
    PAYLOAD_TOO_LARGE result); an operator's lower TOOLGATE_AGENT_MAX_PAYLOAD is enforced
    by the server itself: the message is refused and that connection closed."""
    limit = 2 * MAX_CALL_BYTES
    monkeypatch.setenv("TOOLGATE_AGENT_MAX_PAYLOAD", str(limit))
    tenant, name = ("initech", "sender")
    _, token = nats_auth.add_agent(locked.data_dir, tenant, name)
    await nats_auth.push_account_jwts(locked.url, locked.data_dir, [token])
    sender = await locked.connect_agent(tenant, name)
    await sender.publish(subjects.calls_subject(tenant, name), b"x" * (limit + 1))
    await locked.server_said(f"{tenant}.{name}", "maximum payload")
    await until(lambda: sender.is_closed)
    admin = (await locked.connect("admin")).jetstream()
    assert (await admin.stream_info(subjects.CALLS_STREAM)).state.messages == 0


# ---------------------------------------------------------------- the services


async def test_validator_consumes_its_durable_and_emits_validated(locked: LockedBus) -> None:
    agent = (await locked.connect_agent(*ACME)).jetstream()
    call = a_call()
    await agent.publish(
        subjects.calls_subject(*ACME), msgspec.json.encode(call), stream=subjects.CALLS_STREAM
    )
    validator = await locked.connect("validator")
    js = validator.jetstream()
    sub = await js.pull_subscribe(
        subjects.CALLS_FILTER,
        durable="validator",
        stream=subjects.CALLS_STREAM,
        config=consumers.consumer_config("validator", subjects.CALLS_FILTER),
    )
    [msg] = await sub.fetch(1, timeout=5)
    assert msg.subject == subjects.calls_subject(*ACME)
    claims = await js.key_value(subjects.CALL_IDS_BUCKET)
    await claims.create(subjects.call_key(*ACME, call.call_id), b"1")
    event = ArgumentsValidated(
        event_id="v1",
        call_id=call.call_id,
        occurred_at=utc_now(),
        service="validator",
        tool=call.tool,
        call=call,
    )
    ack = await js.publish(
        subjects.subject_of(event),
        encode_event(event),
        stream=subjects.EVENTS_STREAM,
        headers={"Nats-Msg-Id": "v1"},
    )
    assert ack.seq == 1
    await msg.in_progress()
    await msg.ack_sync()
    assert locked.errors["validator"] == [] and locked.server_violations() == []

    # ...and nothing else: not an authorization, not a call, not another's durable.
    limited = validator.jetstream(timeout=REFUSED_S)
    with pytest.raises(NatsTimeout):
        await limited.publish(subjects.event_subject(CallAuthorized, "echo"), b"{}")
    await locked.refused_publish("validator", "toolgate.evt.CallAuthorized.echo")
    with pytest.raises(NatsTimeout):
        await limited.publish(subjects.calls_subject(*ACME), b"{}")
    await locked.refused_publish("validator", subjects.calls_subject(*ACME))
    with pytest.raises(NatsTimeout):
        await limited.publish(subjects.results_subject(*ACME, call.call_id), b"{}")
    await locked.refused_publish("validator", subjects.results_subject(*ACME, call.call_id))
    with pytest.raises(NatsTimeout):
        await limited.pull_subscribe(
            subjects.event_filter(ArgumentsValidated),
            durable="policy",
            stream=subjects.EVENTS_STREAM,
        )
    await locked.wait_for_error("validator", "$js.api.consumer.info.toolgate_events.policy")


async def test_executor_cannot_publish_calls_nor_widen_its_consumer(locked: LockedBus) -> None:
    js = (await locked.connect("executor")).jetstream(timeout=REFUSED_S)
    with pytest.raises(NatsTimeout):
        await js.publish(subjects.calls_subject(*ACME), msgspec.json.encode(a_call()))
    await locked.refused_publish("executor", subjects.calls_subject(*ACME))
    with pytest.raises(NatsTimeout):  # its durable, but over every tool's authorizations
        await js.pull_subscribe(
            subjects.event_filter(CallAuthorized, "*"),
            durable="executor-echo",
            stream=subjects.EVENTS_STREAM,
        )
    await locked.wait_for_error(
        "executor", "consumer.create.toolgate_events.executor-echo.toolgate.evt.callauthorized.*"
    )


async def test_executor_keeps_outcomes_in_its_bucket_only(locked: LockedBus) -> None:
    nc = await locked.connect("executor")
    kv = await nc.jetstream().key_value(subjects.OUTCOMES_BUCKET)
    key = subjects.call_key(*ACME, "call_1")
    revision = await kv.create(key, b"started")
    assert (await kv.get(key)).value == b"started"
    await kv.update(key, b"started again", last=revision)
    await kv.put(key, b"done")
    assert (await kv.get(key)).value == b"done"
    assert locked.errors["executor"] == [] and locked.server_violations() == []
    with pytest.raises(NatsTimeout):
        await nc.jetstream(timeout=REFUSED_S).key_value(subjects.APPROVALS_BUCKET)
    await locked.refused_publish("executor", f"$JS.API.STREAM.INFO.KV_{subjects.APPROVALS_BUCKET}")


async def test_policy_reads_and_watches_policies_but_cannot_write_them(locked: LockedBus) -> None:
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


async def test_only_the_policy_role_writes_its_record_of_the_last_accepted_bundle(
    locked: LockedBus,
) -> None:
    """Its high-water mark (services/policy/versions.py): a role that may write other
    buckets (or none) cannot lower it, so an old bundle cannot win across a restart."""
    record = f"$KV.{subjects.POLICY_ACCEPTED_BUCKET}.bundle"
    policy = (
        await (await locked.connect("policy"))
        .jetstream()
        .key_value(subjects.POLICY_ACCEPTED_BUCKET)
    )
    await policy.put("bundle", b"version 7")
    assert (await policy.get("bundle")).value == b"version 7"
    assert locked.errors["policy"] == [] and locked.server_violations() == []
    for role in ("validator", "approvals", "notifier", "executor", "attacher", "audit"):
        nc = await locked.connect(role)
        await nc.publish(record, b"version 1")
        await locked.refused_publish(role, record)
    assert (await policy.get("bundle")).value == b"version 7"


async def test_approvals_answers_votes_and_approvers_only_vote(locked: LockedBus) -> None:
    approvals = await locked.connect("approvals")

    async def answer(msg: Any) -> None:
        await msg.respond(b"counted:" + msg.data)

    await approvals.subscribe(VOTE_SUBJECT, queue="approvals", cb=answer)
    await flushed(approvals)
    # The approver is in the account APPROVERS: its request crosses to TOOLGATE's
    # approvals service through the import, and the answer comes back.
    approver = await locked.connect("inbox")
    reply = await approver.request(VOTE_SUBJECT, b"yes", timeout=5)
    assert reply.data == b"counted:yes"
    assert locked.errors["approvals"] == [] and locked.errors["inbox"] == []
    assert locked.server_violations() == []

    # An approver cannot grant by event, nor touch the approval state (nor any stream:
    # its account has none).
    limited = approver.jetstream(timeout=REFUSED_S)
    granted = f"{subjects.EVENTS_PREFIX}.ApprovalGranted.echo"
    with pytest.raises((NatsTimeout, NoRespondersError)):
        await limited.publish(granted, b"{}")
    await locked.refused_publish("inbox", granted)
    with pytest.raises((NatsTimeout, NoRespondersError)):
        await limited.key_value(subjects.APPROVALS_BUCKET)
    await locked.refused_publish("inbox", f"$JS.API.STREAM.INFO.KV_{subjects.APPROVALS_BUCKET}")
    await approver.publish(f"$KV.{subjects.APPROVALS_BUCKET}.call_1", b"granted")
    await locked.refused_publish("inbox", f"$KV.{subjects.APPROVALS_BUCKET}.call_1")
    # The approvals service may tell an agent it waits, but not give its result.
    result = subjects.results_subject(*ACME, "call_1")
    with pytest.raises(NatsTimeout):
        await approvals.jetstream().publish(result, b"{}", timeout=REFUSED_S)
    await locked.refused_publish("approvals", result)


async def test_notifier_reads_approvals_and_queues_deliveries_but_decides_nothing(
    locked: LockedBus,
) -> None:
    admin = (await locked.connect("admin")).jetstream()
    state = await admin.key_value(subjects.APPROVALS_BUCKET)
    key = subjects.call_key(*ACME, "call_1")
    await state.put(key, b"pending")
    notifier = await locked.connect("notifier")
    js = notifier.jetstream()
    approvals = await js.key_value(subjects.APPROVALS_BUCKET)
    assert (await approvals.get(key)).value == b"pending"
    await js.publish(
        subjects.notification_subject("acme", "w1"), b"{}", stream=subjects.NOTIFICATIONS_STREAM
    )
    await js.publish(subjects.event_subject(MessageDeadLettered, "echo"), b"{}")
    assert locked.errors["notifier"] == [] and locked.server_violations() == []
    limited = notifier.jetstream(timeout=REFUSED_S)
    with pytest.raises(NatsTimeout):
        await approvals.put(key, b"granted")
    await locked.wait_for_error("notifier", f'publish to "$kv.{subjects.APPROVALS_BUCKET}.')
    for subject in (
        subjects.event_subject(ApprovalGranted, "echo"),
        subjects.event_subject(CallAuthorized, "echo"),
        subjects.results_subject(*ACME, "call_1"),
        subjects.pending_subject(*ACME, "call_1"),
    ):
        with pytest.raises(NatsTimeout):
            await limited.publish(subject, b"{}")
        await locked.refused_publish("notifier", subject)


async def test_audit_reads_calls_and_events_and_publishes_nothing(locked: LockedBus) -> None:
    agent = (await locked.connect_agent(*ACME)).jetstream()
    await agent.publish(subjects.calls_subject(*ACME), b"{}", stream=subjects.CALLS_STREAM)
    audit = await locked.connect("audit")
    js = audit.jetstream()
    sub = await js.pull_subscribe(
        subjects.CALLS_FILTER,
        durable="audit",
        stream=subjects.CALLS_STREAM,
        config=consumers.consumer_config("audit", subjects.CALLS_FILTER),
    )
    [msg] = await sub.fetch(1, timeout=5)
    await msg.ack_sync()
    assert locked.errors["audit"] == []
    limited = audit.jetstream(timeout=REFUSED_S)
    for subject in (
        subjects.calls_subject(*ACME),
        subjects.event_subject(CallAuthorized, "echo"),
        subjects.results_subject(*ACME, "call_1"),
    ):
        with pytest.raises(NatsTimeout):
            await limited.publish(subject, b"{}")
        await locked.refused_publish("audit", subject)


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
    await admin.publish(subjects.calls_subject(*ACME), b"{}")
    await admin.publish(subjects.results_subject(*ACME, "c1"), b"{}")
    every = every_consumer()
    assert {role for role, *_ in every} == set(SERVICE_ROLES)
    for role, stream, durable, filter_subject in every:
        if stream == subjects.EVENTS_STREAM:
            await admin.publish(filter_subject.replace("*", "echo").replace(">", "X.echo"), b"{}")
        if stream == subjects.NOTIFICATIONS_STREAM:
            await admin.publish(subjects.notification_subject("acme", "w1"), b"{}")
        js = (await locked.connect(role)).jetstream()
        sub = await js.pull_subscribe(
            filter_subject,
            durable=durable,
            stream=stream,
            config=consumers.consumer_config(durable, filter_subject),
        )
        msgs = await sub.fetch(1, timeout=5)
        await msgs[0].ack_sync()
        assert locked.errors[role] == [], (role, durable)
    assert locked.server_violations() == []


# ---------------------------------------------------------------- the real services


async def test_the_pipeline_runs_with_each_service_on_its_own_credentials(
    locked: LockedBus, tmp_path: Path
) -> None:
    """The real services, in this process, each logged in as its own role, serve two
    agents; each agent gets its own results and reads back only its own."""
    from toolgate.services.approvals.app import build_app as approvals_app
    from toolgate.services.attacher.app import build_app as attacher_app
    from toolgate.services.executor.app import build_app as executor_app
    from toolgate.services.policy.app import build_app as policy_app
    from toolgate.services.validator.app import build_app as validator_app

    def settings(role: str) -> GatewaySettings:
        return GatewaySettings(
            nats_url=locked.url, data_dir=tmp_path / "data", nats_creds=locked.creds.path(role)
        )

    apps = [
        policy_app(settings("policy")),
        approvals_app(settings("approvals")),
        validator_app(settings("validator")),
        executor_app(settings("executor"), concurrency=2),
        attacher_app(settings("attacher")),
    ]
    started = []
    try:
        for app in apps:
            await app.start()
            started.append(app)
        acme = await GatewayClient.connect(
            locked.url, nats_auth.agent_creds_path(locked.data_dir, *ACME)
        )
        globex = await GatewayClient.connect(
            locked.url, nats_auth.agent_creds_path(locked.data_dir, *GLOBEX)
        )
        async with acme, globex:
            assert (acme.identity, globex.identity) == (ACME, GLOBEX)
            ok = await acme.call(
                "echo",
                {"payload": {"hello": "locked bus"}},
                user="u-alice",
                session="s-1",
                timeout=20,
            )
            assert ok.ok and ok.data == {"payload": {"hello": "locked bus"}}, ok
            bad = await acme.call("echo", {"nope": 1}, principal=ALICE, timeout=20)
            assert bad.status == "invalid_arguments", bad
            # The same call_id from another tenant's agent is its own call.
            theirs = await globex.call(
                "echo",
                {"payload": "globex"},
                user="u-g",
                session="s-g",
                call_id=ok.call_id,
                timeout=20,
            )
            assert theirs.ok and theirs.data == {"payload": "globex"}, theirs
            assert await acme.result(ok.call_id) == ok
            assert await globex.result(ok.call_id) == theirs
    finally:
        for app in reversed(started):
            await app.stop()
    assert locked.server_violations() == []
    admin = await locked.connect("admin")
    stored = [
        json.loads(
            (
                await admin.jetstream().get_last_msg(
                    subjects.RESULTS_STREAM, subjects.results_subject(*who, ok.call_id)
                )
            ).data
            or b"{}"
        )
        for who in (ACME, GLOBEX)
    ]
    assert [s["data"] for s in stored] == [ok.data, theirs.data]
