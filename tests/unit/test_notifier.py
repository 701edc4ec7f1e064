"""The notifier's pure logic, its configuration, and its delivery decisions (with an
in-memory sender, publisher and clock: no broker, no HTTP)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from toolgate.contracts.calls import Principal, ToolCall, ToolError
from toolgate.contracts.events import ApprovalDenied, ApprovalGranted, ApprovalRequested, Event
from toolgate.contracts.registry import load_registry
from toolgate.services.approvals.logic import new_state
from toolgate.services.notifier import logic
from toolgate.services.notifier.app import ACK, Notifier, Options
from toolgate.services.notifier.sender import Answer
from toolgate.services.notifier.webhooks import (
    WebhookConfigError,
    load_webhooks,
    merged,
    read_config,
    write_resolved,
)

T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
CALL = ToolCall(
    call_id="call_01",
    tool="save_evidence",
    arguments={"a": 1},
    principal=Principal(tenant="acme", user="u-<!here>\u202e", agent="researcher", session="s"),
)


def requested(expires_in_s: float = 600) -> ApprovalRequested:
    return ApprovalRequested(
        event_id="e1",
        call_id=CALL.call_id,
        occurred_at=T0,
        service="policy",
        tool=CALL.tool,
        principal=CALL.principal,
        arguments_sha256=None,
        call=CALL,
        policy_version="v1",
        policy_ids=["approval-high-risk"],
        risk="high",
        expires_at=T0 + timedelta(seconds=expires_in_s),
        reason="high-risk tools need one approver",
    )


def webhook(tenants: list[str] | None = None, url: str = "https://hooks.test/T/B/secret") -> Any:
    return logic.Webhook(
        url=url, secret=b"s3cret", tenants=frozenset(tenants) if tenants is not None else None
    )


# ---------------------------------------------------------------- payload and text


def test_waiting_notification_has_the_call_and_links_to_its_inbox_page() -> None:
    n = logic.waiting(requested(), "Saves evidence.", "https://inbox.test/")
    assert n.call == "acme.researcher.call_01" and n.event == "waiting"
    assert n.url == "https://inbox.test/calls/acme.researcher.call_01"
    assert n.rule == "approval-high-risk" and n.why.startswith("high-risk")
    assert n.tool_description == "Saves evidence." and n.expires_at == T0 + timedelta(minutes=10)
    assert "<https://inbox.test/calls/acme.researcher.call_01|" in n.text


def test_outside_text_in_the_slack_text_is_escaped() -> None:
    n = logic.waiting(requested(), "", "https://inbox.test")
    assert "u-&lt;!here&gt;\\u202e" in n.text
    assert "<!here>" not in n.text and "\u202e" not in n.text
    denied = ApprovalDenied(
        event_id="e2",
        call_id=CALL.call_id,
        occurred_at=T0,
        service="approvals",
        tool=CALL.tool,
        principal=CALL.principal,
        approver="eve<@U123>",
        reason="no & <b>never</b>",
        error=ToolError(code="APPROVAL_DENIED", message="denied"),
    )
    d = logic.ended(denied, None, "", "https://inbox.test")
    assert d.decision == "denied" and d.decided_by == ["eve<@U123>"]
    assert "eve&lt;@U123&gt;" in d.text and "no &amp; &lt;b&gt;never&lt;/b&gt;" in d.text


def test_a_vote_short_of_the_quorum_is_no_decision() -> None:
    vote = ApprovalGranted(
        event_id="e3",
        call_id=CALL.call_id,
        occurred_at=T0,
        service="approvals",
        call=CALL,
        policy_version="v1",
        approver="carol",
        required_approvals=2,
    )
    assert not logic.is_decision(vote)
    assert logic.is_decision(msgspec.structs.replace(vote, quorum_reached=True))


def test_the_record_reads_the_approvals_services_state() -> None:
    state = new_state(requested())
    record = logic.record_decoder.decode(msgspec.json.encode(state))
    assert record.status == "pending" and record.policy_ids == ["approval-high-risk"]
    assert (
        record.arguments_sha256 == state.arguments_sha256 and record.expires_at == state.expires_at
    )


def test_the_body_is_signed_as_sent() -> None:
    n = logic.waiting(requested(), "", "https://inbox.test")
    job = logic.Job(key="k1", webhook="w", notification=n, queued_at=T0)
    body = logic.body_of(job, 1_700_000_000)
    headers = logic.headers_of(job, body, b"s3cret")
    expected = hmac.new(b"s3cret", body, hashlib.sha256).hexdigest()
    assert headers["X-Toolgate-Signature"] == f"sha256={expected}"
    assert headers["Idempotency-Key"] == "k1"
    decoded = json.loads(body)
    assert decoded["idempotency_key"] == "k1" and decoded["timestamp"] == 1_700_000_000
    assert decoded["text"] == n.text and decoded["call"] == n.call


def test_idempotency_keys_are_stable_per_call_kind_and_webhook() -> None:
    key = logic.idempotency_key("acme.a.c1", "waiting", "w1")
    assert key == logic.idempotency_key("acme.a.c1", "waiting", "w1")
    others = {
        logic.idempotency_key("acme.a.c1", "decided", "w1"),
        logic.idempotency_key("acme.a.c1", "waiting", "w2"),
        logic.idempotency_key("acme.b.c1", "waiting", "w1"),
    }
    assert key not in others and len(others) == 3


def test_routes_keep_each_tenant_to_its_webhooks() -> None:
    everyone, acme, globex = (
        webhook(),
        webhook(["acme"], "https://a"),
        webhook(["globex"], "https://g"),
    )
    assert logic.routes([everyone, acme, globex], "acme", "waiting") == [everyone, acme]
    assert logic.routes([everyone, acme, globex], "globex", "decided") == [everyone, globex]
    quiet = logic.Webhook(url="https://q", secret=b"x", events=frozenset({"decided"}))
    assert logic.routes([quiet], "acme", "waiting") == []


def test_webhooks_are_named_without_their_secret_path() -> None:
    hook = webhook(url="https://user:pw@hooks.slack.com/services/T0/B0/XXXX")
    assert hook.host == "https://hooks.slack.com"
    assert "XXXX" not in repr(hook) and "s3cret" not in repr(hook)


@pytest.mark.parametrize(
    ("status", "verdict"),
    [(200, "delivered"), (204, "delivered"), (500, "retry"), (503, "retry"), (429, "retry"),
     (408, "retry"), (410, "refused"), (401, "refused"), (302, "refused")],
)  # fmt: skip
def test_what_an_answer_means(status: int, verdict: str) -> None:
    assert logic.verdict_of(status) == verdict


def test_retries_thin_out_up_to_a_cap_and_end() -> None:
    assert logic.retry_delay(0, 1, 60) == 1
    assert logic.retry_delay(10, 1, 60) == 5
    assert logic.retry_delay(1000, 1, 60) == 60
    assert not logic.gives_up(3599, 3600) and logic.gives_up(3600, 3600)


def test_the_reminder_is_due_at_its_share_of_the_time_to_live() -> None:
    assert logic.reminder_at(T0, T0 + timedelta(seconds=100), 0.5) == T0 + timedelta(seconds=50)
    assert logic.reminder_at(T0, T0 + timedelta(seconds=100), 0) is None
    assert logic.reminder_at(T0, T0 + timedelta(seconds=100), 1) is None


# ---------------------------------------------------------------- delivery decisions


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


class Sender:
    def __init__(self, *answers: Answer) -> None:
        self.answers = list(answers)
        self.sent: list[tuple[str, bytes, dict[str, str]]] = []

    async def post(self, url: str, body: bytes, headers: dict[str, str]) -> Answer:
        self.sent.append((url, body, headers))
        return self.answers.pop(0) if self.answers else Answer(status=200)


class Publisher:
    def __init__(self) -> None:
        self.emitted: list[Event] = []

    async def emit(self, event: Event) -> None:
        self.emitted.append(event)


def notifier(sender: Sender, clock: Clock, **options: Any) -> tuple[Notifier, Publisher]:
    publisher = Publisher()
    service = Notifier(
        publisher,  # type: ignore[arg-type]
        load_registry(),
        [webhook(["acme"])],
        Options(retry_base_s=1, give_up_after_s=100, **options),
        sender,
        clock,
    )
    return service, publisher


def job(kind: logic.Kind = "waiting", not_before: datetime | None = None) -> logic.Job:
    n = logic.waiting(requested(), "", "https://inbox.test")
    if kind == "reminder":
        n = logic.reminder(n, not_before or T0)
    hook = webhook(["acme"])
    return logic.Job(
        key=logic.idempotency_key(n.call, kind, hook.id),
        webhook=hook.id,
        notification=n,
        queued_at=T0,
        not_before=not_before,
    )


def test_a_failed_attempt_is_put_back_and_retried_with_the_same_key() -> None:
    clock = Clock()
    sender = Sender(Answer(status=500), Answer(error="connection failed"), Answer(status=200))
    service, publisher = notifier(sender, clock)
    outcomes = []
    for _ in range(3):
        outcomes.append(asyncio.run(service.deliver(job())))
        clock.now += timedelta(seconds=10)
    assert outcomes[0].delay_s == 1 and outcomes[1].delay_s == 5 and outcomes[2] == ACK
    keys = {headers["Idempotency-Key"] for _, _, headers in sender.sent}
    assert len(keys) == 1 and not publisher.emitted


def test_a_delivery_failing_past_the_bound_is_dead_lettered_without_its_url() -> None:
    clock = Clock()
    clock.now = T0 + timedelta(seconds=101)
    service, publisher = notifier(Sender(Answer(error="no answer within 10 s")), clock)
    assert asyncio.run(service.deliver(job())) == ACK
    (letter,) = publisher.emitted
    assert letter.service == "notifier" and letter.call_id == "call_01"
    assert "not delivered within 100 s" in letter.reason and "no answer" in letter.reason
    assert "secret" not in letter.reason and "hooks.test" in letter.reason


def test_a_receiver_refusing_the_request_is_given_up_at_once() -> None:
    service, publisher = notifier(Sender(Answer(status=410)), Clock())
    assert asyncio.run(service.deliver(job())) == ACK
    assert "refused it: last attempt HTTP 410" in publisher.emitted[0].reason


def test_a_webhook_at_its_limit_puts_deliveries_back_without_trying() -> None:
    sender = Sender()
    service, _ = notifier(sender, Clock(), per_webhook=1)
    service._busy[webhook(["acme"]).id] = 1
    outcome = asyncio.run(service.deliver(job()))
    assert outcome.delay_s is not None and not sender.sent


def test_a_reminder_waits_until_due_and_goes_only_if_the_call_still_waits() -> None:
    clock = Clock()
    sender = Sender()
    service, _ = notifier(sender, clock)
    due = T0 + timedelta(seconds=30)
    assert asyncio.run(service.deliver(job("reminder", due))).delay_s == 30
    clock.now = due
    decided = msgspec.structs.replace(new_state(requested()), status="granted")
    records = {"acme.researcher.call_01": logic.record_decoder.decode(msgspec.json.encode(decided))}

    async def record_of(key: str) -> logic.ApprovalRecord | None:
        return records.get(key)

    service.record_of = record_of  # type: ignore[method-assign]
    assert asyncio.run(service.deliver(job("reminder", due))) == ACK and not sender.sent
    records["acme.researcher.call_01"] = logic.record_decoder.decode(
        msgspec.json.encode(new_state(requested()))
    )
    assert asyncio.run(service.deliver(job("reminder", due))) == ACK and len(sender.sent) == 1


# ---------------------------------------------------------------- configuration


def test_the_config_file_resolves_secrets_and_the_flags_add_every_tenant_hooks(
    tmp_path: Path,
) -> None:
    (tmp_path / "acme.secret").write_text("acme-secret\n")
    (tmp_path / "default.secret").write_text("default-secret")
    config = tmp_path / "approval-webhooks.yaml"
    config.write_text(
        "webhooks:\n"
        "  - {url: 'https://a.test/hook', tenants: [acme], secret_file: acme.secret}\n"
        "  - {url: 'https://b.test/hook', tenants: [globex], events: [decided]}\n"
    )
    entries = merged(["https://all.test/x"], tmp_path / "default.secret", read_config(config))
    resolved = tmp_path / "notifier" / "webhooks.yaml"
    write_resolved(resolved, entries)
    assert stat.S_IMODE(resolved.stat().st_mode) == 0o600
    hooks = {h.url: h for h in load_webhooks(resolved)}
    assert hooks["https://all.test/x"].tenants is None
    assert hooks["https://all.test/x"].secret == b"default-secret"
    assert hooks["https://a.test/hook"].secret == b"acme-secret"
    assert hooks["https://b.test/hook"].events == frozenset({"decided"})


@pytest.mark.parametrize(
    "entry",
    [
        "{url: 'ftp://x.test/a'}",
        "{url: 'https://x.test/a', tenants: ['a.b']}",
        "{url: 'https://x.test/a', events: [sometimes]}",
        "{url: 'https://x.test/a', secret_file: missing.secret}",
    ],
)
def test_a_bad_webhook_entry_is_refused_with_where(tmp_path: Path, entry: str) -> None:
    config = tmp_path / "hooks.yaml"
    config.write_text(f"webhooks:\n  - {entry}\n")
    with pytest.raises(WebhookConfigError, match=str(tmp_path)):
        load_webhooks(config)


def test_an_old_request_still_open_is_told_but_an_old_decision_is_not() -> None:
    clock = Clock()
    service, _ = notifier(Sender(), clock)
    queued: list[tuple[logic.Job, str]] = []

    async def queue(job: logic.Job, subject: str) -> None:
        queued.append((job, subject))

    service.queue = queue
    clock.now = T0 + timedelta(hours=5)  # the notifier was away: the request is old
    assert asyncio.run(service.on_event(requested(expires_in_s=24 * 3600))) == 2
    assert [j.notification.event for j, _ in queued] == ["waiting", "reminder"]
    assert {s for _, s in queued} == {f"toolgate.notify.acme.{webhook(['acme']).id}"}
    assert asyncio.run(service.on_event(requested(expires_in_s=600))) == 0  # expired
    denied = ApprovalDenied(
        event_id="e9",
        call_id=CALL.call_id,
        occurred_at=T0,
        service="approvals",
        tool=CALL.tool,
        principal=CALL.principal,
        approver="eve",
        error=ToolError(code="APPROVAL_DENIED", message="denied"),
    )
    assert asyncio.run(service.on_event(denied)) == 0  # 5 h ago: past
    clock.now = T0 + timedelta(seconds=5)
    assert asyncio.run(service.on_event(denied)) == 1
