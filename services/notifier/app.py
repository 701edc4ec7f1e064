"""The notifier: approvers' webhooks hear that a call waits, is decided or expired.

Consumes: `ApprovalRequested`, `ApprovalGranted`, `ApprovalDenied`,
`ApprovalExpired` (durables `notifier-<event>`), reading the call's approval
state (KV `toolgate_approvals`, read only) for what a decision event does not
say; and its own deliveries, `toolgate.notify.<tenant>.<webhook id>` in the
work-queue stream `TOOLGATE_NOTIFICATIONS` (durable `notifier-deliveries`).
Emits: one queued delivery per notification and webhook that hears its
tenant (`waiting` and, due at a share of the time to live, `reminder` for a
request; `decided` for a deny or a completed quorum; `expired`); a signed
JSON POST per delivery; a `MessageDeadLettered` (filed under the call) for a
delivery given up. It never emits a call's events: a notification decides
nothing, and no decision waits for one.

Delivery, at least once. Fanning out publishes each delivery with a publish
ack and `Nats-Msg-Id` = its idempotency key (a redelivered event queues
nothing new), then acks the event. A delivery message stays un-acked until
the webhook answered 2xx; a failure (refused, 5xx, 408/429, no answer within
the timeout) naks it with a delay of half the time already spent on it (at
least 1 s, at most 60 s); after `give_up_after` (1 h) it is given up: a dead
letter with the last reason, and the message terminated. Another 4xx is the
receiver refusing this request: given up at once. A reminder waits in the
queue (nak with delay, not an attempt) until due, then goes only if the call
still waits. Every attempt has the same idempotency key (header
`Idempotency-Key` and body), a fresh `timestamp`, and its own signature.

Isolation. Each attempt has a deadline (10 s); at most `per_webhook` (4)
attempts to one webhook run at once (more are put back for a moment), out of
64 handler slots, so a receiver that hangs holds a few slots and never the
others' deliveries; the pipeline's own services never wait for the notifier.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from faststream import FastStream
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, is_valid_call_id
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ApprovalGranted,
    ApprovalRequested,
    Event,
    MessageDeadLettered,
    decode_event,
    derive_event_id,
    payload_sha256,
    utc_now,
)
from toolgate.contracts.registry import Registry
from toolgate.runtime import emits, giving_up, publishing, settling, telemetry
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner
from toolgate.runtime.topology import NOTIFIER_DELIVERIES_DURABLE
from toolgate.services.notifier import logic
from toolgate.services.notifier.logic import SERVICE, ApprovalRecord, Job, Kind, Webhook
from toolgate.services.notifier.sender import DEFAULT_TIMEOUT_S, HttpSender, Sender

log = logging.getLogger("toolgate.notifier")

DELIVERIES_DURABLE = NOTIFIER_DELIVERIES_DURABLE
DELIVERY_SLOTS = 64
DEFAULT_PER_WEBHOOK = 4
# A delivery whose webhook has all its slots busy is put back for this long.
BUSY_WEBHOOK_DELAY_S = 1.0
# A reminder not yet due is put back for at most this long, then looked at again.
MAX_WAIT_S = 60.0

Clock = Callable[[], datetime]


@dataclass(frozen=True)
class Options:
    inbox_url: str = logic.DEFAULT_INBOX_URL
    reminder_share: float = logic.DEFAULT_REMINDER_SHARE
    retry_base_s: float = logic.DEFAULT_RETRY_BASE_S
    retry_cap_s: float = logic.DEFAULT_RETRY_CAP_S
    give_up_after_s: float = logic.DEFAULT_GIVE_UP_AFTER_S
    timeout_s: float = DEFAULT_TIMEOUT_S
    per_webhook: int = DEFAULT_PER_WEBHOOK


class NotifierMetrics:
    """Deliveries, failed attempts, retries and give-ups, by webhook id and event."""

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        labels = ["webhook", "event"]
        self.delivered = Counter(
            "toolgate_notifications_delivered", "Notifications a webhook took (2xx)",
            labels, registry=registry,
        )  # fmt: skip
        self.failed = Counter(
            "toolgate_notification_failures", "Delivery attempts that failed, by reason",
            [*labels, "reason"], registry=registry,
        )  # fmt: skip
        self.retried = Counter(
            "toolgate_notification_retries", "Deliveries put back to be tried again",
            labels, registry=registry,
        )  # fmt: skip
        self.given_up = Counter(
            "toolgate_notifications_given_up", "Deliveries given up (dead-lettered)",
            labels, registry=registry,
        )  # fmt: skip
        self.seconds = Histogram(
            "toolgate_notification_attempt_seconds", "Time of one delivery attempt",
            ["webhook"], buckets=telemetry.LATENCY_BUCKETS, registry=registry,
        )  # fmt: skip


def _failure_label(answer_reason: str) -> str:
    """A bounded label for a failed attempt: the status class, or the kind of error."""
    if answer_reason.startswith("HTTP "):
        return answer_reason.replace("HTTP ", "http_")[:8]
    if answer_reason.startswith("no answer"):
        return "timeout"
    if answer_reason.startswith("connection"):
        return "connect"
    return "error"


@dataclass(frozen=True)
class Settle:
    """What to do with a delivery message: ack it, or put it back for `delay_s`."""

    delay_s: float | None = None

    @property
    def ack(self) -> bool:
        return self.delay_s is None


ACK = Settle()


class Notifier:
    """The service's behaviour, independent of how messages reach it."""

    def __init__(
        self,
        publisher: publishing.Publisher,
        registry: Registry,
        webhooks: list[Webhook],
        options: Options,
        sender: Sender,
        clock: Clock = utc_now,
    ) -> None:
        self.publisher = publisher
        self.registry = registry
        self.webhooks = {w.id: w for w in webhooks}
        self.options = options
        self.sender = sender
        self.clock = clock
        self.metrics: NotifierMetrics | None = None
        self.queue: Callable[[Job, str], Any] | None = None  # bound to the bus at start
        self.records: KeyValue | None = None
        self._busy: dict[str, int] = {}
        self._attempts: dict[str, int] = {}

    # ------------------------------------------------------------ fan-out

    def _description(self, tool: str) -> str:
        spec = self.registry.get(tool)
        return spec.description if spec is not None else ""

    async def record_of(self, key: str) -> ApprovalRecord | None:
        if self.records is None:
            return None
        try:
            entry = await self.records.get(key)
        except (KeyNotFoundError, NotFoundError):
            return None
        if entry.value is None:
            return None
        try:
            return logic.record_decoder.decode(entry.value)
        except msgspec.DecodeError:
            log.warning("approval state of %s unreadable: sent without it", key)
            return None

    async def _queue(
        self, notification: logic.Notification, kind: Kind, not_before: datetime | None = None
    ) -> int:
        assert self.queue is not None, "the notifier is not bound to the bus yet"
        queued = 0
        for webhook in logic.routes(self.webhooks.values(), notification.tenant, kind):
            job = Job(
                key=logic.idempotency_key(notification.call, kind, webhook.id),
                webhook=webhook.id,
                notification=notification,
                queued_at=self.clock(),
                not_before=not_before,
            )
            await self.queue(job, subjects.notification_subject(notification.tenant, webhook.id))
            queued += 1
        return queued

    def _stale(self, occurred_at: datetime, what: str) -> bool:
        if logic.is_stale(occurred_at, self.clock(), self.options.give_up_after_s):
            log.info("%s: from %s, too old to tell anyone now; not sent", what, occurred_at)
            return True
        return False

    async def on_event(self, event: Event) -> int:
        """Queue the deliveries `event` calls for; how many were queued."""
        if not self.webhooks:
            return 0
        principal = event.principal
        if principal is None or not (
            subjects.is_identity_token(principal.tenant)
            and subjects.is_identity_token(principal.agent)
            and is_valid_call_id(event.call_id)
        ):
            raise ValueError(f"{type(event).__name__} {event.event_id}: no valid call key")
        key = subjects.call_key(principal.tenant, principal.agent, event.call_id)
        if isinstance(event, ApprovalRequested):
            return await self.on_requested(event, key)
        if isinstance(event, ApprovalGranted | ApprovalDenied):
            if not logic.is_decision(event) or self._stale(event.occurred_at, key):
                return 0
            record = await self.record_of(key)
            notification = logic.ended(event, record, self._description(event.tool), self._inbox)
            return await self._queue(notification, "decided")
        if isinstance(event, ApprovalExpired):
            if self._stale(event.occurred_at, key):
                return 0
            record = await self.record_of(key)
            notification = logic.ended(event, record, self._description(event.tool), self._inbox)
            return await self._queue(notification, "expired")
        raise TypeError(f"the notifier does not handle {type(event).__name__}")

    @property
    def _inbox(self) -> str:
        return self.options.inbox_url

    async def on_requested(self, event: ApprovalRequested, key: str) -> int:
        now = self.clock()
        if event.expires_at <= now:
            # Nobody can act on it any more (the expiry notification says so). One still
            # open is told however old: it still waits for someone.
            log.info("%s: expired at %s before it was told; not sent", key, event.expires_at)
            return 0
        notification = logic.waiting(event, self._description(event.call.tool), self._inbox)
        queued = await self._queue(notification, "waiting")
        due = logic.reminder_at(event.occurred_at, event.expires_at, self.options.reminder_share)
        if due is not None and due > now:
            queued += await self._queue(logic.reminder(notification, due), "reminder", due)
        return queued

    # ------------------------------------------------------------ delivery

    async def deliver(self, job: Job) -> Settle:
        """One attempt at `job` (or a reason to put it back first)."""
        now = self.clock()
        webhook = self.webhooks.get(job.webhook)
        kind = job.notification.event
        if webhook is None:
            await self.give_up(job, None, "its webhook is no longer configured")
            return ACK
        if job.not_before is not None and now < job.not_before:
            return Settle(min((job.not_before - now).total_seconds(), MAX_WAIT_S))
        if kind == "reminder" and job.key not in self._attempts:
            record = await self.record_of(job.notification.call)
            if not logic.still_waiting(record, job.notification):
                log.info("reminder of %s not sent: the call no longer waits", job.notification.call)
                return ACK
        if self._busy.get(webhook.id, 0) >= self.options.per_webhook:
            return Settle(BUSY_WEBHOOK_DELAY_S * random.uniform(0.8, 1.2))
        self._busy[webhook.id] = self._busy.get(webhook.id, 0) + 1
        try:
            body = logic.body_of(job, int(time.time()))
            started = time.perf_counter()
            answer = await self.sender.post(
                webhook.url, body, logic.headers_of(job, body, webhook.secret)
            )
            elapsed = time.perf_counter() - started
        finally:
            self._busy[webhook.id] -= 1
        attempts = self._attempts[job.key] = self._attempts.get(job.key, 0) + 1
        if len(self._attempts) > 10_000:  # bounded: the oldest counts go first
            del self._attempts[next(iter(self._attempts))]
        m = self.metrics
        if m is not None:
            m.seconds.labels(webhook.id).observe(elapsed)
        verdict = logic.verdict_of(answer.status) if answer.status is not None else "retry"
        if verdict == "delivered":
            self._attempts.pop(job.key, None)
            if m is not None:
                m.delivered.labels(webhook.id, kind).inc()
            log.info(
                "%s notification of %s delivered to webhook %s (%s), attempt %s",
                kind, job.notification.call, webhook.id, webhook.host, attempts,
            )  # fmt: skip
            return ACK
        if m is not None:
            m.failed.labels(webhook.id, kind, _failure_label(answer.reason)).inc()
        waited = (self.clock() - job.due_at).total_seconds()
        if verdict == "refused" or logic.gives_up(waited, self.options.give_up_after_s):
            why = (
                "the receiver refused it"
                if verdict == "refused"
                else f"not delivered within {self.options.give_up_after_s:g} s"
            )
            await self.give_up(job, webhook, f"{why}: last attempt {answer.reason}", attempts)
            self._attempts.pop(job.key, None)
            return ACK
        delay = logic.retry_delay(waited, self.options.retry_base_s, self.options.retry_cap_s)
        if m is not None:
            m.retried.labels(webhook.id, kind).inc()
        log.warning(
            "%s notification of %s to webhook %s (%s): attempt %s failed (%s); again in %.1f s",
            kind, job.notification.call, webhook.id, webhook.host, attempts, answer.reason, delay,
        )  # fmt: skip
        return Settle(delay)

    async def give_up(self, job: Job, webhook: Webhook | None, why: str, attempts: int = 0) -> None:
        """The record an operator finds: a dead letter filed under the call."""
        n = job.notification
        where = f"webhook {job.webhook}" + (f" ({webhook.host})" if webhook else "")
        raw = logic.encode_job(job)
        letter = MessageDeadLettered(
            event_id=derive_event_id(f"notify:{job.key}", "gave-up"),
            occurred_at=self.clock(),
            service=SERVICE,
            call_id=n.call_id,
            tool=n.tool,
            principal=Principal(tenant=n.tenant, user=n.user, agent=n.agent, session=n.session),
            arguments_sha256=n.arguments_sha256 or None,
            reason=f"notifier gave up on the {n.event} notification of {n.call} to {where} "
            f"after {attempts} attempt(s): {why}",
            source_subject=subjects.notification_subject(n.tenant, job.webhook),
            payload_bytes=len(raw),
            payload_sha256=payload_sha256(raw),
        )
        await self.publisher.emit(letter)
        if self.metrics is not None:
            self.metrics.given_up.labels(job.webhook, n.event).inc()
        log.error("%s", letter.reason)


