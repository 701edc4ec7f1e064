"""Approval notifications end to end: a whole gateway (locked bus, audit in the embedded
ClickHouse) started with webhooks, and real HTTP receivers on free loopback ports that
record every request. One receiver per tenant (from the per-tenant file, each with a
secret of its own) and one for every tenant (`--approval-webhook`, the default secret).

What is checked: a call that starts waiting is POSTed, signed, with its fields; its
decision follows; a reminder and the expiry come for a call nobody decides; a receiver
that refuses connections, answers 500 or hangs slows no decision and no other tenant,
and gets its notifications, under one idempotency key per notification, once it
answers; a receiver that refuses a notification for good gets a dead letter (in the
audit too); one tenant's receiver never sees another's calls; no secret is logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import Gateway, make_test_registry, publish_event, read_events
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.contracts.events import ApprovalRequested, MessageDeadLettered, call_fields
from toolgate.runtime.creds import connect_options
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.services.approvals.protocol import ApprovalView
from toolgate.services.notifier.logic import webhook_id

pytestmark = pytest.mark.system

INBOX = "https://inbox.example.test:8443"
DESCRIPTION = "A side effect that needs one human approval. Test only."


@dataclass
class Received:
    headers: dict[str, str]
    body: bytes
    answered: int | None = None
    at: float = field(default_factory=time.time)  # when it came (for figures, not tests)

    @property
    def json(self) -> dict[str, Any]:
        found: dict[str, Any] = json.loads(self.body)
        return found


@dataclass
class Receiver:
    """An HTTP server on a free loopback port that records what it is sent. `answers`:
    the statuses of its first requests (then 200); `hanging`: holds every request
    unanswered until released; not `listening`: the port is bound and refuses
    connections until `listen()`."""

    answers: list[int] = field(default_factory=list)
    hanging: bool = False
    listening: bool = True
    secret: bytes = field(default_factory=lambda: uuid.uuid4().hex.encode())
    requests: list[Received] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen = Received(dict(self.headers.items()), body)
                with receiver.lock:
                    receiver.requests.append(seen)
                    status = receiver.answers.pop(0) if receiver.answers else 200
                if receiver.hanging:
                    receiver.released.wait(600)
                seen.answered = status
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler, bind_and_activate=False)
        self.server.daemon_threads = True
        self.server.socket.close()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        self.server.socket = sock
        self.server.server_address = sock.getsockname()
        self.port = sock.getsockname()[1]
        # The path is a secret, as in a Slack webhook URL: it must never be logged.
        self.path = f"/hooks/{uuid.uuid4().hex}"
        if self.listening:
            self.listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def listen(self) -> None:
        self.server.server_activate()
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.listening = True

    def stop(self) -> None:
        self.released.set()
        if self.listening:
            self.server.shutdown()
        self.server.server_close()

    def of(self, call: str, event: str | None = None) -> list[Received]:
        with self.lock:
            return [
                r
                for r in self.requests
                if r.json.get("call") == call and (event is None or r.json["event"] == event)
            ]

    def delivered(self, call: str, event: str) -> list[Received]:
        return [r for r in self.of(call, event) if r.answered is not None and r.answered < 300]

    def calls(self) -> set[str]:
        with self.lock:
            return {r.json["call"] for r in self.requests}


def verified(request: Received, secret: bytes) -> dict[str, Any]:
    """docs/approvals.md's check: the signature is the HMAC-SHA256 of the raw body."""
    expected = "sha256=" + hmac.new(secret, request.body, hashlib.sha256).hexdigest()
    assert hmac.compare_digest(request.headers["X-Toolgate-Signature"], expected)
    body = request.json
    assert abs(time.time() - body["timestamp"]) < 600  # a replay window a receiver can check
    assert request.headers["Idempotency-Key"] == body["idempotency_key"]
    return body


async def until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.1)


