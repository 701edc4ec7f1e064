"""Tenant isolation, attacked: a second tenant's agents against acme's, on a real gateway.

Every test logs in as globex (its agent `mallory`, or an agent of globex that
shares a name with acme's) with the identity `toolgate agents add` mints,
attacks acme's agent `researcher`, and checks two things: the attack got
nothing (the server refused it, or nothing was delivered, stored or run) and
acme's own calls still get their own, correct results.

Raw nats-py clients stand in for a hostile agent: it is not bound to use
GatewayClient, only to hold its creds file.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError

from tests.harness import REPO_ROOT, TEST_TOOLS_DIR, Gateway, events_of, flushed
from toolgate.client.gateway_client import GatewayClient, new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.contracts.events import CallAuthorized, Event, ExecutionStarted
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR
from toolgate.services.executor.tools.save_evidence import read_evidence
from toolgate.stack import nats_jwt

pytestmark = pytest.mark.system

ACME = ("acme", "researcher")
MALLORY = ("globex", "mallory")
# An agent of globex with the same name as acme's: allowed to run save_evidence.
GLOBEX_RESEARCHER = ("globex", "researcher")
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
GIVE_UP_S = 30.0  # bounded waits: only to give up, never a threshold under test
NO_ANSWER_S = 2.0  # how long a refused request is waited on before it counts as unanswered

_result_decoder = msgspec.json.Decoder(ToolResult)


# ---------------------------------------------------------------- the gateway


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """One gateway for the module: none of these attacks breaks it.

    Its registry is the built-in tools plus count_runs, all these tests use. (With
    conftest's full test registry the executor's user JWT is over 4 KB, above
    nats-server's default max_control_line of 4096: at commit 7c3223c the server
    refused the executor's CONNECT and that gateway never became ready.)
    """
    base = tmp_path_factory.mktemp("isolation")
    registry = base / "registry"
    registry.mkdir()
    for source in [*BUILTIN_TOOLS_DIR.glob("*.yaml"), TEST_TOOLS_DIR / "count_runs.yaml"]:
        shutil.copy(source, registry / source.name)
    gateway = Gateway(data_dir=base / "data", registry_dir=registry)
    try:
        gateway.start()
    except BaseException:
        gateway.stop()  # a failed start must not leave its processes behind
        raise
    yield gateway
    gateway.stop()


# ---------------------------------------------------------------- helpers


@dataclass
class RawAgent:
    """A plain nats-py client logged in with one agent's creds; server errors collected."""

    nc: Client
    errors: list[str] = field(default_factory=list)

    @classmethod
    async def connect(
        cls, gateway: Gateway, tenant: str, agent: str, creds: Path | None = None, **options: Any
    ) -> RawAgent:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc).lower())

        path = creds or await gateway.agent_creds(tenant, agent)
        nc = await nats.connect(
            gateway.url,
            user_credentials=str(path),
            error_cb=on_error,
            allow_reconnect=False,
            **options,
        )
        return cls(nc, errors)

    async def violation(self, operation: str, subject: str) -> str:
        """The server's "permissions violation for <operation> to <subject>", waited for."""
        wanted = f'permissions violation for {operation} to "{subject.lower()}"'
        await wait_for(lambda: any(wanted in e for e in self.errors), what=wanted)
        return next(e for e in self.errors if wanted in e)

    async def ask(self, subject: str, body: bytes = b"", **kwargs: Any) -> Msg | None:
        """A request's answer, or None if nobody answered (refused, or no responder)."""
        try:
            return await self.nc.request(subject, body, timeout=NO_ANSWER_S, **kwargs)
        except (NatsTimeout, NoRespondersError):
            return None

    async def close(self) -> None:
        if not self.nc.is_closed:
            await self.nc.close()