def build_app(
    settings: GatewaySettings,
    webhooks: list[Webhook],
    options: Options | None = None,
    *,
    clock: Clock = utc_now,
) -> FastStream:
    options = options or Options()
    runner = StageRunner(SERVICE, settings)
    broker, publisher = runner.broker, runner.publisher
    sender = HttpSender(options.timeout_s)
    served = ServedRegistry(settings)  # the pushed registry, followed
    service = Notifier(publisher, served.current, webhooks, options, sender, clock)
    registry = telemetry.registry()
    if registry is not None:
        service.metrics = NotifierMetrics(registry)

    async def on_event(msg: Msg, delivery: settling.Delivery) -> None:
        await service.on_event(decode_event(msg.data))

    async def on_delivery(msg: Msg, delivery: settling.Delivery) -> None:
        try:
            job = logic.job_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:  # not ours: recorded, never retried
            await settling.settle(
                msg, delivery, _raise(exc), _dead_letter(publisher, delivery, msg)
            )
            return
        try:
            outcome = await service.deliver(job)
        except Exception as exc:  # the bus (a dead letter, a KV read) did not answer
            log.warning("delivery %s of %s: %r; trying again", job.key, job.notification.call, exc)
            await msg.nak(delay=settling.retry_delay(delivery.attempt))
            return
        if outcome.ack:
            await msg.ack()
        else:
            await msg.nak(delay=outcome.delay_s)

    # Its outcome is a webhook's answer: it acks or naks the message itself.
    runner.add(
        Stage(DELIVERIES_DURABLE, on_delivery, settles_itself=True, concurrency=DELIVERY_SLOTS)
    )
    for durable in runner.unstaged():  # one per NOTIFIED_EVENTS
        # A notification never ends a call.
        runner.add(Stage(durable, on_event, end_call=False))

    app = runner.app()

    @app.on_startup
    async def bind() -> None:
        await broker.connect()
        js = publishing.jetstream(broker)

        async def queue(job: Job, subject: str) -> None:
            emits.check("Job")
            await js.publish(
                subject,
                logic.encode_job(job),
                stream=subjects.NOTIFICATIONS_STREAM,
                headers={"Nats-Msg-Id": job.key},
            )

        service.queue = queue
        await start_registry(served, js)
        served.follow(lambda registry: setattr(service, "registry", registry))
        try:
            service.records = await broker.connection.jetstream().key_value(
                subjects.APPROVALS_BUCKET
            )
        except Exception as exc:
            log.warning("approvals state not readable (%r): notifications go without it", exc)
        log.info(
            "notifier: %s webhook(s) %s; inbox links to %s",
            len(service.webhooks),
            ", ".join(f"{w.id} ({w.host})" for w in service.webhooks.values()) or "-",
            options.inbox_url,
        )

    @app.on_shutdown
    async def close() -> None:
        await sender.close()
        await served.stop()

    runner.run_consumers(app)
    return app


def _raise(exc: Exception) -> Callable[[], Any]:
    async def work() -> None:
        raise exc

    return work


def _dead_letter(publisher: publishing.Publisher, delivery: settling.Delivery, msg: Msg) -> Any:
    async def give_up(exc: Exception) -> None:
        await publisher.emit(giving_up.dead_letter(SERVICE, delivery, msg.data, exc))

    return give_up