@dataclass
class Setup:
    gateway: Gateway
    receivers: dict[str, Receiver]  # per tenant
    everyone: Receiver  # --approval-webhook: every tenant's calls


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("notify")
    receivers = {
        "acme": Receiver(),
        "globex": Receiver(),
        "initech": Receiver(listening=False),
        "umbrella": Receiver(answers=[500, 500, 503]),
        "hooli": Receiver(hanging=True),
        "refusing": Receiver(answers=[410] * 50),
        "stark": Receiver(listening=False),
    }
    everyone = Receiver()
    (base / "everyone.secret").write_bytes(everyone.secret + b"\n")
    entries = []
    for tenant, receiver in receivers.items():
        (base / f"{tenant}.secret").write_bytes(receiver.secret)
        entries.append(
            {"url": receiver.url, "tenants": [tenant], "secret_file": f"{tenant}.secret"}
        )
    config = base / "approval-webhooks.yaml"
    config.write_text(yaml.safe_dump({"webhooks": entries}))
    gateway = Gateway(
        data_dir=base / "data",
        registry_dir=make_test_registry(base / "registry"),
        with_audit=True,
        with_notifier=True,
        with_http=True,  # the notifier's /metrics
        options={
            "approval_webhooks": [everyone.url],
            "approval_webhook_secret_file": base / "everyone.secret",
            "approval_webhooks_file": config,
            "inbox_url": INBOX,
            "notifier_args": ["--retry-base", "0.2", "--give-up-after", "120"],
        },
    )
    gateway.start()
    try:
        yield Setup(gateway, receivers, everyone)
    finally:
        gateway.stop()
        for receiver in [*receivers.values(), everyone]:
            receiver.stop()


def principal(tenant: str, user: str = "u-bob") -> Principal:
    return Principal(tenant=tenant, user=user, agent="researcher", session="s-1")


def action(who: Principal, amount: int = 10) -> ToolCall:
    return ToolCall(
        call_id=new_call_id(), tool="approved_action", arguments={"amount": amount}, principal=who
    )


def key_of(call: ToolCall) -> str:
    p = call.principal
    return subjects.call_key(p.tenant, p.agent, call.call_id)


async def approvals_for(gateway: Gateway, tenant: str) -> tuple[ApprovalsClient, str]:
    name = f"carol-{uuid.uuid4().hex[:6]}"
    token = add_approver(gateway.data_dir, name, [tenant])
    client = await ApprovalsClient.connect(
        gateway.url, token=token, **connect_options(gateway.stack.creds_of("inbox"))
    )
    return client, name


async def waiting(approvals: ApprovalsClient, key: str) -> ApprovalView:
    async def found() -> ApprovalView | None:
        return await approvals.get(key)

    for _ in range(300):
        state = await found()
        if state is not None:
            return state
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no approval request for {key}")


def notifier_metrics(gateway: Gateway) -> str:
    url = next(s.http_url for s in gateway.stack.services if s.name == "notifier")
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---------------------------------------------------------------- the tests


async def test_waiting_then_decided_are_posted_signed_to_the_tenants_webhooks(
    setup: Setup,
) -> None:
    gateway, acme = setup.gateway, setup.receivers["acme"]
    # The user is the platform's word: outside text, shown escaped in `text`.
    call = action(principal("acme", "u-bob<!channel>\u202e"))
    key = key_of(call)
    approvals, carol = await approvals_for(gateway, "acme")
    async with await gateway.client("acme") as client, approvals:
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(approvals, key)
        posted = await until(lambda: acme.delivered(key, "waiting"), "no waiting notification")
        body = verified(posted[0], acme.secret)
        assert body["type"] == "toolgate.approval.waiting"
        assert (body["call"], body["tenant"], body["agent"], body["call_id"]) == (
            key,
            "acme",
            "researcher",
            call.call_id,
        )
        assert body["user"] == "u-bob<!channel>\u202e"  # the JSON field as it is
        assert body["tool"] == "approved_action" and body["tool_description"] == DESCRIPTION
        assert body["risk"] == "high" and body["rule"] and body["why"]
        assert body["arguments_sha256"] == arguments_sha256(call.arguments)
        assert body["expires_at"] == state.expires_at.isoformat().replace("+00:00", "Z")
        assert body["url"] == f"{INBOX}/calls/{key}"
        assert body["status"] == "pending" and body["decision"] is None
        text = body["text"]
        assert key in text and f"<{INBOX}/calls/{key}|" in text
        assert "&lt;!channel&gt;" in text and "\\u202e" in text
        assert "<!channel>" not in text and "\u202e" not in text

        granted = await approvals.vote(
            key, "approve", arguments_sha256=state.arguments_sha256, reason="checked <b>"
        )
        assert granted.accepted and granted.quorum_reached
        result: ToolResult = await submitted
    assert result.ok, result
    posted = await until(lambda: acme.delivered(key, "decided"), "no decided notification")
    decided = verified(posted[0], acme.secret)
    assert decided["status"] == "granted" and decided["decision"] == "approved"
    assert decided["decided_by"] == [carol] and decided["decision_reason"] == "checked <b>"
    assert decided["rule"] == body["rule"] and decided["expires_at"] == body["expires_at"]
    assert [v["approver"] for v in decided["votes"]] == [carol]
    assert decided["idempotency_key"] != body["idempotency_key"]
    assert "Approved by" in decided["text"] and "checked &lt;b&gt;" in decided["text"]

    # The every-tenant webhook heard both, under its own secret and keys.
    for event in ("waiting", "decided"):
        seen = await until(lambda e=event: setup.everyone.delivered(key, e), f"everyone {event}")
        other = verified(seen[0], setup.everyone.secret)
        assert (
            other["idempotency_key"] != (body if event == "waiting" else decided)["idempotency_key"]
        )
    # Another tenant's webhook never hears of it.
    assert key not in setup.receivers["globex"].calls()