async def wait_for(
    predicate: Callable[[], bool] | Callable[[], Awaitable[bool]],
    what: str = "condition",
    timeout: float = GIVE_UP_S,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        answer = predicate()
        if not isinstance(answer, bool):
            answer = await answer
        if answer:
            return
        if loop.time() > deadline:
            raise AssertionError(f"gave up waiting for: {what}")
        await asyncio.sleep(0.05)


def collector(into: list[Msg]) -> Callable[[Msg], Awaitable[None]]:
    async def on_msg(msg: Msg) -> None:
        into.append(msg)

    return on_msg


def call_bytes(
    call_id: str,
    tool: str,
    arguments: dict[str, Any],
    tenant: str,
    agent: str,
    task_id: str | None = None,
) -> bytes:
    return msgspec.json.encode(
        ToolCall(
            call_id=call_id,
            tool=tool,
            arguments=arguments,
            task_id=task_id,
            principal=Principal(tenant=tenant, agent=agent, user="u-x", session="s-x"),
        )
    )


async def acme_echo(acme: GatewayClient, marker: str, call_id: str | None = None) -> ToolResult:
    """acme's own call works and returns acme's own payload, stored as delivered."""
    result = await acme.call("echo", {"payload": marker}, principal=ALICE, call_id=call_id)
    assert result.ok and result.status == "ok", result
    assert result.data == {"payload": marker}
    assert await stored_for(acme, result.call_id) == result
    return result


async def stored_for(client: GatewayClient, call_id: str) -> ToolResult | None:
    """The client's re-read of its stored result. A live result can arrive a moment before
    the stream has stored it, so a miss is retried (bounded) before it counts."""
    found: list[ToolResult] = []

    async def stored() -> bool:
        result = await client.result(call_id)
        if result is not None:
            found.append(result)
        return result is not None

    try:
        await wait_for(stored, what=f"the stored result of {call_id}", timeout=5.0)
    except AssertionError:
        return None
    return found[0]


def secret() -> str:
    return f"acme-secret-{uuid.uuid4().hex}"


async def stored_messages(gateway: Gateway, stream: str) -> list[tuple[int, str, bytes]]:
    """(seq, subject, data) of every message of `stream`, read as admin."""
    nc = await gateway.connect("admin")
    try:
        jsm = nc.jsm()
        info = await jsm.stream_info(stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await jsm.get_msg(stream, seq)
            except NotFoundError:
                continue
            found.append((seq, msg.subject or "", msg.data or b""))
        return found
    finally:
        await nc.close()


async def stored_result(gateway: Gateway, tenant: str, agent: str, call_id: str) -> bytes | None:
    nc = await gateway.connect("admin")
    try:
        msg = await nc.jetstream().get_last_msg(
            subjects.RESULTS_STREAM, subjects.results_subject(tenant, agent, call_id)
        )
        return msg.data
    except NotFoundError:
        return None
    finally:
        await nc.close()


async def settled(gateway: Gateway) -> None:
    """Every call and event published so far has been consumed and acked by every stage.

    Checked twice in a row, so that an event a stage emits just before acking its
    input is counted by the next stage too.
    """
    nc = await gateway.connect("admin")
    try:
        jsm = nc.jsm()

        async def idle() -> bool:
            for stream in (subjects.CALLS_STREAM, subjects.EVENTS_STREAM):
                for consumer in await jsm.consumers_info(stream):
                    if consumer.num_pending or consumer.num_ack_pending:
                        return False
            return True

        for _ in range(2):
            await wait_for(idle, what="every consumer caught up")
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


def started_by(events: list[Event], call_id: str, tenant: str, agent: str) -> int:
    unique = {e.event_id: e for e in events_of(events, call_id)}.values()
    return sum(
        1
        for e in unique
        if isinstance(e, ExecutionStarted)
        and e.principal
        and (e.principal.tenant, e.principal.agent) == (tenant, agent)
    )


def toolgate_cli(gateway: Gateway, *args: str) -> subprocess.CompletedProcess[str]:
    """`toolgate agents ...` as an operator runs it, against this gateway."""
    command = [
        sys.executable,
        "-m",
        "toolgate.cli.main",
        "agents",
        *args,
        "--data-dir",
        str(gateway.data_dir),
    ]
    if args[0] != "list":
        command += ["--nats-url", gateway.url]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=gateway.data_dir.parent,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def creds_claims(path: Path) -> dict[str, Any]:
    """The user JWT claims of a standard NATS creds file (user JWT + seed, mode 0600)."""
    assert path.is_file() and stat.S_IMODE(path.stat().st_mode) == 0o600, path
    text = path.read_text()
    assert "-----BEGIN NATS USER JWT-----" in text
    assert "-----BEGIN USER NKEY SEED-----" in text
    token, seed = nats_jwt.read_creds(text)
    claims = nats_jwt.decode_claims(token)
    assert seed.startswith("SU") and claims["sub"] == nats_jwt.public_key(seed)
    return claims


def is_file(path: Path) -> bool:
    return path.is_file()


def agents_line(listing: str, tenant: str, agent: str) -> str:
    lines = [line for line in listing.splitlines() if line.split()[:2] == [tenant, agent]]
    assert len(lines) == 1, listing
    return lines[0]


# ---------------------------------------------------------------- 1. reading acme's results


async def test_other_tenant_cannot_subscribe_to_acme_results(gw: Gateway) -> None:
    mallory = await RawAgent.connect(gw, *MALLORY)
    wide: list[Msg] = []
    own: list[Msg] = []
    try:
        for subject in (
            "toolgate.results.>",
            "toolgate.results.acme.>",
            "toolgate.results.acme.researcher.>",
            "toolgate.results.*.*.*",
            ">",
        ):
            await mallory.nc.subscribe(subject, cb=collector(wide))
            await mallory.violation("subscription", subject)
        await mallory.nc.subscribe(
            f"{subjects.agent_results_prefix(*MALLORY)}.>", cb=collector(own)
        )
        await flushed(mallory.nc)

        async with await gw.client(*ACME) as acme:
            secrets = [secret() for _ in range(3)]
            acme_results = [await acme_echo(acme, s) for s in secrets]
        # The listener works: mallory's own result reaches her own subscription.
        async with await gw.client(*MALLORY) as her_client:
            mine = await her_client.call(
                "echo", {"payload": "mallory's own"}, user="u-m", session="s-m"
            )
        assert mine.ok
        await wait_for(lambda: len(own) == 1, what="mallory's own result")
        await flushed(mallory.nc)  # anything the server routed to her before now has arrived
    finally:
        await mallory.close()

    assert [m.subject for m in own] == [subjects.results_subject(*MALLORY, mine.call_id)]
    assert wide == [], [(m.subject, m.data[:100]) for m in wide]
    assert all(s.encode() not in m.data for m in own for s in secrets)
    assert [r.data for r in acme_results] == [{"payload": s} for s in secrets]


async def test_other_tenant_cannot_read_stored_results_by_sequence_or_subject(gw: Gateway) -> None:
    async with await gw.client(*ACME) as acme:
        secrets = [secret() for _ in range(3)]
        acme_results = [await acme_echo(acme, s) for s in secrets]
    acme_subjects = {subjects.results_subject(*ACME, r.call_id) for r in acme_results}
    acme_seqs = [
        seq
        for seq, subject, _ in await stored_messages(gw, subjects.RESULTS_STREAM)
        if subject in acme_subjects
    ]
    assert len(acme_seqs) == 3
    async with await gw.client(*MALLORY) as her_client:
        mine = await her_client.call(
            "echo", {"payload": "mallory's own"}, user="u-m", session="s-m"
        )

    victim = subjects.results_subject(*ACME, acme_results[0].call_id)
    msg_get = f"$JS.API.STREAM.MSG.GET.{subjects.RESULTS_STREAM}"
    direct = subjects.direct_get_prefix(subjects.RESULTS_STREAM)
    own_prefix = f"{direct}.{subjects.agent_results_prefix(*MALLORY)}"
    mallory = await RawAgent.connect(gw, *MALLORY)
    try:
        refused = {
            # The stream-wide get, walking acme's sequences (and a few more).
            **{
                f"msg-get seq {seq}": (msg_get, json.dumps({"seq": seq}).encode())
                for seq in [*acme_seqs, 1, acme_seqs[-1] + 1]
            },
            "msg-get last_by_subj": (msg_get, json.dumps({"last_by_subj": victim}).encode()),
            # Direct gets outside her own prefix.
            "direct get of acme's subject": (f"{direct}.{victim}", b""),
            "direct get of acme's prefix": (f"{direct}.toolgate.results.acme.>", b""),
            "direct get by body": (direct, json.dumps({"last_by_subj": victim}).encode()),
            "direct get by seq": (direct, json.dumps({"seq": acme_seqs[0]}).encode()),
            "stream info": (f"$JS.API.STREAM.INFO.{subjects.RESULTS_STREAM}", b""),
        }
        answers = dict(
            zip(
                refused,
                await asyncio.gather(*(mallory.ask(s, b) for s, b in refused.values())),
                strict=True,
            )
        )
        for name, (subject, _) in refused.items():
            assert answers[name] is None, (name, answers[name])
            await mallory.violation("publish", subject)

        # Inside her own prefix the server answers, but only about her own subjects,
        # whatever the request body asks for.
        inside = {
            "own prefix, body asks acme's seq": (
                f"{own_prefix}.x",
                json.dumps({"seq": acme_seqs[0]}).encode(),
            ),
            "own prefix, body asks acme's subject": (
                f"{own_prefix}.x",
                json.dumps({"last_by_subj": victim}).encode(),
            ),
            "own prefix, body asks the next from seq 1": (
                f"{own_prefix}.x",
                json.dumps({"seq": 1, "next_by_subj": ">"}).encode(),
            ),
            "own prefix, wildcard": (f"{own_prefix}.>", b""),
            "own prefix, acme's subject as a suffix": (f"{own_prefix}.{victim}", b""),
        }
        inside_answers = dict(
            zip(
                inside,
                await asyncio.gather(*(mallory.ask(s, b) for s, b in inside.values())),
                strict=True,
            )
        )
        # The same read of her own stored result does answer (the path is live).
        own_answer = await mallory.ask(
            f"{direct}.{subjects.results_subject(*MALLORY, mine.call_id)}"
        )
    finally:
        await mallory.close()

    assert own_answer is not None and _result_decoder.decode(own_answer.data) == mine
    for name, answer in inside_answers.items():
        assert answer is not None, name  # answered (an error or her own), not silence
        headers = answer.headers or {}
        assert not str(headers.get("Nats-Subject", "")).startswith("toolgate.results.acme"), (
            name,
            headers,
        )
        assert all(s.encode() not in answer.data for s in secrets), (name, answer.data)
        if answer.data:  # a stored message: it can only be her own result
            assert _result_decoder.decode(answer.data) == mine, name
    # ...and acme still reads each of its own results.
    async with await gw.client(*ACME) as acme:
        assert [await acme.result(r.call_id) for r in acme_results] == acme_results


async def test_other_tenant_inbox_wildcard_sees_none_of_acme_replies(gw: Gateway) -> None:
    mallory = await RawAgent.connect(gw, *MALLORY)
    got: list[Msg] = []
    try:
        await mallory.nc.subscribe("_INBOX.>", cb=collector(got))
        await flushed(mallory.nc)
        assert mallory.errors == []  # her own account's inboxes: allowed
        async with await gw.client(*ACME) as acme:
            # Publish acks, direct gets and results all travel on acme's inboxes.
            secrets = [secret() for _ in range(3)]
            acme_results = [await acme_echo(acme, s) for s in secrets]
            await acme.result("call_never_made")
        await flushed(mallory.nc)
        seen_during_acme = list(got)

        # The listener works: her own client's replies do arrive on it.
        async with await gw.client(*MALLORY) as her_client:
            mine = await her_client.call(
                "echo", {"payload": "mallory's own"}, user="u-m", session="s-m"
            )
        await wait_for(lambda: len(got) > len(seen_during_acme), what="mallory's own reply")
    finally:
        await mallory.close()

    assert seen_during_acme == [], [(m.subject, m.data[:100]) for m in seen_during_acme]
    assert all(s.encode() not in m.data for m in got for s in secrets)
    assert mine.ok and all(r.ok for r in acme_results)


# ---------------------------------------------------------------- 2. calling as acme


async def test_other_tenant_cannot_publish_on_acme_calls_subject(gw: Gateway) -> None:
    marker = secret().replace("acme-secret", "forged-by-mallory")
    call_id = new_call_id()
    forged = call_bytes(call_id, "echo", {"payload": marker}, *ACME)
    acme_subject = subjects.calls_subject(*ACME)
    mallory = await RawAgent.connect(gw, *MALLORY)
    try:
        with pytest.raises((NatsTimeout, NoRespondersError)):  # no publish ack
            await mallory.nc.jetstream().publish(acme_subject, forged, timeout=NO_ANSWER_S)
        await mallory.violation("publish", acme_subject)
        await mallory.nc.publish(acme_subject, forged)  # a plain publish, no ack asked
        for other in (
            "toolgate.calls.acme.researcher.x",
            "toolgate.calls.acme.*",
            "toolgate.calls.>",
            subjects.event_subject(CallAuthorized, "echo"),
        ):
            await mallory.nc.publish(other, forged)
            await mallory.violation("publish", other)
        await flushed(mallory.nc)
    finally:
        await mallory.close()

    async with await gw.client(*ACME) as acme:
        await acme_echo(acme, secret())
    await settled(gw)
    calls = await stored_messages(gw, subjects.CALLS_STREAM)
    assert [c for c in calls if marker.encode() in c[2]] == []
    assert events_of(await gw.events(), call_id) == []
    assert await stored_result(gw, *ACME, call_id) is None


@pytest.mark.parametrize(
    "claimed", [("acme", "researcher"), ("acme", "mallory"), ("globex", "researcher")]
)
async def test_payload_naming_another_principal_is_denied_to_its_sender(
    gw: Gateway, claimed: tuple[str, str]
) -> None:
    tenant, agent = claimed
    task = f"task_{uuid.uuid4().hex[:12]}"
    call_id = new_call_id()
    forged_claim = f"forged by mallory as {tenant}.{agent}"
    async with await gw.client(*MALLORY) as mallory:
        result = await mallory.call(
            "save_evidence",
            {"task_id": task, "claim": forged_claim, "source_url": "https://evil.example"},
            principal=Principal(tenant=tenant, user="u-alice", agent=agent, session="s-1"),
            task_id=task,
            call_id=call_id,
        )
        assert await stored_for(mallory, call_id) == result  # stored under her own subject
    assert result.status == "denied" and not result.ok, result
    assert result.error is not None and result.error.code == "PRINCIPAL_MISMATCH"

    # Nothing was written, for acme or anyone.
    evidence_root = gw.data_dir / "tools" / "save_evidence"
    for owner in ("acme", "globex"):
        assert read_evidence(evidence_root, owner, task) == []
    assert await stored_result(gw, tenant, agent, call_id) is None
    await settled(gw)
    events = events_of(await gw.events(), call_id)
    assert [type(e).__name__ for e in events] == ["ArgumentsRejected", "ResultAttached"]
    assert all(
        e.principal is not None and (e.principal.tenant, e.principal.agent) == MALLORY
        for e in events
    )

    # acme's own evidence goes where it belongs.
    async with await gw.client(*ACME) as acme:
        saved = await acme.call(
            "save_evidence",
            {"task_id": task, "claim": "acme's claim", "source_url": "https://acme.example"},
            principal=ALICE,
            task_id=task,
        )
    assert saved.ok and saved.data["stored"] is True and saved.data["duplicate"] is False
    assert [row["claim"] for row in read_evidence(evidence_root, "acme", task)] == ["acme's claim"]


# ---------------------------------------------------------------- 3. call_id pre-emption


async def test_call_id_pre_empted_by_another_tenant_still_runs_acme_call(gw: Gateway) -> None:
    call_id = new_call_id()
    mallory = await RawAgent.connect(gw, *MALLORY)
    try:
        # Mallory first, with acme's future call_id, also as the stream's dedupe key.
        ack = await mallory.nc.jetstream().publish(
            subjects.calls_subject(*MALLORY),
            call_bytes(call_id, "echo", {"payload": "mallory's"}, *MALLORY),
            headers={"Nats-Msg-Id": call_id},
        )
        assert not ack.duplicate
        async with await gw.client(*ACME) as acme:
            first = await acme_echo(acme, "acme's", call_id=call_id)

            async def hers_stored() -> bool:
                return await stored_result(gw, *MALLORY, call_id) is not None

            await wait_for(hers_stored, what="mallory's first result")
            async with await gw.client(*MALLORY) as her_client:
                # Hers is hers: a retry by her gets her first result, not acme's.
                hers = await her_client.call(
                    "echo", {"payload": "mallory's"}, user="u-m", session="s-m", call_id=call_id
                )
                assert hers.data == {"payload": "mallory's"}
                assert await her_client.result(call_id) == hers
                # Another call of hers under it is refused, and given neither result.
                other = await her_client.call(
                    "echo", {"payload": "mallory again"}, user="u-m", session="s-m", call_id=call_id
                )
                assert other.error is not None and other.error.code == "CALL_ID_REUSED"
            # A later call by acme with the finished call_id is a retry: the first result.
            retry = await acme.call("echo", {"payload": "acme's"}, principal=ALICE, call_id=call_id)
            assert retry == first
            await settled(gw)
            assert await acme.result(call_id) == first
    finally:
        await mallory.close()

    events = await gw.events()
    assert started_by(events, call_id, *ACME) == 1
    assert started_by(events, call_id, *MALLORY) == 1
    assert _result_decoder.decode(await stored_result(gw, *ACME, call_id) or b"") == first


async def test_evidence_with_a_shared_call_id_is_kept_per_tenant_and_stored_once(
    gw: Gateway,
) -> None:
    """globex's researcher and acme's researcher, same task name, same call_id."""
    call_id = new_call_id()
    task = f"task_{uuid.uuid4().hex[:12]}"
    principal_g = Principal(tenant="globex", user="u-g", agent="researcher", session="s-g")

    def evidence(claim: str) -> dict[str, Any]:
        return {"task_id": task, "claim": claim, "source_url": "https://example.org"}

    async with await gw.client(*GLOBEX_RESEARCHER) as globex:
        theirs = await globex.call(
            "save_evidence",
            evidence("globex's claim"),
            principal=principal_g,
            task_id=task,
            call_id=call_id,
        )
    assert theirs.ok and theirs.data["duplicate"] is False, theirs
    async with await gw.client(*ACME) as acme:
        first = await acme.call(
            "save_evidence",
            evidence("acme's claim"),
            principal=ALICE,
            task_id=task,
            call_id=call_id,
        )
        assert first.ok and first.data["stored"] is True, first
        assert first.data["duplicate"] is False  # globex's row is not in acme's store
        retry = await acme.call(
            "save_evidence",
            evidence("acme's claim"),
            principal=ALICE,
            task_id=task,
            call_id=call_id,
        )
        assert retry == first
    async with await gw.client(*GLOBEX_RESEARCHER) as globex:
        again = await globex.call(
            "save_evidence",
            evidence("globex's claim"),
            principal=principal_g,
            task_id=task,
            call_id=call_id,
        )
    assert again == theirs
    await settled(gw)

    root = gw.data_dir / "tools" / "save_evidence"
    assert [(r["call_id"], r["claim"]) for r in read_evidence(root, "acme", task)] == [
        (call_id, "acme's claim")
    ]
    assert [(r["call_id"], r["claim"]) for r in read_evidence(root, "globex", task)] == [
        (call_id, "globex's claim")
    ]
    events = await gw.events()
    assert started_by(events, call_id, *ACME) == 1
    assert started_by(events, call_id, *GLOBEX_RESEARCHER) == 1
    async with await gw.client(*ACME) as acme:
        assert await acme.result(call_id) == first


async def test_victim_setting_nats_msg_id_is_not_pre_empted(gw: Gateway) -> None:
    mallory = await RawAgent.connect(gw, *MALLORY)
    acme = await RawAgent.connect(gw, *ACME)
    try:
        # The window is short: try a few times; acme's call must never be dropped.
        for _ in range(5):
            call_id = new_call_id()
            await mallory.nc.jetstream().publish(
                subjects.calls_subject(*MALLORY),
                call_bytes(call_id, "echo", {"payload": "mallory's"}, *MALLORY),
                headers={"Nats-Msg-Id": call_id},
            )
            ack = await acme.nc.jetstream().publish(
                subjects.calls_subject(*ACME),
                call_bytes(call_id, "echo", {"payload": "acme's"}, *ACME),
                headers={"Nats-Msg-Id": call_id},
            )
            assert not ack.duplicate, f"acme's call {call_id} was dropped as a duplicate"

            async def answered(cid: str = call_id) -> bool:
                return await stored_result(gw, *ACME, cid) is not None

            await wait_for(answered, what="acme's result")
            stored = _result_decoder.decode(await stored_result(gw, *ACME, call_id) or b"")
            assert stored.data == {"payload": "acme's"}
    finally:
        await mallory.close()
        await acme.close()


async def test_same_call_id_from_another_agent_of_acme_does_not_swallow_evidence(
    gw: Gateway,
) -> None:
    call_id = new_call_id()
    task = f"task_{uuid.uuid4().hex[:12]}"
    writer = Principal(tenant="acme", user="u-alice", agent="writer", session="s-1")

    def evidence(claim: str) -> dict[str, Any]:
        return {"task_id": task, "claim": claim, "source_url": "https://example.org"}

    async with await gw.client("acme", "writer") as client:
        theirs = await client.call(
            "save_evidence",
            evidence("writer's claim"),
            principal=writer,
            task_id=task,
            call_id=call_id,
        )
    assert theirs.ok, theirs
    async with await gw.client(*ACME) as acme:
        mine = await acme.call(
            "save_evidence",
            evidence("researcher's claim"),
            principal=ALICE,
            task_id=task,
            call_id=call_id,
        )
    assert mine.ok, mine
    claims = [
        r["claim"] for r in read_evidence(gw.data_dir / "tools" / "save_evidence", "acme", task)
    ]
    assert "researcher's claim" in claims, (mine.data, claims)
    assert mine.data["duplicate"] is False


# ---------------------------------------------------------------- 4. reply-subject injection


async def _kv_state(gateway: Gateway, bucket: str) -> dict[str, int]:
    """key -> revision of every key in `bucket`, read as admin."""
    nc = await gateway.connect("admin")
    try:
        kv = await nc.jetstream().key_value(bucket)
        try:
            keys = await kv.keys()
        except NoKeysError:
            return {}
        return {key: (await kv.get(key)).revision or 0 for key in keys}
    finally:
        await nc.close()


async def _kv_has(gateway: Gateway, bucket: str, key: str) -> bool:
    nc = await gateway.connect("admin")
    try:
        kv = await nc.jetstream().key_value(bucket)
        try:
            await kv.get(key)
            return True
        except KeyNotFoundError:
            return False
    finally:
        await nc.close()


def _authorized_version(events: list[Event], call_id: str) -> str:
    [authorized] = [e for e in events_of(events, call_id) if isinstance(e, CallAuthorized)]
    return authorized.policy_version


@pytest.fixture
async def acme_listener(gw: Gateway) -> AsyncIterator[tuple[RawAgent, list[Msg]]]:
    """A live subscription of acme's to everything under its own results prefix."""
    listener = await RawAgent.connect(gw, *ACME)
    heard: list[Msg] = []
    await listener.nc.subscribe(f"{subjects.agent_results_prefix(*ACME)}.>", cb=collector(heard))
    await flushed(listener.nc)
    yield listener, heard
    await listener.close()


async def test_reply_subjects_injected_by_another_tenant_land_nowhere(
    gw: Gateway, acme_listener: tuple[RawAgent, list[Msg]]
) -> None:
    listener, heard = acme_listener
    target = new_call_id()  # acme's next call_id
    acme_prefix = subjects.agent_results_prefix(*ACME)
    results = subjects.RESULTS_STREAM
    replies = [
        subjects.results_subject(*ACME, target),
        subjects.pending_subject(*ACME, target),
        f"$KV.{subjects.OUTCOMES_BUCKET}.x",
        f"$KV.{subjects.OUTCOMES_BUCKET}.{subjects.call_key(*ACME, target)}",
        f"$KV.{subjects.CALL_IDS_BUCKET}.{subjects.call_key(*ACME, target)}",
        f"$KV.{subjects.POLICIES_BUCKET}.active",
        f"$KV.{subjects.POLICY_ACCEPTED_BUCKET}.bundle",
        f"$JS.API.STREAM.MSG.DELETE.{results}",
        f"$JS.API.STREAM.PURGE.{results}",
        f"{subjects.EVENTS_PREFIX}.CallAuthorized.echo",
    ]
    async with await gw.client(*ACME) as acme:
        before_call = await acme_echo(acme, secret())
    await settled(gw)
    version_before = _authorized_version(await gw.events(), before_call.call_id)
    results_before = await _stream_state(gw, results)
    kv_before = {
        b: await _kv_state(gw, b)
        for b in (
            subjects.POLICIES_BUCKET,
            subjects.POLICY_ACCEPTED_BUCKET,
            subjects.OUTCOMES_BUCKET,
            subjects.CALL_IDS_BUCKET,
        )
    }

    mallory = await RawAgent.connect(gw, *MALLORY)
    mine: list[Msg] = []
    injected: list[str] = []
    try:
        await mallory.nc.subscribe(
            f"{subjects.agent_results_prefix(*MALLORY)}.>", cb=collector(mine)
        )
        for reply in replies:
            call_id = new_call_id()
            injected.append(call_id)
            # Her own call, published with a reply subject of her choosing: the
            # server's publish ack goes there.
            await mallory.nc.publish(
                subjects.calls_subject(*MALLORY),
                call_bytes(call_id, "echo", {"payload": reply}, *MALLORY),
                reply=reply,
            )
        await wait_for(lambda: len(mine) >= len(injected), what="mallory's results")
        # A direct get of her own result, answered to the same subjects.
        own = (
            subjects.direct_get_prefix(results)
            + "."
            + subjects.results_subject(*MALLORY, injected[0])
        )
        for reply in replies:
            await mallory.nc.publish(own, b"", reply=reply)
        await flushed(mallory.nc)
    finally:
        await mallory.close()
    assert sorted(m.subject for m in mine) == sorted(
        subjects.results_subject(*MALLORY, c) for c in injected
    )

    async with await gw.client(*ACME) as acme:
        # acme's call with the targeted call_id is acme's, stored as acme's.
        first = await acme_echo(acme, "acme's target call", call_id=target)
        # A policy decision still works, under the same bundle.
        after_call = await acme_echo(acme, secret())
        denied = await acme.call(
            "save_evidence",
            {"task_id": "task_other", "claim": "x", "source_url": "https://example.org"},
            principal=ALICE,
            task_id="task_mine",
        )
    assert denied.status == "denied" and denied.error is not None
    assert denied.error.code == "TASK_SCOPE_VIOLATION"
    await settled(gw)
    assert _authorized_version(await gw.events(), after_call.call_id) == version_before
    await flushed(listener.nc)  # whatever the server routed to acme has arrived

    # acme heard only its own well-formed results, one per call.
    acme_calls = {before_call.call_id, first.call_id, after_call.call_id, denied.call_id}
    for msg in heard:
        result = _result_decoder.decode(msg.data)  # raises on a publish ack or anything else
        assert msg.subject == subjects.results_subject(*ACME, result.call_id), msg.subject
        assert result.call_id in acme_calls
    assert sorted(m.subject for m in heard) == sorted(
        subjects.results_subject(*ACME, c) for c in acme_calls
    )
    # Nothing landed under acme's prefix but its results; nothing was deleted.
    stored = await stored_messages(gw, results)
    for _, subject, data in stored:
        if subject.startswith(acme_prefix + "."):
            result = _result_decoder.decode(data)
            assert subject == subjects.results_subject(*ACME, result.call_id)
    assert _result_decoder.decode(await stored_result(gw, *ACME, target) or b"") == first
    assert await stored_result(gw, *ACME, f"{target}.{subjects.PENDING_SUFFIX}") is None
    results_after = await _stream_state(gw, results)
    assert results_after["first_seq"] == results_before["first_seq"]
    assert results_after["num_deleted"] == results_before["num_deleted"] == 0
    assert results_after["messages"] == results_before["messages"] + len(injected) + 3
    # No bucket holds anything of hers: policies untouched, no stray keys.
    assert await _kv_state(gw, subjects.POLICIES_BUCKET) == kv_before[subjects.POLICIES_BUCKET]
    accepted = subjects.POLICY_ACCEPTED_BUCKET
    assert await _kv_state(gw, accepted) == kv_before[accepted]
    assert not await _kv_has(gw, subjects.OUTCOMES_BUCKET, "x")
    for bucket in (subjects.OUTCOMES_BUCKET, subjects.CALL_IDS_BUCKET):
        new_keys = set(await _kv_state(gw, bucket)) - set(kv_before[bucket])
        allowed = {subjects.call_key(*MALLORY, c) for c in injected} | {
            subjects.call_key(*ACME, c) for c in acme_calls
        }
        assert new_keys <= allowed, (bucket, new_keys - allowed)


async def _stream_state(gateway: Gateway, stream: str) -> dict[str, int]:
    nc = await gateway.connect("admin")
    try:
        state = (await nc.jsm().stream_info(stream)).state
        return {
            "first_seq": state.first_seq,
            "last_seq": state.last_seq,
            "messages": state.messages,
            "num_deleted": state.num_deleted or 0,
        }
    finally:
        await nc.close()


# ---------------------------------------------------------------- 5. revocation


async def test_revoked_agent_is_cut_off_and_refused_and_acme_keeps_working(
    gw: Gateway, tmp_path: Path
) -> None:
    added = toolgate_cli(gw, "add", *MALLORY)
    assert added.returncode == 0, added.stderr
    creds = Path(added.stdout.splitlines()[0])
    claims = creds_claims(creds)
    assert subjects.calls_subject(*MALLORY) in claims["nats"]["pub"]["allow"]
    assert "tenant:globex" in claims["nats"]["tags"]
    assert agents_line(toolgate_cli(gw, "list").stdout, *MALLORY).split()[2] == "active"
    copy = tmp_path / "stolen.creds"
    shutil.copy(creds, copy)

    disconnected, closed = asyncio.Event(), asyncio.Event()

    async def on_disconnect() -> None:
        disconnected.set()

    async def on_closed() -> None:
        closed.set()

    live = await RawAgent.connect(
        gw, *MALLORY, creds=copy, disconnected_cb=on_disconnect, closed_cb=on_closed
    )
    try:
        # The live connection works before the revocation.
        got: list[Msg] = []
        await live.nc.subscribe(f"{subjects.agent_results_prefix(*MALLORY)}.>", cb=collector(got))
        call_id = new_call_id()
        await live.nc.jetstream().publish(
            subjects.calls_subject(*MALLORY),
            call_bytes(call_id, "echo", {"payload": "before"}, *MALLORY),
        )
        await wait_for(lambda: len(got) == 1, what="mallory's result before revocation")

        revoked = toolgate_cli(gw, "revoke", *MALLORY)
        assert revoked.returncode == 0, (revoked.stdout, revoked.stderr)
        await asyncio.wait_for(closed.wait(), GIVE_UP_S)
        assert disconnected.is_set() and live.nc.is_closed
    finally:
        await live.close()
    assert not is_file(creds)

    with pytest.raises(nats.errors.Error, match="(?i)authorization"):
        await nats.connect(
            gw.url,
            user_credentials=str(copy),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=NO_ANSWER_S,
        )
    assert "revoked" in agents_line(toolgate_cli(gw, "list").stdout, *MALLORY)
    async with await gw.client(*ACME) as acme:
        await acme_echo(acme, secret())


async def test_revoked_creds_stay_refused_after_the_agent_is_added_again(
    gw: Gateway, tmp_path: Path
) -> None:
    added = toolgate_cli(gw, "add", *MALLORY)
    assert added.returncode == 0, added.stderr
    leaked = tmp_path / "leaked.creds"
    shutil.copy(Path(added.stdout.splitlines()[0]), leaked)
    assert toolgate_cli(gw, "revoke", *MALLORY).returncode == 0
    reissued = toolgate_cli(gw, "add", *MALLORY)
    assert reissued.returncode == 0, reissued.stderr
    assert creds_claims(Path(reissued.stdout.splitlines()[0]))["sub"] != creds_claims(leaked)["sub"]

    connected: Client | None = None
    try:
        connected = await nats.connect(
            gw.url,
            user_credentials=str(leaked),
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=NO_ANSWER_S,
        )
    except nats.errors.Error:
        pass
    finally:
        if connected is not None:
            await connected.close()
    assert connected is None, "the revoked creds connected again after a re-add"


# ---------------------------------------------------------------- 6. a nesting bomb


@pytest.mark.parametrize("shape", ["lists", "objects", "call_id_last"])
async def test_deeply_nested_payload_gets_an_invalid_arguments_result(
    gw: Gateway, shape: str
) -> None:
    depth = 1000
    call_id = new_call_id()
    if shape == "objects":
        bomb = '{"a":' * depth + "1" + "}" * depth
    else:
        bomb = "[" * depth + "]" * depth
    principal = json.dumps(
        {"tenant": MALLORY[0], "agent": MALLORY[1], "user": "u-m", "session": "s-m"}
    )
    arguments = '{"payload": ' + bomb + "}"
    if shape == "call_id_last":  # only a scan of the raw bytes can find the call_id
        raw = (
            f'{{"tool": "echo", "arguments": {arguments}, "principal": {principal}, '
            f'"call_id": "{call_id}"}}'
        )
    else:
        raw = (
            f'{{"call_id": "{call_id}", "tool": "echo", "arguments": {arguments}, '
            f'"principal": {principal}}}'
        )
    assert 2000 <= len(raw) <= 8000

    mallory = await RawAgent.connect(gw, *MALLORY)
    got: list[Msg] = []
    try:
        await mallory.nc.subscribe(subjects.results_subject(*MALLORY, call_id), cb=collector(got))
        ack = await mallory.nc.jetstream().publish(subjects.calls_subject(*MALLORY), raw.encode())
        assert ack.stream == subjects.CALLS_STREAM
        await wait_for(lambda: len(got) == 1, what="a result for the nested call")
    finally:
        await mallory.close()
    result = _result_decoder.decode(got[0].data)
    assert result.call_id == call_id
    assert result.status == "invalid_arguments" and not result.ok, result
    assert result.error is not None and result.error.code == "NESTING_TOO_DEEP"
    assert result.error.retryable is False
    assert gw.all_alive()
    async with await gw.client(*ACME) as acme:
        await acme_echo(acme, secret())
