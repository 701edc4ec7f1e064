"""What the notifier tells a webhook, and when it tries again: pure functions, no I/O.

A notification is one approval event of one call, said once to each webhook
that should hear it: `waiting` (the call waits for a human), `reminder` (it
still waits, at a share of its time to live), `decided` (approved, with the
quorum, or denied, by whom and why) and `expired`. Its body is JSON with
the call key, the call, the tool and its description, the risk, the rule
and why, the arguments hash, the expiry, a link to the call's inbox page
and a Slack-style `text`; every text in `text` that came from outside
(user, approver names and reasons, the policy's reason) is escaped for a
person (`visible`) and for Slack's markup (`&`, `<`, `>`), so a user named
`<!channel>` pings nobody.

Each delivery has an idempotency key derived from (call key, kind, webhook):
the same on every retry, so a receiver keeps the first and drops repeats.
The body carries a `timestamp` (Unix seconds, set at each attempt) and is
signed with HMAC-SHA256 (`sign`); a receiver refuses bodies whose timestamp
is far from its clock, so a captured request cannot be replayed later.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final, Literal
from urllib.parse import urlsplit

import msgspec

from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import ToolCall
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalGranted,
    ApprovalRequested,
    derive_event_id,
)
from toolgate.runtime.outside_text import visible

SERVICE: Final = "notifier"
SIGNATURE_HEADER: Final = "X-Toolgate-Signature"
IDEMPOTENCY_HEADER: Final = "Idempotency-Key"
Kind = Literal["waiting", "reminder", "decided", "expired"]
KINDS: Final[tuple[Kind, ...]] = ("waiting", "reminder", "decided", "expired")
# The reminder goes out at this share of a request's time to live (0: no reminder).
DEFAULT_REMINDER_SHARE: Final = 0.5
# The first retry waits this long; later ones half the time already spent, up to the cap.
DEFAULT_RETRY_BASE_S: Final = 1.0
DEFAULT_RETRY_CAP_S: Final = 60.0
# A notification not delivered within this long is given up (a dead letter).
DEFAULT_GIVE_UP_AFTER_S: Final = 3600.0
# The inbox's own default (`toolgate approvals inbox`, port 8090) unless told otherwise.
DEFAULT_INBOX_URL: Final = "http://127.0.0.1:8090"


# ---------------------------------------------------------------- webhooks


def webhook_id(url: str) -> str:
    """How logs, metrics, subjects and dead letters name a webhook: never by its URL
    (a Slack or Mattermost webhook URL is itself the credential)."""
    return hashlib.sha256(url.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Webhook:
    """One receiver: every tenant's calls (`tenants` None) or those of `tenants`."""

    url: str = field(repr=False)
    secret: bytes = field(repr=False)
    tenants: frozenset[str] | None = None
    events: frozenset[str] = frozenset(KINDS)

    @property
    def id(self) -> str:
        return webhook_id(self.url)

    @property
    def host(self) -> str:
        """Where it is, for a log line: scheme, host and port, no path (the secret part)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"

    def hears(self, tenant: str, kind: Kind) -> bool:
        return kind in self.events and (self.tenants is None or tenant in self.tenants)


def routes(webhooks: Iterable[Webhook], tenant: str, kind: Kind) -> list[Webhook]:
    """The webhooks that hear `kind` for `tenant`: another tenant's never do."""
    return [w for w in webhooks if w.hears(tenant, kind)]


# ---------------------------------------------------------------- the payload


class Vote(msgspec.Struct, frozen=True, kw_only=True):
    approver: str
    decision: str
    reason: str = ""
    at: datetime | None = None


class ApprovalRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the notifier reads of a call's approval state (the approvals service's KV
    value, bucket `toolgate_approvals`, key `TENANT.AGENT.CALL_ID`); other fields are
    ignored, so the service may add to its state freely."""

    call: ToolCall
    arguments_sha256: str
    policy_version: str = ""
    policy_ids: list[str] = []
    risk: str = ""
    required_approvals: int = 1
    requested_at: datetime | None = None
    expires_at: datetime | None = None
    request_reason: str = ""
    status: str = "pending"
    votes: list[Vote] = []
    decided_at: datetime | None = None


record_decoder = msgspec.json.Decoder(ApprovalRecord)


class Notification(msgspec.Struct, frozen=True, kw_only=True):
    """The body of one notification, without its idempotency key and timestamp."""

    type: str  # toolgate.approval.<event>
    event: Kind
    call: str  # TENANT.AGENT.CALL_ID
    tenant: str
    agent: str
    call_id: str
    user: str
    session: str = ""
    tool: str
    tool_description: str = ""
    risk: str = ""
    rule: str = ""  # the ids of the policies that asked for approval, comma-separated
    why: str = ""
    policy_version: str = ""
    arguments_sha256: str = ""
    required_approvals: int = 1
    requested_at: datetime | None = None
    expires_at: datetime | None = None
    status: str = "pending"  # pending | granted | denied | expired
    decision: str | None = None  # approved | denied
    decided_by: list[str] = []
    decision_reason: str = ""
    decided_at: datetime | None = None
    votes: list[Vote] = []
    occurred_at: datetime
    url: str
    text: str = ""


class Job(msgspec.Struct, frozen=True, kw_only=True):
    """One delivery, as queued on `toolgate.notify.<tenant>.<webhook id>`: stays there
    until the webhook took it or the notifier gave it up. Names the webhook by id only."""

    key: str  # the idempotency key
    webhook: str  # webhook id
    notification: Notification
    queued_at: datetime
    not_before: datetime | None = None  # a reminder waits until then

    @property
    def due_at(self) -> datetime:
        return self.not_before or self.queued_at


job_decoder = msgspec.json.Decoder(Job)
_encoder = msgspec.json.Encoder()


def encode_job(job: Job) -> bytes:
    return _encoder.encode(job)


def idempotency_key(call_key: str, kind: Kind, webhook: str) -> str:
    """The same for every attempt at this notification to this webhook."""
    return derive_event_id(f"notify:{call_key}", f"{kind}/{webhook}")


def call_link(inbox_url: str, call_key: str) -> str:
    # A call key is made of subject-safe tokens (letters, digits, - _) and dots: no quoting.
    return f"{inbox_url.rstrip('/')}/calls/{call_key}"


def reminder_at(requested_at: datetime, expires_at: datetime, share: float) -> datetime | None:
    """When the reminder is due: `share` of the time to live after the request (None: none)."""
    if not 0 < share < 1 or expires_at <= requested_at:
        return None
    return requested_at + (expires_at - requested_at) * share


def waiting(event: ApprovalRequested, tool_description: str, inbox_url: str) -> Notification:
    call = event.call
    p = call.principal
    key = subjects.call_key(p.tenant, p.agent, call.call_id)
    found = Notification(
        type="toolgate.approval.waiting",
        event="waiting",
        call=key,
        tenant=p.tenant,
        agent=p.agent,
        call_id=call.call_id,
        user=p.user,
        session=p.session,
        tool=call.tool,
        tool_description=tool_description,
        risk=event.risk,
        rule=", ".join(event.policy_ids),
        why=event.reason,
        policy_version=event.policy_version,
        arguments_sha256=event.arguments_sha256 or arguments_sha256(call.arguments),
        required_approvals=max(1, event.required_approvals),
        requested_at=event.occurred_at,
        expires_at=event.expires_at,
        occurred_at=event.occurred_at,
        url=call_link(inbox_url, key),
    )
    return msgspec.structs.replace(found, text=text_of(found))


def reminder(notification: Notification, now: datetime) -> Notification:
    """The waiting notification again, as a reminder."""
    found = msgspec.structs.replace(
        notification, type="toolgate.approval.reminder", event="reminder", occurred_at=now
    )
    return msgspec.structs.replace(found, text=text_of(found))


def ended(
    event: ApprovalGranted | ApprovalDenied | ApprovalExpired,
    record: ApprovalRecord | None,
    tool_description: str,
    inbox_url: str,
) -> Notification:
    """The `decided` (a quorum of approvals, or a deny) or `expired` notification; what
    the event does not say (rule, expiry, votes) comes from the approval's state."""
    principal = event.principal
    if principal is None:
        raise ValueError(f"{type(event).__name__} {event.event_id} names no principal")
    key = subjects.call_key(principal.tenant, principal.agent, event.call_id)
    if isinstance(event, ApprovalExpired):
        kind: Kind = "expired"
        status, decision, decided_by, reason = "expired", None, [], ""
    elif isinstance(event, ApprovalDenied):
        kind = "decided"
        status, decision, decided_by, reason = "denied", "denied", [event.approver], event.reason
    else:
        kind = "decided"
        approvers = event.approvers or [event.approver]
        status, decision, decided_by, reason = "granted", "approved", approvers, event.reason
    found = Notification(
        type=f"toolgate.approval.{kind}",
        event=kind,
        call=key,
        tenant=principal.tenant,
        agent=principal.agent,
        call_id=event.call_id,
        user=principal.user,
        session=principal.session,
        tool=event.tool,
        tool_description=tool_description,
        risk=record.risk if record else "",
        rule=", ".join(record.policy_ids) if record else "",
        why=record.request_reason if record else "",
        policy_version=record.policy_version if record else "",
        arguments_sha256=(record.arguments_sha256 if record else event.arguments_sha256) or "",
        required_approvals=record.required_approvals if record else 1,
        requested_at=record.requested_at if record else None,
        expires_at=record.expires_at if record else None,
        status=status,
        decision=decision,
        decided_by=list(decided_by),
        decision_reason=reason,
        decided_at=(record.decided_at if record else None) or event.occurred_at,
        votes=list(record.votes) if record else [],
        occurred_at=event.occurred_at,
        url=call_link(inbox_url, key),
    )
    return msgspec.structs.replace(found, text=text_of(found))