async def test_a_call_nobody_decides_gets_a_reminder_then_its_expiry(setup: Setup) -> None:
    """A request with a short time to live, published as the policy service would."""
    gateway, acme = setup.gateway, setup.receivers["acme"]
    call = action(principal("acme"))
    key = key_of(call)
    now = datetime.now(UTC)
    request = ApprovalRequested(
        event_id=uuid.uuid4().hex,
        occurred_at=now,
        service="policy",
        call=call,
        policy_version="test",
        policy_ids=["approve-high-risk"],
        risk="high",
        expires_at=now + timedelta(seconds=6),
        reason="high-risk tools need a human",
        **{**call_fields(call), "arguments_sha256": arguments_sha256(call.arguments)},
    )
    await publish_event(gateway.url, request, **gateway.admin)
    first = (await until(lambda: acme.delivered(key, "waiting"), "no waiting"))[0]
    reminded = (await until(lambda: acme.delivered(key, "reminder"), "no reminder"))[0]
    body = verified(reminded, acme.secret)
    assert body["status"] == "pending" and body["why"] == "high-risk tools need a human"
    assert body["idempotency_key"] != first.json["idempotency_key"]
    assert "Still waiting" in body["text"]
    expired = (await until(lambda: acme.delivered(key, "expired"), "no expiry", 90))[0]
    body = verified(expired, acme.secret)
    assert body["status"] == "expired" and body["decision"] is None
    assert body["rule"] == "approve-high-risk" and "did not run" in body["text"]
    # Each notification went to acme's webhook once: the receiver answered each at once.
    assert sorted(r.json["event"] for r in acme.of(key)) == ["expired", "reminder", "waiting"]


async def test_a_receiver_refusing_connections_slows_nothing_and_gets_it_once_back(
    setup: Setup,
) -> None:
    gateway, down = setup.gateway, setup.receivers["initech"]
    call = action(principal("initech"))
    key = key_of(call)
    approvals, _ = await approvals_for(gateway, "initech")
    async with await gateway.client("initech") as client, approvals:
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(approvals, key)
        # The notifier is trying, and failing, to reach it ...
        failing = webhook_id(down.url)
        await until(
            lambda: metric(
                notifier_metrics(gateway),
                "toolgate_notification_failures_total",
                webhook=failing,
                reason="connect",
            ),  # fmt: skip
            "no failed attempt counted",
        )
        # ... while the decision goes through: the call runs and ends.
        vote = await approvals.vote(
            key, "approve", arguments_sha256=state.arguments_sha256, reason="fine"
        )
        result = await submitted
    assert vote.accepted and result.ok, result
    assert down.requests == []  # not one notification got through before the result
    text = notifier_metrics(gateway)
    assert metric(text, "toolgate_notification_retries_total", webhook=failing) >= 1
    down.listen()
    for event in ("waiting", "decided"):
        got = await until(lambda e=event: down.delivered(key, e), f"{event} never arrived")
        verified(got[0], down.secret)


