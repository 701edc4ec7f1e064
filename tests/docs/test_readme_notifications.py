"""docs/approvals.md, "Approval notifications (webhooks)": its payload is what the notifier sends,
its webhooks file is what the notifier reads, and its receiver's check accepts the
notifier's signature and refuses a forged or replayed body."""

from __future__ import annotations

import json
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.docs.readme import Block, all_blocks
from tests.harness import REPO_ROOT
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import ApprovalRequested
from toolgate.services.notifier import logic
from toolgate.services.notifier.webhooks import load_webhooks, read_config

HEADING = "Approval notifications (webhooks)"
WEBHOOK_ID = "3f9a1c2b7d4e"  # the example's webhook


def section() -> list[Block]:
    found = [b for b in all_blocks(REPO_ROOT) if b.heading == HEADING]
    assert found, f"no section {HEADING!r}"
    return found


def documented_payload() -> dict[str, Any]:
    (block,) = [b for b in section() if b.webhook_payload]
    payload: dict[str, Any] = json.loads(block.text)
    return payload


def receivers_check() -> Any:
    (block,) = [b for b in section() if b.language == "python"]
    scope: dict[str, Any] = {}
    exec(compile(block.text, block.where, "exec"), scope)
    return scope["verified"]


def at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def sent_like(doc: dict[str, Any], timestamp: int) -> logic.Job:
    """The notifier's own notification of the call the page's example describes."""
    principal = Principal(
        tenant=doc["tenant"], user=doc["user"], agent=doc["agent"], session=doc["session"]
    )
    call = ToolCall(call_id=doc["call_id"], tool=doc["tool"], arguments={}, principal=principal)
    event = ApprovalRequested(
        event_id="e",
        call_id=call.call_id,
        occurred_at=at(doc["requested_at"]),
        service="policy",
        tool=call.tool,
        principal=principal,
        arguments_sha256=doc["arguments_sha256"],
        call=call,
        policy_version=doc["policy_version"],
        policy_ids=doc["rule"].split(", "),
        risk=doc["risk"],
        required_approvals=doc["required_approvals"],
        expires_at=at(doc["expires_at"]),
        reason=doc["why"],
    )
    inbox = doc["url"].removesuffix(f"/calls/{doc['call']}")
    notification = logic.waiting(event, doc["tool_description"], inbox)
    key = logic.idempotency_key(notification.call, "waiting", WEBHOOK_ID)
    return logic.Job(
        key=key, webhook=WEBHOOK_ID, notification=notification, queued_at=event.occurred_at
    )


def test_the_documented_payload_is_what_the_notifier_sends() -> None:
    doc = documented_payload()
    body = logic.body_of(sent_like(doc, doc["timestamp"]), doc["timestamp"])
    assert json.loads(body) == doc


def test_the_receivers_check_takes_a_signed_body_and_refuses_forged_or_old_ones() -> None:
    verified = receivers_check()
    job = sent_like(documented_payload(), 0)
    secret = b"shared with the receiver"
    body = logic.body_of(job, int(time.time()))
    signature = logic.headers_of(job, body, secret)[logic.SIGNATURE_HEADER]
    assert verified(secret, body, signature)["idempotency_key"] == job.key
    with pytest.raises(ValueError, match="bad signature"):
        verified(secret, body.replace(b"acme", b"acmf"), signature)
    with pytest.raises(ValueError, match="bad signature"):
        verified(b"another secret", body, signature)
    old = logic.body_of(job, int(time.time()) - 3600)
    with pytest.raises(ValueError, match="stale"):
        verified(secret, old, logic.headers_of(job, old, secret)[logic.SIGNATURE_HEADER])


def test_the_documented_webhooks_file_is_read_as_shown(tmp_path: Path) -> None:
    (block,) = [b for b in section() if b.language == "yaml"]
    config = tmp_path / "approval-webhooks.yaml"
    config.write_text(block.text)
    (tmp_path / "acme-hook.secret").write_text("s3cret\n")
    (entry,) = read_config(config)
    assert entry.tenants == ["acme"] and entry.secret_file == tmp_path / "acme-hook.secret"
    (hook,) = load_webhooks(config)
    assert hook.secret == b"s3cret" and hook.hears("acme", "reminder")
    assert not hook.hears("globex", "waiting")