def is_decision(event: ApprovalGranted | ApprovalDenied) -> bool:
    """A deny ends a request; an approval only when it completes the quorum."""
    return isinstance(event, ApprovalDenied) or event.quorum_reached


def still_waiting(record: ApprovalRecord | None, notification: Notification) -> bool:
    """Is the call a reminder is about still open, for these same arguments?"""
    return (
        record is not None
        and record.status == "pending"
        and record.arguments_sha256 == notification.arguments_sha256
    )


def is_stale(occurred_at: datetime, now: datetime, max_age_s: float) -> bool:
    """A decision or expiry older than a notification may take to deliver: a notifier
    started on an old stream (or after a long outage) does not page people about the past."""
    return now - occurred_at > timedelta(seconds=max_age_s)


# ---------------------------------------------------------------- the Slack-style text


def slack_escaped(text: str) -> str:
    """Outside text as data in Slack/Mattermost markup: no hidden characters, no `<!here>`
    mention, no `<url|forged link>` (Slack's own rule: escape & < > and nothing else)."""
    return visible(text).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "unknown"


def text_of(n: Notification) -> str:
    """One message a person reads in a chat channel."""
    e = slack_escaped
    what = f"*{e(n.tool)}* call `{e(n.call)}` by {e(n.user)}"
    link = f"<{n.url}|Open it in the inbox>"
    rule = f"Rule {e(n.rule)}: {e(n.why)}" if n.rule or n.why else ""
    if n.event in ("waiting", "reminder"):
        lead = "Still waiting for approval" if n.event == "reminder" else "Approval needed"
        need = f"{n.required_approvals} approvals" if n.required_approvals > 1 else "1 approval"
        parts = [f"{lead}: {what} ({e(n.risk)} risk, {need})"]
        if rule:
            parts.append(rule)
        parts.append(f"Expires {_when(n.expires_at)}")
        return ". ".join(parts) + f". {link}"
    if n.event == "expired":
        return f"Expired: {what} was not decided by {_when(n.expires_at)}; it did not run. {link}"
    who = ", ".join(e(name) for name in n.decided_by) or "unknown"
    verb = "Approved" if n.decision == "approved" else "Denied"
    because = f": {e(n.decision_reason)}" if n.decision_reason else ""
    return f"{verb} by {who}{because}. {what}. {link}"


# ---------------------------------------------------------------- signing and the body


def body_of(job: Job, timestamp: int) -> bytes:
    """The exact bytes POSTed (and signed): the notification, its key and the time."""
    fields = msgspec.to_builtins(job.notification)
    fields["idempotency_key"] = job.key
    fields["timestamp"] = timestamp
    return _encoder.encode(fields)


def sign(secret: bytes, body: bytes) -> str:
    """The `X-Toolgate-Signature` header value: `sha256=<hex HMAC-SHA256 of the body>`."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def headers_of(job: Job, body: bytes, secret: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        SIGNATURE_HEADER: sign(secret, body),
        IDEMPOTENCY_HEADER: job.key,
        "User-Agent": "toolgate-notifier",
    }


# ---------------------------------------------------------------- what an answer means


Verdict = Literal["delivered", "retry", "refused"]


def verdict_of(status: int) -> Verdict:
    """2xx: delivered. 408, 425, 429 and 5xx: try again later. Any other 4xx: the
    receiver refuses this request as such (a removed hook: 404, 410; a bad secret: 401,
    403), and the same bytes will not fare better: given up at once. A redirect is not
    followed (the URL is the operator's to fix) and counts as a refusal."""
    if 200 <= status < 300:
        return "delivered"
    if status in (408, 425, 429) or status >= 500:
        return "retry"
    return "refused"


def retry_delay(waited_s: float, base_s: float, cap_s: float) -> float:
    """How long to wait before the next attempt: half the time already spent on this
    delivery (so attempts thin out geometrically, about x1.5 each), at least `base_s`,
    at most `cap_s`. Stateless: a restarted or another notifier replica agrees."""
    return min(cap_s, max(base_s, waited_s / 2))


def gives_up(waited_s: float, give_up_after_s: float) -> bool:
    return waited_s >= give_up_after_s