async def test_a_failing_receiver_gets_the_same_idempotency_key_on_every_retry(
    setup: Setup,
) -> None:
    gateway, flaky = setup.gateway, setup.receivers["umbrella"]
    call = action(principal("umbrella"))
    key = key_of(call)
    approvals, dave = await approvals_for(gateway, "umbrella")
    async with await gateway.client("umbrella") as client, approvals:
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(approvals, key)
        await until(lambda: flaky.delivered(key, "waiting"), "never delivered")
        tries = flaky.of(key, "waiting")
        assert [r.answered for r in tries] == [500, 500, 503, 200]
        keys = {verified(r, flaky.secret)["idempotency_key"] for r in tries}
        assert len(keys) == 1 and keys == {r.headers["Idempotency-Key"] for r in tries}
        await approvals.vote(
            key, "deny", arguments_sha256=state.arguments_sha256, reason="not today"
        )
        result = await submitted
    assert result.status == "approval_denied"
    decided = verified(
        (await until(lambda: flaky.delivered(key, "decided"), "no decided"))[0], flaky.secret
    )
    assert decided["decision"] == "denied" and decided["decided_by"] == [dave]
    assert decided["decision_reason"] == "not today"
    webhook = webhook_id(flaky.url)
    text = notifier_metrics(gateway)
    assert metric(text, "toolgate_notification_retries_total", webhook=webhook) >= 3
    assert metric(text, "toolgate_notifications_delivered_total", webhook=webhook) >= 2


async def test_a_hanging_receiver_delays_neither_the_decision_nor_another_tenant(
    setup: Setup,
) -> None:
    gateway, hung, globex = setup.gateway, setup.receivers["hooli"], setup.receivers["globex"]
    call = action(principal("hooli"))
    key = key_of(call)
    other = action(principal("globex"))
    approvals, _ = await approvals_for(gateway, "hooli")
    async with (
        await gateway.client("hooli") as client,
        await gateway.client("globex") as globex_client,
        approvals,
    ):
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        state = await waiting(approvals, key)
        await until(lambda: hung.of(key, "waiting"), "the hanging receiver was never asked")
        vote = await approvals.vote(
            key, "approve", arguments_sha256=state.arguments_sha256, reason="fine"
        )
        result = await submitted
        assert vote.accepted and result.ok, result
        # Another tenant's call, meanwhile: its webhook hears of it.
        other_task = asyncio.create_task(globex_client.submit(other, timeout=120))
        await until(lambda: globex.delivered(key_of(other), "waiting"), "globex not told")
        assert all(r.answered is None for r in hung.requests)  # still hanging, all of them
        other_task.cancel()
    hung.released.set()
    for event in ("waiting", "decided"):
        got = await until(lambda e=event: hung.delivered(key, e), f"{event} never arrived", 120)
        verified(got[0], hung.secret)
    assert key_of(other) not in hung.calls() and key not in globex.calls()


async def test_a_receiver_that_refuses_a_notification_gets_a_dead_letter(setup: Setup) -> None:
    gateway, refusing = setup.gateway, setup.receivers["refusing"]
    call = action(principal("refusing"))
    key = key_of(call)
    async with await gateway.client("refusing") as client:
        submitted = asyncio.create_task(client.submit(call, timeout=120))

        async def letters() -> list[MessageDeadLettered]:
            return [
                e
                for e in await read_events(gateway.url, **gateway.admin)
                if isinstance(e, MessageDeadLettered)
                and e.service == "notifier"
                and e.call_id == call.call_id
            ]

        found: list[MessageDeadLettered] = []
        for _ in range(300):
            found = await letters()
            if found:
                break
            await asyncio.sleep(0.2)
        submitted.cancel()
    assert found, "no dead letter"
    letter = found[0]
    assert letter.principal is not None and letter.principal.tenant == "refusing"
    assert "waiting notification of " + key in letter.reason and "HTTP 410" in letter.reason
    assert webhook_id(refusing.url) in letter.reason and refusing.path not in letter.reason
    assert [r.answered for r in refusing.of(key, "waiting")] == [410]  # not retried
    client_ch = gateway.audit_client()
    for _ in range(300):
        rows = client_ch.query(
            "SELECT count() FROM events WHERE event_type = 'MessageDeadLettered' "
            "AND service = 'notifier' AND call_id = {c:String}",
            parameters={"c": call.call_id},
        ).result_rows
        if rows[0][0]:
            break
        await asyncio.sleep(0.2)
    assert rows[0][0] == 1


