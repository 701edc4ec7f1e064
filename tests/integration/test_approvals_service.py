"""The approvals service against a real nats-server, as real processes.

Each test publishes an ApprovalRequested onto the events stream (as the
policy would), votes through the client the CLI and the inbox use, and reads
what the service emitted from the events stream.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import nats
import pytest

from tests.harness import count_types
from tests.integration.test_approvals_support import (
    ServiceProc,
    approval_requested,
    approvers,
    pending_notice,
    prepare_bus,
    publish_event,
    service_env,
    types_of,
    wait_for_events,
)
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ErrorCode
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalGranted,
    Event,
    utc_now,
)
from toolgate.services.approvals import protocol
from toolgate.services.approvals.client import ApprovalsClient, ServiceUnavailable
from toolgate.services.approvals.logic import Approver, Ballot, Refusal, apply_vote, new_state
from toolgate.services.approvals.store import ApprovalStore
from toolgate.services.stack.nats_server import EmbeddedNats

ARGS = {"task_id": "task_c04", "claim": "Sessions store state.",
        "source_url": "https://example.org/sessions"}
SHA = arguments_sha256(ARGS)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


@pytest.fixture
def tokens(data_dir: Path) -> dict[str, str]:
    return approvers(data_dir, "bob", "carol", "dave", "erin", "frank", "u-alice")


@pytest.fixture
async def url(nats_server: EmbeddedNats) -> str:
    await prepare_bus(nats_server.url)
    return nats_server.url


def replica(url: str, data_dir: Path, index: int = 0) -> ServiceProc:
    return ServiceProc(url, data_dir, data_dir / "logs" / f"approvals-{index}.log")


@pytest.fixture
def replicas(url: str, data_dir: Path, tokens: dict[str, str]) -> Iterator[list[ServiceProc]]:
    """Started replicas, stopped at the end (append more as a test needs)."""
    started: list[ServiceProc] = []
    yield started
    for proc in started:
        proc.stop()


@pytest.fixture
async def service(url: str, data_dir: Path, replicas: list[ServiceProc]) -> ServiceProc:
    proc = await replica(url, data_dir).start().ready()
    replicas.append(proc)
    return proc


@pytest.fixture
async def client(url: str) -> AsyncIterator[ApprovalsClient]:
    async with await ApprovalsClient.connect(url) as c:
        yield c


async def request(url: str, call_id: str, n: int = 1,
                  ttl: timedelta = timedelta(minutes=15)) -> None:
    await publish_event(url, approval_requested(call_id, ARGS, n=n, ttl=ttl))


async def stored(client: ApprovalsClient, call_id: str, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    for _ in range(int(timeout * 20)):
        state = await client.get(call_id)
        if state is not None:
            return state
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no approval state for {call_id}")


def granted(events: list[Event]) -> list[ApprovalGranted]:
    return [e for e in {e.event_id: e for e in events}.values() if isinstance(e, ApprovalGranted)]


async def test_a_request_is_stored_and_the_agent_told_it_waits(
        url: str, service: ServiceProc, client: ApprovalsClient) -> None:
    await request(url, "call_wait", n=2)
    state = await stored(client, "call_wait")
    assert state.status == "pending" and state.arguments_sha256 == SHA
    assert state.requester == "u-alice" and state.required_approvals == 2
    assert [s.call_id for s in await client.pending()] == ["call_wait"]
    notice = await pending_notice(url, "call_wait")
    assert notice is not None and notice.status == "approval_pending"
    assert notice.expires_at == state.expires_at.isoformat()


async def test_quorum_of_two_distinct_approvers_and_every_refusal(
        url: str, service: ServiceProc, client: ApprovalsClient,
        tokens: dict[str, str]) -> None:
    await request(url, "call_q", n=2)
    await stored(client, "call_q")

    async def vote(who: str, sha: str = SHA, decision: str = "approve",
                   token: str | None = None):  # type: ignore[no-untyped-def]
        return await client.vote("call_q", decision, arguments_sha256=sha,  # type: ignore[arg-type]
                                 reason=f"checked by {who}", token=token or tokens[who])

    assert (await vote("bob", token="tgap_forged")).code == Refusal.INVALID_TOKEN
    mismatch = await vote("bob", sha=arguments_sha256({**ARGS, "claim": "other"}))
    assert mismatch.code == Refusal.ARGUMENTS_MISMATCH and SHA in mismatch.message
    own = await vote("u-alice")
    assert own.code == Refusal.SELF_APPROVAL and "cannot approve" in own.message

    first = await vote("bob")
    assert first.accepted and not first.quorum_reached and first.approvers == ["bob"]
    assert (await vote("bob")).code == Refusal.DUPLICATE_APPROVER
    second = await vote("carol")
    assert second.accepted and second.quorum_reached and second.status == "granted"
    assert (await vote("dave")).code == Refusal.ALREADY_DECIDED
    assert (await vote("dave", decision="deny")).code == Refusal.ALREADY_DECIDED

    events = await wait_for_events(url, "call_q", lambda es: len(granted(es)) == 2)
    await asyncio.sleep(0.5)  # nothing more may follow
    events = [e for e in await wait_for_events(url, "call_q", lambda es: True)]
    assert types_of(events) == ["ApprovalRequested", "ApprovalGranted", "ApprovalGranted"]
    one, two = granted(events)
    assert (one.approver, one.quorum_reached) == ("bob", False)
    assert (two.approver, two.quorum_reached, two.approvers) == ("carol", True, ["bob", "carol"])
    assert two.arguments_sha256 == SHA and two.call.arguments == ARGS
    assert two.policy_version == "test-policy-1" and two.service == "approvals"
    assert await client.pending() == []


async def test_a_deny_ends_it_with_approval_denied(
        url: str, service: ServiceProc, client: ApprovalsClient,
        tokens: dict[str, str]) -> None:
    await request(url, "call_d", n=2)
    await stored(client, "call_d")
    assert (await client.vote("call_d", "approve", arguments_sha256=SHA, reason="fine",
                              token=tokens["bob"])).accepted
    denied = await client.vote("call_d", "deny", arguments_sha256=SHA,
                               reason="not this source", token=tokens["carol"])
    assert denied.accepted and denied.status == "denied"
    late = await client.vote("call_d", "approve", arguments_sha256=SHA, reason="ok",
                             token=tokens["dave"])
    assert late.code == Refusal.ALREADY_DECIDED
    events = await wait_for_events(
        url, "call_d", lambda es: any(isinstance(e, ApprovalDenied) for e in es))
    [deny] = [e for e in events if isinstance(e, ApprovalDenied)]
    assert deny.approver == "carol" and deny.reason == "not this source"
    assert deny.status == "approval_denied" and deny.error.code == ErrorCode.APPROVAL_DENIED


async def test_an_unanswered_request_expires_once(
        url: str, service: ServiceProc, client: ApprovalsClient,
        tokens: dict[str, str]) -> None:
    await request(url, "call_e", n=2, ttl=timedelta(seconds=2))
    await stored(client, "call_e")
    assert (await client.vote("call_e", "approve", arguments_sha256=SHA, reason="fine",
                              token=tokens["bob"])).accepted
    events = await wait_for_events(
        url, "call_e", lambda es: any(isinstance(e, ApprovalExpired) for e in es))
    [expired] = [e for e in events if isinstance(e, ApprovalExpired)]
    assert expired.status == "approval_expired"
    assert expired.error.code == ErrorCode.APPROVAL_EXPIRED and "1 of 2" in expired.error.message
    late = await client.vote("call_e", "approve", arguments_sha256=SHA, reason="late",
                             token=tokens["carol"])
    assert late.code == Refusal.ALREADY_DECIDED and late.status == "expired"
    await asyncio.sleep(1.0)  # several more sweeps
    assert count_types(await wait_for_events(url, "call_e", lambda es: True))[
        "ApprovalExpired"] == 1


async def test_unknown_call_and_no_service(url: str, client: ApprovalsClient,
                                           tokens: dict[str, str], data_dir: Path,
                                           replicas: list[ServiceProc]) -> None:
    with pytest.raises(ServiceUnavailable):
        await client.vote("call_none", "approve", arguments_sha256=SHA, reason="x",
                          token=tokens["bob"], timeout=0.5, attempts=1)
    replicas.append(await replica(url, data_dir).start().ready())
    missing = await client.vote("call_none", "approve", arguments_sha256=SHA, reason="x",
                                token=tokens["bob"])
    assert missing.code == Refusal.UNKNOWN_CALL
    nc = await nats.connect(url)
    try:
        reply = await nc.request(protocol.VOTE_SUBJECT, b"\xff not json", timeout=5)
        assert protocol.reply_decoder.decode(reply.data).code == Refusal.BAD_REQUEST
    finally:
        await nc.close()


async def test_a_retried_vote_is_counted_once(
        url: str, service: ServiceProc, client: ApprovalsClient,
        tokens: dict[str, str]) -> None:
    await request(url, "call_r", n=2)
    await stored(client, "call_r")
    payload = protocol.encode(protocol.VoteRequest(
        call_id="call_r", decision="approve", arguments_sha256=SHA, reason="ok",
        token=tokens["bob"], vote_id="vote_same"))
    nc = await nats.connect(url)
    try:
        first = protocol.reply_decoder.decode((await nc.request(
            protocol.VOTE_SUBJECT, payload, timeout=5)).data)
        again = protocol.reply_decoder.decode((await nc.request(
            protocol.VOTE_SUBJECT, payload, timeout=5)).data)
    finally:
        await nc.close()
    assert first.accepted and not first.replayed
    assert again.accepted and again.replayed and again.approvers == ["bob"]
    state = await client.get("call_r")
    assert state is not None and len(state.votes) == 1


async def test_state_survives_a_killed_service(
        url: str, data_dir: Path, replicas: list[ServiceProc], client: ApprovalsClient,
        tokens: dict[str, str]) -> None:
    first = await replica(url, data_dir).start().ready()
    replicas.append(first)
    await request(url, "call_k", n=2)
    await stored(client, "call_k")
    assert (await client.vote("call_k", "approve", arguments_sha256=SHA, reason="ok",
                              token=tokens["bob"])).accepted
    first.kill()

    # The request redelivered to the new process must not reset the state.
    await publish_event(url, msgspec.structs.replace(
        approval_requested("call_k", ARGS, n=2), event_id="redelivered-copy"))
    second = await replica(url, data_dir, 1).start().ready()
    replicas.append(second)
    await asyncio.sleep(1.0)
    state = await client.get("call_k")
    assert state is not None and state.status == "pending" and state.approvers == ["bob"]
    assert (await client.vote("call_k", "approve", arguments_sha256=SHA, reason="again",
                              token=tokens["bob"])).code == Refusal.DUPLICATE_APPROVER
    done = await client.vote("call_k", "approve", arguments_sha256=SHA, reason="ok",
                             token=tokens["carol"])
    assert done.accepted and done.quorum_reached
    events = await wait_for_events(url, "call_k", lambda es: len(granted(es)) == 2)
    assert [g.quorum_reached for g in granted(events)] == [False, True]


async def test_events_a_crash_left_unpublished_are_published_by_the_sweeper(
        url: str, service: ServiceProc, client: ApprovalsClient) -> None:
    await request(url, "call_o", n=1)
    state = await stored(client, "call_o")
    # As if a replica wrote the vote to KV and died before publishing its event.
    voted, _ = apply_vote(state, Approver("bob"), Ballot(
        call_id="call_o", decision="approve", arguments_sha256=SHA, reason="ok"), utc_now())
    found = await client.store.get("call_o")
    assert found is not None
    assert await client.store.update(voted, found[1]) is not None
    events = await wait_for_events(url, "call_o", lambda es: len(granted(es)) == 1)
    assert granted(events)[0].quorum_reached
    assert (await client.get("call_o")).emitted == 1  # type: ignore[union-attr]


async def test_two_replicas_count_concurrent_votes_exactly(
        url: str, data_dir: Path, replicas: list[ServiceProc], client: ApprovalsClient,
        tokens: dict[str, str]) -> None:
    for index in range(2):
        replicas.append(replica(url, data_dir, index).start())
    for proc in replicas:
        await proc.ready()
    calls = [f"call_2r{i}" for i in range(3)]
    for call_id in calls:
        await request(url, call_id, n=3)
    await request(url, "call_2e", n=1, ttl=timedelta(seconds=2))
    for call_id in [*calls, "call_2e"]:
        await stored(client, call_id)

    # 15 votes at once, spread over both replicas by the queue group: each call
    # takes exactly 3 distinct approvers, the other 2 are refused.
    voters = ["bob", "carol", "dave", "erin", "frank"]
    outcomes = await asyncio.gather(*(
        client.vote(call_id, "approve", arguments_sha256=SHA, reason=f"{who} agrees",
                    token=tokens[who]) for call_id in calls for who in voters))
    for index, call_id in enumerate(calls):
        mine = outcomes[index * len(voters):(index + 1) * len(voters)]
        assert sum(o.accepted for o in mine) == 3, mine
        assert {o.code for o in mine if not o.accepted} == {Refusal.ALREADY_DECIDED}
        events = await wait_for_events(url, call_id, lambda es: len(granted(es)) == 3)
        grants = granted(events)
        assert len({g.approver for g in grants}) == 3
        assert [g.quorum_reached for g in grants] == [False, False, True]
        assert len(grants[-1].approvers) == 3
    assert all("vote by" in proc.log() for proc in replicas)  # both took votes

    # Both replicas sweep; the request expires once.
    await wait_for_events(url, "call_2e",
                          lambda es: any(isinstance(e, ApprovalExpired) for e in es))
    await asyncio.sleep(1.0)
    stored_events = await wait_for_events(url, "call_2e", lambda es: True)
    assert types_of(stored_events).count("ApprovalExpired") == 1
    logs = "".join(p.log() for p in replicas)
    assert logs.count("approval of call_2e expired") == 1


async def test_cli_lists_shows_and_votes(
        url: str, service: ServiceProc, data_dir: Path, tokens: dict[str, str],
        client: ApprovalsClient) -> None:
    await request(url, "call_cli", n=1)
    await stored(client, "call_cli")

    def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = service_env()
        env.pop("TOOLGATE_APPROVER_TOKEN", None)
        if token:
            env["TOOLGATE_APPROVER_TOKEN"] = token
        return subprocess.run(
            [sys.executable, "-m", "toolgate.services.approvals", *args, "--nats-url", url,
             "--data-dir", str(data_dir)],
            capture_output=True, text=True, env=env, timeout=60)

    listed = cli("list")
    assert listed.returncode == 0, listed.stderr
    for expected in ("call_cli", "save_evidence", "risk=critical", SHA, "u-alice",
                     '"claim": "Sessions store state."', "0 of 1"):
        assert expected in listed.stdout
    added = cli("add-approver", "gina")
    assert added.returncode == 0 and added.stdout.startswith("tgap_")
    gina = added.stdout.strip()

    wrong = cli("approve", "call_cli", "--reason", "ok", "--approver", "bob", token=gina)
    assert wrong.returncode == 1 and "INVALID_TOKEN" in wrong.stderr
    bad_hash = cli("approve", "call_cli", "--reason", "ok", "--sha256", "0" * 64, token=gina)
    assert bad_hash.returncode == 1 and "ARGUMENTS_MISMATCH" in bad_hash.stderr
    ok = cli("approve", "call_cli", "--reason", "ok", "--approver", "gina", token=gina)
    assert ok.returncode == 0, ok.stderr
    assert SHA in ok.stdout and "quorum reached" in ok.stdout

    shown = cli("show", "call_cli")
    assert shown.returncode == 0 and "[granted]" in shown.stdout and "gina" in shown.stdout
    assert "no calls are waiting" in cli("list").stdout
    events = await wait_for_events(url, "call_cli", lambda es: len(granted(es)) == 1)
    assert granted(events)[0].approver == "gina"


async def test_store_lists_only_open_requests(url: str, client: ApprovalsClient) -> None:
    store: ApprovalStore = client.store
    assert await store.pending() == []
    open_state = new_state(approval_requested("call_open", ARGS))
    closed = msgspec.structs.replace(new_state(approval_requested("call_closed", ARGS)),
                                     status="denied")
    await store.create(open_state)
    await store.create(closed)
    again, _ = await store.create(msgspec.structs.replace(open_state, required_approvals=9))
    assert again == open_state  # create never overwrites
    assert [s.call_id for s in await store.pending()] == ["call_open"]
