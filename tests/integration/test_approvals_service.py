"""The approvals service against a real nats-server, as real processes.

Each test publishes an ApprovalRequested onto the events stream (as the
policy would), reads and votes through the client the CLI and the inbox use
(requests to the service, with an approver token), and reads what the
service emitted from the events stream. The bus is open here; the same
requests on the locked bus, as the approver account, are in
tests/system/test_approval_flow.py.
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
    ALICE,
    ServiceProc,
    approval_requested,
    approvers,
    key_of,
    pending_notice,
    pending_notices,
    prepare_bus,
    publish_event,
    service_env,
    types_of,
    wait_for_events,
)
from tests.waiting import eventually, settled
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ErrorCode, Principal
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalGranted,
    Event,
    utc_now,
)
from toolgate.services.approvals import protocol
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient, Refused, ServiceUnavailable
from toolgate.services.approvals.logic import Approver, Ballot, Refusal, apply_vote, new_state
from toolgate.services.approvals.store import ApprovalStore
from toolgate.stack.nats_server import EmbeddedNats

ARGS = {
    "task_id": "task_c04",
    "claim": "Sessions store state.",
    "source_url": "https://example.org/sessions",
}
SHA = arguments_sha256(ARGS)
OTHER_ARGS = {**ARGS, "claim": "Another agent's claim."}
# Another agent of ALICE's tenant, and an agent of another tenant.
WRITER = Principal(tenant="acme", user="u-walt", agent="writer", session="s-9")
GLOBEX = Principal(tenant="globex", user="u-gina", agent="researcher", session="s-7")


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
async def client(url: str, tokens: dict[str, str]) -> AsyncIterator[ApprovalsClient]:
    """The approvals client, reading as bob (an approver of acme) unless told otherwise."""
    async with await ApprovalsClient.connect(url, token=tokens["bob"]) as c:
        yield c


@pytest.fixture
async def store(url: str) -> AsyncIterator[ApprovalStore]:
    """The bucket itself, as the service sees it (approvers never do)."""
    nc = await nats.connect(url)
    yield await ApprovalStore.open(nc.jetstream())
    await nc.close()


async def request(
    url: str,
    call_id: str,
    n: int = 1,
    ttl: timedelta = timedelta(minutes=15),
    principal: Principal = ALICE,
    arguments: dict | None = None,
) -> None:
    await publish_event(
        url, approval_requested(call_id, arguments or ARGS, n=n, ttl=ttl, principal=principal)
    )


async def stored(
    client: ApprovalsClient, call: str, timeout: float = 10.0, token: str | None = None
):  # type: ignore[no-untyped-def]
    """The approval of `call` (a key, or a call_id) once the service has stored it."""
    for _ in range(int(timeout * 20)):
        state = await client.get(call, token=token)
        if state is not None:
            return state
        await asyncio.sleep(0.05)
    raise TimeoutError(f"no approval state for {call}")


def granted(events: list[Event]) -> list[ApprovalGranted]:
    return [e for e in {e.event_id: e for e in events}.values() if isinstance(e, ApprovalGranted)]


async def test_a_request_is_stored_and_the_agent_told_it_waits(
    url: str, service: ServiceProc, client: ApprovalsClient
) -> None:
    await request(url, "call_wait", n=2)
    state = await stored(client, "acme.researcher.call_wait")
    assert state.status == "pending" and state.arguments_sha256 == SHA
    assert state.requester == "u-alice" and state.required_approvals == 2
    assert state.key == "acme.researcher.call_wait" == key_of("call_wait")
    assert (state.tenant, state.agent, state.call_id) == ("acme", "researcher", "call_wait")
    assert [s.key for s in await client.pending()] == ["acme.researcher.call_wait"]
    assert await client.get("call_wait") == state  # a bare call_id, unambiguous here
    notice = await pending_notice(url, "call_wait")
    assert notice is not None and notice.status == "approval_pending"
    assert notice.expires_at == state.expires_at.isoformat()


async def test_quorum_of_two_distinct_approvers_and_every_refusal(
    url: str, service: ServiceProc, client: ApprovalsClient, tokens: dict[str, str]
) -> None:
    await request(url, "call_q", n=2)
    await stored(client, "call_q")

    async def vote(who: str, sha: str = SHA, decision: str = "approve", token: str | None = None):  # type: ignore[no-untyped-def]
        return await client.vote(
            key_of("call_q"),
            decision,  # type: ignore[arg-type]
            arguments_sha256=sha,
            reason=f"checked by {who}",
            token=token or tokens[who],
        )

    assert (await vote("bob", token="tgap_forged")).code == Refusal.INVALID_TOKEN
    mismatch = await vote("bob", sha=arguments_sha256({**ARGS, "claim": "other"}))
    assert mismatch.code == Refusal.ARGUMENTS_MISMATCH and SHA in mismatch.message
    own = await vote("u-alice")
    assert own.code == Refusal.SELF_APPROVAL and "cannot approve" in own.message

    first = await vote("bob")
    assert first.accepted and not first.quorum_reached and first.approvers == ["bob"]
    assert first.call == "acme.researcher.call_q"
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
    url: str, service: ServiceProc, client: ApprovalsClient, tokens: dict[str, str]
) -> None:
    await request(url, "call_d", n=2)
    await stored(client, "call_d")
    assert (
        await client.vote(
            key_of("call_d"), "approve", arguments_sha256=SHA, reason="fine", token=tokens["bob"]
        )
    ).accepted
    denied = await client.vote(
        "call_d",
        "deny",
        arguments_sha256=SHA,  # a bare call_id
        reason="not this source",
        token=tokens["carol"],
    )
    assert denied.accepted and denied.status == "denied"
    late = await client.vote(
        key_of("call_d"), "approve", arguments_sha256=SHA, reason="ok", token=tokens["dave"]
    )
    assert late.code == Refusal.ALREADY_DECIDED
    events = await wait_for_events(
        url, "call_d", lambda es: any(isinstance(e, ApprovalDenied) for e in es)
    )
    [deny] = [e for e in events if isinstance(e, ApprovalDenied)]
    assert deny.approver == "carol" and deny.reason == "not this source"
    assert deny.status == "approval_denied" and deny.error.code == ErrorCode.APPROVAL_DENIED


async def test_an_unanswered_request_expires_once(
    url: str, service: ServiceProc, client: ApprovalsClient, tokens: dict[str, str]
) -> None:
    await request(url, "call_e", n=2, ttl=timedelta(seconds=2))
    await stored(client, "call_e")
    assert (
        await client.vote(
            key_of("call_e"), "approve", arguments_sha256=SHA, reason="fine", token=tokens["bob"]
        )
    ).accepted
    events = await wait_for_events(
        url, "call_e", lambda es: any(isinstance(e, ApprovalExpired) for e in es)
    )
    [expired] = [e for e in events if isinstance(e, ApprovalExpired)]
    assert expired.status == "approval_expired"
    assert expired.error.code == ErrorCode.APPROVAL_EXPIRED and "1 of 2" in expired.error.message
    late = await client.vote(
        key_of("call_e"), "approve", arguments_sha256=SHA, reason="late", token=tokens["carol"]
    )
    assert late.code == Refusal.ALREADY_DECIDED and late.status == "expired"
    await asyncio.sleep(1.0)  # several more sweeps
    assert (
        count_types(await wait_for_events(url, "call_e", lambda es: True))["ApprovalExpired"] == 1
    )


async def test_unknown_call_bad_requests_and_no_service(
    url: str,
    client: ApprovalsClient,
    tokens: dict[str, str],
    data_dir: Path,
    replicas: list[ServiceProc],
) -> None:
    with pytest.raises(ServiceUnavailable):
        await client.vote(
            key_of("call_none"),
            "approve",
            arguments_sha256=SHA,
            reason="x",
            token=tokens["bob"],
            timeout=0.5,
            attempts=1,
        )
    replicas.append(await replica(url, data_dir).start().ready())
    for call in (key_of("call_none"), "call_none"):
        missing = await client.vote(
            call, "approve", arguments_sha256=SHA, reason="x", token=tokens["bob"]
        )
        assert missing.code == Refusal.UNKNOWN_CALL and not missing.accepted
        assert await client.get(call) is None
    for not_a_call in ("acme.call_none", "acme.*.call_none", "acme.researcher.>", "a b"):
        reply = await client.show(not_a_call)
        assert not reply.ok and reply.code == Refusal.UNKNOWN_CALL
    # Every operation wants a valid token, before anything else.
    assert await client.whoami("tgap_forged") is None
    with pytest.raises(Refused) as refused:
        await client.pending(token="tgap_forged")
    assert refused.value.code == Refusal.INVALID_TOKEN
    assert (await client.show("call_none", token="tgap_forged")).code == Refusal.INVALID_TOKEN
    who = await client.whoami()
    assert who is not None and (who.name, who.tenants, who.all_tenants) == ("bob", ["acme"], False)
    nc = await nats.connect(url)
    try:
        reply = await nc.request(protocol.VOTE_SUBJECT, b"\xff not json", timeout=5)
        assert protocol.reply_decoder.decode(reply.data).code == Refusal.BAD_REQUEST
        reply = await nc.request(protocol.LIST_SUBJECT, b'{"call": 1}', timeout=5)
        assert protocol.list_reply_decoder.decode(reply.data).code == Refusal.BAD_REQUEST
        reply = await nc.request(f"{protocol.PREFIX}.read_bucket", b"{}", timeout=5)
        answer = protocol.whoami_reply_decoder.decode(reply.data)
        assert answer.code == Refusal.BAD_REQUEST and "no such operation" in answer.message
    finally:
        await nc.close()


async def test_a_retried_vote_is_counted_once(
    url: str, service: ServiceProc, client: ApprovalsClient, tokens: dict[str, str]
) -> None:
    await request(url, "call_r", n=2)
    await stored(client, "call_r")
    payload = protocol.encode(
        protocol.VoteRequest(
            call=key_of("call_r"),
            decision="approve",
            arguments_sha256=SHA,
            reason="ok",
            token=tokens["bob"],
            vote_id="vote_same",
        )
    )
    nc = await nats.connect(url)
    try:
        first = protocol.reply_decoder.decode(
            (await nc.request(protocol.VOTE_SUBJECT, payload, timeout=5)).data
        )
        again = protocol.reply_decoder.decode(
            (await nc.request(protocol.VOTE_SUBJECT, payload, timeout=5)).data
        )
    finally:
        await nc.close()
    assert first.accepted and not first.replayed
    assert again.accepted and again.replayed and again.approvers == ["bob"]
    state = await client.get(key_of("call_r"))
    assert state is not None and len(state.votes) == 1


async def test_state_survives_a_killed_service(
    url: str,
    data_dir: Path,
    replicas: list[ServiceProc],
    client: ApprovalsClient,
    tokens: dict[str, str],
) -> None:
    first = await replica(url, data_dir).start().ready()
    replicas.append(first)
    await request(url, "call_k", n=2)
    await stored(client, "call_k")
    assert (
        await client.vote(
            key_of("call_k"), "approve", arguments_sha256=SHA, reason="ok", token=tokens["bob"]
        )
    ).accepted
    first.kill()

    # The request redelivered to the new process must not reset the state.
    await publish_event(
        url,
        msgspec.structs.replace(
            approval_requested("call_k", ARGS, n=2), event_id="redelivered-copy"
        ),
    )
    second = await replica(url, data_dir, 1).start().ready()
    replicas.append(second)
    await eventually(
        lambda: settled(url, subjects.EVENTS_STREAM, "approvals"),
        what="the new process has handled the redelivered request",
    )
    state = await client.get(key_of("call_k"))
    assert state is not None and state.status == "pending" and state.approvers == ["bob"]
    assert (
        await client.vote(
            key_of("call_k"), "approve", arguments_sha256=SHA, reason="again", token=tokens["bob"]
        )
    ).code == Refusal.DUPLICATE_APPROVER
    done = await client.vote(
        key_of("call_k"), "approve", arguments_sha256=SHA, reason="ok", token=tokens["carol"]
    )
    assert done.accepted and done.quorum_reached
    events = await wait_for_events(url, "call_k", lambda es: len(granted(es)) == 2)
    assert [g.quorum_reached for g in granted(events)] == [False, True]


async def test_events_a_crash_left_unpublished_are_published_by_the_sweeper(
    url: str, service: ServiceProc, client: ApprovalsClient, store: ApprovalStore
) -> None:
    await request(url, "call_o", n=1)
    await stored(client, "call_o")
    found = await store.get(key_of("call_o"))
    assert found is not None
    state, revision = found
    # As if a replica wrote the vote to KV and died before publishing its event.
    voted, _ = apply_vote(
        state,
        Approver("bob", ("acme",)),
        Ballot(call_key=state.key, decision="approve", arguments_sha256=SHA, reason="ok"),
        utc_now(),
    )
    assert await store.update(voted, revision) is not None
    events = await wait_for_events(url, "call_o", lambda es: len(granted(es)) == 1)
    assert granted(events)[0].quorum_reached
    for _ in range(100):
        found = await store.get(key_of("call_o"))
        if found is not None and found[0].emitted == 1:
            break
        await asyncio.sleep(0.1)
    assert found is not None and found[0].emitted == 1


async def test_two_replicas_count_concurrent_votes_exactly(
    url: str,
    data_dir: Path,
    replicas: list[ServiceProc],
    client: ApprovalsClient,
    tokens: dict[str, str],
) -> None:
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
    outcomes = await asyncio.gather(
        *(
            client.vote(
                key_of(call_id),
                "approve",
                arguments_sha256=SHA,
                reason=f"{who} agrees",
                token=tokens[who],
            )
            for call_id in calls
            for who in voters
        )
    )
    for index, call_id in enumerate(calls):
        mine = outcomes[index * len(voters) : (index + 1) * len(voters)]
        assert sum(o.accepted for o in mine) == 3, mine
        assert {o.code for o in mine if not o.accepted} == {Refusal.ALREADY_DECIDED}
        events = await wait_for_events(url, call_id, lambda es: len(granted(es)) == 3)
        grants = granted(events)
        assert len({g.approver for g in grants}) == 3
        assert [g.quorum_reached for g in grants] == [False, False, True]
        assert len(grants[-1].approvers) == 3
    assert all("vote by" in proc.log() for proc in replicas)  # both took votes

    # Both replicas sweep; the request expires once.
    await wait_for_events(
        url, "call_2e", lambda es: any(isinstance(e, ApprovalExpired) for e in es)
    )
    await asyncio.sleep(1.0)
    stored_events = await wait_for_events(url, "call_2e", lambda es: True)
    assert types_of(stored_events).count("ApprovalExpired") == 1
    logs = "".join(p.log() for p in replicas)
    assert logs.count("approval of acme.researcher.call_2e expired") == 1


@pytest.mark.slow  # fourteen CLI processes, one after another
async def test_cli_lists_shows_and_votes(
    url: str, service: ServiceProc, data_dir: Path, tokens: dict[str, str], client: ApprovalsClient
) -> None:
    await request(url, "call_cli", n=1)
    await request(url, "call_cli", n=1, principal=WRITER, arguments=OTHER_ARGS)
    await stored(client, key_of("call_cli"))
    await stored(client, key_of("call_cli", WRITER))
    gus = add_approver(data_dir, "gus", ["globex"])

    def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
        env = service_env()
        env.pop("TOOLGATE_APPROVER_TOKEN", None)
        env.pop("TOOLGATE_NATS_CREDS", None)
        env["TOOLGATE_DATA_DIR"] = str(data_dir)  # no creds recorded there: an open bus
        if token:
            env["TOOLGATE_APPROVER_TOKEN"] = token
        command = [sys.executable, "-m", "toolgate.cli", "approvals", *args]
        if args[0] != "add-approver":
            command += ["--nats-url", url]
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)

    assert cli("list").returncode == 2  # no token
    listed = cli("list", token=tokens["bob"])
    assert listed.returncode == 0, listed.stderr
    for expected in (
        "acme.researcher.call_cli",
        "acme.writer.call_cli",
        "save_evidence",
        "risk=critical",
        SHA,
        "u-alice",
        '"claim": "Sessions store state."',
        "0 of 1",
    ):
        assert expected in listed.stdout
    assert "approver bob (tenants acme)" in listed.stderr
    assert "call_cli" not in cli("list", token=gus).stdout  # globex's approver sees nothing

    refused = cli("add-approver", "gina", "--data-dir", str(data_dir))
    assert refused.returncode == 2 and "--tenant" in refused.stderr
    added = cli("add-approver", "gina", "--tenant", "acme", "--data-dir", str(data_dir))
    assert added.returncode == 0 and added.stdout.startswith("tgap_"), added.stderr
    gina = added.stdout.strip()
    # With the token, the approver's own NATS creds: the CLI logs in with them.
    gina_creds = data_dir / "creds" / "approvers" / "gina.creds"
    assert str(gina_creds) in added.stderr and gina_creds.stat().st_mode & 0o777 == 0o600

    wrong = cli(
        "approve", "acme.researcher.call_cli", "--reason", "ok", "--approver", "bob", token=gina
    )
    assert wrong.returncode == 1 and "INVALID_TOKEN" in wrong.stderr
    ambiguous = cli("approve", "call_cli", "--reason", "ok", token=gina)
    assert ambiguous.returncode == 1 and "AMBIGUOUS_CALL" in ambiguous.stderr
    assert "acme.writer.call_cli" in ambiguous.stderr
    foreign = cli("approve", "acme.researcher.call_cli", "--reason", "ok", token=gus)
    assert foreign.returncode == 1 and "UNKNOWN_CALL" in foreign.stderr
    assert '"claim"' not in foreign.stdout + foreign.stderr
    bad_hash = cli(
        "approve", "acme.researcher.call_cli", "--reason", "ok", "--sha256", "0" * 64, token=gina
    )
    assert bad_hash.returncode == 1 and "ARGUMENTS_MISMATCH" in bad_hash.stderr
    ok = cli(
        "approve", "acme.researcher.call_cli", "--reason", "ok", "--approver", "gina", token=gina
    )
    assert ok.returncode == 0, ok.stderr
    assert SHA in ok.stdout and "quorum reached" in ok.stdout

    shown = cli("show", "acme.researcher.call_cli", token=tokens["bob"])
    assert shown.returncode == 0 and "[granted]" in shown.stdout and "gina" in shown.stdout
    hidden = cli("show", "acme.researcher.call_cli", token=gus)
    assert hidden.returncode == 1 and "UNKNOWN_CALL" in hidden.stderr
    still = cli("list", token=tokens["bob"]).stdout
    assert "acme.researcher.call_cli" not in still and "acme.writer.call_cli" in still
    events = await wait_for_events(
        url, "call_cli", lambda es: len(granted(es)) == 1, principal=ALICE
    )
    assert granted(events)[0].approver == "gina"
    writer_state = await client.get(key_of("call_cli", WRITER))
    assert writer_state is not None and writer_state.status == "pending"


async def test_store_lists_only_open_requests(url: str, store: ApprovalStore) -> None:
    assert await store.pending() == []
    open_state = new_state(approval_requested("call_open", ARGS))
    closed = msgspec.structs.replace(
        new_state(approval_requested("call_closed", ARGS)), status="denied"
    )
    await store.create(open_state)
    await store.create(closed)
    again, _ = await store.create(msgspec.structs.replace(open_state, required_approvals=9))
    assert again == open_state  # create never overwrites
    assert [s.key for s in await store.pending()] == ["acme.researcher.call_open"]
    assert await store.get("call_open") is None  # keyed by the call key, not the call_id
    acme, globex = Approver("bob", ("acme",)), Approver("gus", ("globex",))
    assert [s.key for s in await store.pending(acme)] == ["acme.researcher.call_open"]
    assert await store.pending(globex) == [] and await store.pending(Approver("x")) == []
    assert len(await store.pending(Approver("root", all_tenants=True))) == 1


async def test_an_approver_sees_and_decides_only_their_tenants_calls(
    url: str,
    service: ServiceProc,
    client: ApprovalsClient,
    data_dir: Path,
    tokens: dict[str, str],
    store: ApprovalStore,
) -> None:
    # The same call_id in two tenants; globex's call has other arguments.
    await request(url, "call_same", n=1)
    await request(url, "call_same", n=1, principal=GLOBEX, arguments=OTHER_ARGS)
    gus = add_approver(data_dir, "gus", ["globex"])
    root = add_approver(data_dir, "root", all_tenants=True)
    mine = await stored(client, key_of("call_same"))
    theirs = await stored(client, key_of("call_same", GLOBEX), token=gus)

    # Listing: each approver gets their own tenant's call; nothing of the other's.
    async with await ApprovalsClient.connect(url, token=gus) as as_gus:
        listed = await as_gus.list_pending()
        assert [v.key for v in listed.calls] == ["globex.researcher.call_same"]
        assert listed.approver is not None and listed.approver.tenants == ["globex"]
        assert "Sessions store state" not in msgspec.json.encode(listed).decode()
        assert [v.key for v in await client.pending()] == ["acme.researcher.call_same"]

        # Showing: acme's call is answered exactly as a call that does not exist.
        hidden = await as_gus.show(key_of("call_same"))
        absent = await as_gus.show(key_of("call_absent"))
        assert (hidden.ok, hidden.code, hidden.approval) == (False, Refusal.UNKNOWN_CALL, None)
        assert hidden.message.replace("call_same", "X") == absent.message.replace(
            "call_absent", "X"
        )
        assert "Sessions store state" not in hidden.message
        assert await as_gus.get("call_same") == theirs  # bare: only globex's is visible
        assert await client.get("call_same") == mine

        # Voting: refused as unknown, whatever the vote; acme's state is untouched.
        for decision in ("approve", "deny"):
            for call in (key_of("call_same"), "acme.researcher.call_same"):
                out = await as_gus.vote(
                    call,
                    decision,
                    arguments_sha256=SHA,  # type: ignore[arg-type]
                    reason="not mine to decide",
                )
                assert not out.accepted and out.code == Refusal.UNKNOWN_CALL
                assert out.approvers == [] and out.call == ""
        found = await store.get(key_of("call_same"))
        assert found is not None and found[0].votes == [] and found[0].status == "pending"
        # gus decides globex's own call by its bare call_id.
        out = await as_gus.vote(
            "call_same",
            "approve",
            arguments_sha256=arguments_sha256(OTHER_ARGS),
            reason="globex checked",
        )
        assert out.accepted and out.call == "globex.researcher.call_same"

    # An operator-wide approver (explicit --all-tenants) sees both; the bare id is ambiguous.
    async with await ApprovalsClient.connect(url, token=root) as as_root:
        who = await as_root.whoami()
        assert who is not None and who.all_tenants
        assert [v.key for v in await as_root.pending()] == ["acme.researcher.call_same"]
        refused = await as_root.show("call_same")
        assert refused.code == Refusal.AMBIGUOUS_CALL
        assert "acme.researcher.call_same" in refused.message
        assert "globex.researcher.call_same" in refused.message
        out = await as_root.vote("call_same", "deny", arguments_sha256=SHA, reason="which?")
        assert out.code == Refusal.AMBIGUOUS_CALL
    events = await wait_for_events(
        url, "call_same", lambda es: len(granted(es)) == 1, principal=GLOBEX
    )
    assert granted(events)[0].call.arguments == OTHER_ARGS
    acme_events = await wait_for_events(url, "call_same", lambda es: True, principal=ALICE)
    assert types_of(acme_events) == ["ApprovalRequested"]


async def test_the_same_call_id_of_two_agents_is_two_independent_approvals(
    url: str, service: ServiceProc, client: ApprovalsClient, tokens: dict[str, str]
) -> None:
    await request(url, "call_twin", n=1)
    await request(
        url, "call_twin", n=1, principal=WRITER, arguments=OTHER_ARGS, ttl=timedelta(minutes=30)
    )
    alice = await stored(client, key_of("call_twin"))
    walt = await stored(client, key_of("call_twin", WRITER))
    assert (alice.call.arguments, walt.call.arguments) == (ARGS, OTHER_ARGS)
    assert alice.arguments_sha256 != walt.arguments_sha256

    # Each agent is told it waits, on its own subject, about its own call.
    for principal, state in ((ALICE, alice), (WRITER, walt)):
        for _ in range(100):
            notices = await pending_notices(url, "call_twin", principal)
            if notices:
                break
            await asyncio.sleep(0.1)
        assert len(notices) == 1 and notices[0].expires_at == state.expires_at.isoformat()

    # Deciding one leaves the other as it was.
    out = await client.vote(
        key_of("call_twin"),
        "approve",
        arguments_sha256=SHA,
        reason="alice's claim checked",
        token=tokens["bob"],
    )
    assert out.accepted and out.quorum_reached and out.call == "acme.researcher.call_twin"
    wrong = await client.vote(
        key_of("call_twin", WRITER),
        "approve",
        arguments_sha256=SHA,
        reason="alice's hash on walt's call",
        token=tokens["carol"],
    )
    assert wrong.code == Refusal.ARGUMENTS_MISMATCH
    still = await client.get(key_of("call_twin", WRITER))
    assert still is not None and still.status == "pending" and still.votes == []
    denied = await client.vote(
        key_of("call_twin", WRITER),
        "deny",
        reason="not this claim",
        arguments_sha256=arguments_sha256(OTHER_ARGS),
        token=tokens["carol"],
    )
    assert denied.accepted and denied.status == "denied"

    mine = await wait_for_events(url, "call_twin", lambda es: len(es) == 2, principal=ALICE)
    other = await wait_for_events(url, "call_twin", lambda es: len(es) == 2, principal=WRITER)
    assert types_of(mine) == ["ApprovalRequested", "ApprovalGranted"]
    assert types_of(other) == ["ApprovalRequested", "ApprovalDenied"]
    assert mine[1].call.arguments == ARGS  # type: ignore[attr-defined]
    assert not {e.event_id for e in mine} & {e.event_id for e in other}
    assert (await client.get(key_of("call_twin"))).status == "granted"  # type: ignore[union-attr]