async def test_a_notification_not_yet_delivered_survives_the_notifier_being_killed(
    setup: Setup,
) -> None:
    """At least once: the delivery stays un-acked in its stream while the receiver is
    down, so a notifier killed meanwhile (SIGKILL: nothing said, nothing flushed) and
    started again still delivers it."""
    gateway, down = setup.gateway, setup.receivers["stark"]
    call = action(principal("stark"))
    key = key_of(call)
    async with await gateway.client("stark") as client:
        submitted = asyncio.create_task(client.submit(call, timeout=120))
        failing = webhook_id(down.url)
        await until(
            lambda: metric(
                notifier_metrics(gateway),
                "toolgate_notification_failures_total",
                webhook=failing,
                reason="connect",
            ),  # fmt: skip
            "no failed attempt counted",
        )
        notifier = gateway.service("notifier")
        notifier.kill()
        down.listen()
        notifier.start()
        got = await until(lambda: down.delivered(key, "waiting"), "lost with the notifier", 120)
        submitted.cancel()
    body = verified(got[0], down.secret)
    assert body["call"] == key and body["tenant"] == "stark"


def test_each_webhook_heard_only_its_tenants_and_no_secret_was_logged(setup: Setup) -> None:
    for tenant, receiver in setup.receivers.items():
        assert all(call.startswith(f"{tenant}.") for call in receiver.calls()), tenant
    assert {c.split(".")[0] for c in setup.everyone.calls()} >= {"acme", "globex", "umbrella"}
    log = (setup.gateway.data_dir / "logs" / "notifier.log").read_text()
    assert "delivered to webhook" in log
    for receiver in [*setup.receivers.values(), setup.everyone]:
        assert receiver.secret.decode() not in log
        assert receiver.path not in log


# ---------------------------------------------------------------- `toolgate up` itself


def toolgate(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli", *args],
        cwd=cwd,
        env=clean,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_up_refuses_webhooks_it_cannot_use_in_one_line(tmp_path: Path) -> None:
    bad_tenant = tmp_path / "hooks.yaml"
    bad_tenant.write_text("webhooks:\n  - {url: 'https://h.test/x', tenants: ['a.b']}\n")
    hook = "http://127.0.0.1:9/hook"
    cases = [
        (["--approval-webhook", "ftp://h.test/x"], "--approval-webhook: "),
        (
            ["--approval-webhook", hook, "--approval-webhook-secret-file", "no.secret"],
            "--approval-webhook-secret-file: cannot read ",
        ),
        (["--approval-webhooks", str(bad_tenant)], "not a tenant name: 'a.b'"),
        (["--approval-webhook", hook, "--approval-reminder-at", "1.5"], "--approval-reminder-at"),
        (["--inbox-url", "ftp://inbox"], "--inbox-url"),
    ]
    for args, says in cases:
        done = toolgate(["up", "--nats-port", "0", "--no-audit", *args], tmp_path)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith("toolgate up: ") and says in lines[0], (args, lines[0])
    done = toolgate(["serve", "notifier", "--webhooks", str(tmp_path / "none.yaml")], tmp_path)
    assert done.returncode == 2 and "cannot read" in done.stderr and "--webhooks" in done.stderr


def test_up_with_a_webhook_makes_a_secret_and_says_so(tmp_path: Path) -> None:
    receiver = Receiver()
    data = tmp_path / ".toolgate"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    up = subprocess.Popen(
        [sys.executable, "-m", "toolgate.cli", "up", "--nats-port", "0", "--no-audit"]
        + ["--approval-webhook", receiver.url, "--inbox-url", INBOX],
        cwd=tmp_path,
        env=clean,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        said = []
        for line in up.stdout:
            said.append(line)
            if "Press Ctrl-C" in line:
                break
        text = "".join(said)
        secret = data / "approval-webhook.secret"
        assert f"approval webhooks: 1, signed with {secret}" in text, text
        assert f"calls link to {INBOX}/calls/TENANT.AGENT.CALL_ID" in text
        assert receiver.path not in text
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600
        resolved = data / "notifier" / "webhooks.yaml"
        assert stat.S_IMODE(resolved.stat().st_mode) == 0o600
        assert yaml.safe_load(resolved.read_text())["webhooks"][0]["url"] == receiver.url
        log = data / "logs" / "notifier.log"
        deadline = time.monotonic() + 60
        while "1 webhook(s)" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.2)
        assert webhook_id(receiver.url) in log.read_text()
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(90)
        receiver.stop()
    assert up.returncode == 0
