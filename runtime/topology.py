"""The streams and buckets toolgate runs on, declared as data and applied idempotently.

`toolgate up` applies them; so does every `toolgate serve NAME` before it
subscribes, so an SRE can start any service first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import nats
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
    StreamSource,
)
from nats.js.errors import BadRequestError, NotFoundError

from toolgate.contracts import subjects
from toolgate.runtime.creds import nats_servers

DAY_S = 24 * 3600.0
DEFAULT_MAX_CALLS_PER_AGENT = 1_000_000
# Rate-limit windows are kept a day (a per_seconds longer than that is not enforced fully).
RATE_LIMIT_WINDOW_RETENTION_S = 24 * 3600.0


def policies_bucket_config(replicas: int = 1) -> KeyValueConfig:
    """The pushed policy bundles, with a short history an operator can look back on."""
    return KeyValueConfig(
        bucket=subjects.POLICIES_BUCKET, history=16, storage=StorageType.FILE, replicas=replicas
    )


def policy_accepted_bucket_config(replicas: int = 1) -> KeyValueConfig:
    """The policy service's record of the last bundle it accepted (one value)."""
    return KeyValueConfig(
        bucket=subjects.POLICY_ACCEPTED_BUCKET,
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
    )


def registry_bucket_config(replicas: int = 1) -> KeyValueConfig:
    """The pushed registry bundles (`toolgate tools push`), with a short history."""
    return KeyValueConfig(
        bucket=subjects.REGISTRY_BUCKET, history=16, storage=StorageType.FILE, replicas=replicas
    )


def registry_accepted_bucket_config(replicas: int = 1) -> KeyValueConfig:
    """The validator's record of the last registry bundle it accepted (one value)."""
    return KeyValueConfig(
        bucket=subjects.REGISTRY_ACCEPTED_BUCKET,
        history=1,
        storage=StorageType.FILE,
        replicas=replicas,
    )


def rate_limits_bucket_config(replicas: int = 1) -> KeyValueConfig:
    return KeyValueConfig(
        bucket=subjects.RATE_LIMITS_BUCKET,
        history=1,
        ttl=RATE_LIMIT_WINDOW_RETENTION_S,
        storage=StorageType.FILE,
        replicas=replicas,
    )


# An always-empty stream the calls stream sources from (see Topology.streams).
NO_DEDUPE_SOURCE = "TOOLGATE_NO_DEDUPE"
NO_DEDUPE_SUBJECT = "toolgate.internal.no-dedupe"
# The largest message a stream keeps: the embedded server's max_payload
# (stack/nats_server.py), so whatever the server accepts is stored and answered.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
# How long a sealed user token is kept for the executor at most (an approval may take
# hours; the token's own expiry usually ends its use sooner).
USER_TOKENS_TTL_S = 2 * DAY_S


@dataclass(frozen=True)
class Topology:
    retention_s: float = 7 * DAY_S
    duplicate_window_s: float = 120.0
    # What the calls stream stores: every message the server accepts, so that a call
    # over MAX_CALL_BYTES reaches the validator and gets PAYLOAD_TOO_LARGE as a result
    # (a stream limit at MAX_CALL_BYTES answered it only with an error in the publish
    # ack). What an agent can make the gateway keep stays bounded: at most
    # max_calls_per_agent calls of at most this size, for the retention.
    max_stored_call_bytes: int = MAX_MESSAGE_BYTES
    # The storage quota, per agent identity: at most this many calls stored
    # within the retention (each call has at most one result and one outcome
    # record, so this bounds those too). Over it, the server refuses the
    # publish before storing anything; other agents are unaffected.
    max_calls_per_agent: int = DEFAULT_MAX_CALLS_PER_AGENT
    replicas: int = 1

    def streams(self) -> list[StreamConfig]:
        common: dict[str, Any] = dict(
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            max_age=self.retention_s,
        )
        return [
            # Calls must not be deduplicated by Nats-Msg-Id: the header is stream-wide,
            # so one agent could make another's call vanish by publishing its id
            # first. The validator dedupes on (tenant, agent, call_id) instead.
            # NATS turns duplicate tracking off only for a stream that has sources
            # (window 0 otherwise means "2 minutes"): hence an empty source.
            StreamConfig(name=NO_DEDUPE_SOURCE, subjects=[NO_DEDUPE_SUBJECT], **common),
            # One subject per agent: the per-subject cap is the agent's quota.
            StreamConfig(
                name=subjects.CALLS_STREAM,
                subjects=[subjects.CALLS_FILTER],
                sources=[StreamSource(name=NO_DEDUPE_SOURCE)],
                max_msg_size=self.max_stored_call_bytes,
                max_msgs_per_subject=self.max_calls_per_agent,
                discard=DiscardPolicy.NEW,
                discard_new_per_subject=True,
                **common,
            ),
            StreamConfig(
                name=subjects.EVENTS_STREAM,
                subjects=[f"{subjects.EVENTS_PREFIX}.>"],
                duplicate_window=self.duplicate_window_s,
                max_msg_size=MAX_MESSAGE_BYTES,
                **common,
            ),
            # Written once: the first result of a call is its result, a later
            # publish on the subject is refused; read back by subject (direct get).
            StreamConfig(
                name=subjects.RESULTS_STREAM,
                subjects=[f"{subjects.RESULTS_PREFIX}.>"],
                duplicate_window=self.duplicate_window_s,
                max_msg_size=MAX_MESSAGE_BYTES,
                max_msgs_per_subject=1,
                discard=DiscardPolicy.NEW,
                discard_new_per_subject=True,
                allow_direct=True,
                **common,
            ),
            # The notifier's deliveries: a work queue (a message goes once delivered or
            # given up), never seen by the audit (it names webhooks, whose URLs are
            # secrets, only by id; the payload is the audit's events again).
            StreamConfig(
                name=subjects.NOTIFICATIONS_STREAM,
                subjects=[f"{subjects.NOTIFY_PREFIX}.>"],
                retention=RetentionPolicy.WORK_QUEUE,
                storage=StorageType.FILE,
                num_replicas=self.replicas,
                max_age=self.retention_s,
                duplicate_window=self.duplicate_window_s,
                max_msg_size=MAX_MESSAGE_BYTES,
            ),
            # The audit's checkpoints, for ever: no role but the operator may delete the
            # stream, and no one may delete or purge a message of it (a flag only the
            # operator could change, with STREAM.UPDATE).
            StreamConfig(
                name=subjects.AUDIT_SEALS_STREAM,
                subjects=[subjects.AUDIT_SEALS_SUBJECT],
                retention=RetentionPolicy.LIMITS,
                storage=StorageType.FILE,
                num_replicas=self.replicas,
                duplicate_window=self.duplicate_window_s,
                deny_delete=True,
                deny_purge=True,
            ),
        ]

    def buckets(self) -> list[KeyValueConfig]:
        # Outcomes live as long as calls do, so a duplicate call_id within the
        # retention always replays instead of running again.
        return [
            KeyValueConfig(
                bucket=subjects.OUTCOMES_BUCKET,
                history=1,
                ttl=self.retention_s,
                storage=StorageType.FILE,
                replicas=self.replicas,
                max_value_size=MAX_MESSAGE_BYTES,
            ),
            # (tenant, agent, call_id) -> the stored call that claimed it.
            KeyValueConfig(
                bucket=subjects.CALL_IDS_BUCKET,
                history=1,
                ttl=self.retention_s,
                storage=StorageType.FILE,
                replicas=self.replicas,
                max_value_size=1024,
            ),
            # Approval states outlive their decision (single use: a late vote is refused).
            KeyValueConfig(
                bucket=subjects.APPROVALS_BUCKET,
                history=1,
                ttl=self.retention_s,
                storage=StorageType.FILE,
                replicas=self.replicas,
                max_value_size=MAX_MESSAGE_BYTES,
            ),
            policies_bucket_config(self.replicas),
            policy_accepted_bucket_config(self.replicas),
            registry_bucket_config(self.replicas),
            registry_accepted_bucket_config(self.replicas),
            rate_limits_bucket_config(self.replicas),
            # End users' access tokens, sealed for the executor (runtime/user_tokens.py):
            # kept while a call may wait for a human, deleted when the tool has run.
            KeyValueConfig(
                bucket=subjects.USER_TOKENS_BUCKET,
                history=1,
                ttl=USER_TOKENS_TTL_S,
                storage=StorageType.FILE,
                replicas=self.replicas,
                max_value_size=64 * 1024,
            ),
        ]


async def apply_topology(
    nats_url: str, topology: Topology | None = None, **connect_options: Any
) -> None:
    """Create or update the streams and buckets; on a locked bus, as the admin user."""
    topology = topology or Topology()
    nc = await nats.connect(nats_servers(nats_url), **connect_options)
    try:
        js = nc.jetstream()
        for config in topology.streams():
            try:
                await js.stream_info(config.name or "")
                await js.update_stream(config)
            except NotFoundError:
                await js.add_stream(config)
        for bucket in topology.buckets():
            try:
                await js.key_value(bucket.bucket)
            except (NotFoundError, BadRequestError):
                await js.create_key_value(bucket)
    finally:
        await nc.close()


# ---------------------------------------------------------------- how long a delivery is held
#
# AckWait: how long JetStream waits for a delivered message's ack before it
# hands the message to another worker. JetStream's default (30 s) made a
# SIGKILLed worker's messages wait 30 s. Each durable gets what its stage
# needs instead: the quick stages (validator, policy, approvals, attacher)
# finish a message in milliseconds, so a short AckWait only bounds how long a
# dead worker's messages wait; an executor durable waits its tool's timeout
# plus a margin, capped, and the executor sends `in_progress` every third of
# that while a tool runs, so a tool slower than its AckWait is never handed
# to a second worker while the first still runs it.

STAGE_ACK_WAIT_S = 10.0
EXECUTOR_ACK_MARGIN_S = 5.0
EXECUTOR_ACK_WAIT_CAP_S = 15.0
# A notifier delivery holds its message for one webhook attempt (its timeout, 10 s
# by default) and says in_progress meanwhile; the fan-out durables are quick.
NOTIFIER_ACK_WAIT_S = 30.0
NOTIFIER_DELIVERIES_DURABLE = "notifier-deliveries"
# The audit holds messages while a batch fills and is inserted (about 1 s, longer
# while ClickHouse is slow: the sink says in_progress meanwhile). Short, because a
# SIGKILLed sink's batch waits this long to be redelivered. The sink creates its
# durables with it (one value, here).
AUDIT_ACK_WAIT_S = 10.0
# JetStream's own default, for comparison: what a durable without ours would wait.
DEFAULT_ACK_WAIT_S = 30.0


def stage_ack_wait(durable: str) -> float:
    """The AckWait of a pipeline durable (executors: see executor_ack_wait)."""
    if durable.startswith("executor-"):
        return EXECUTOR_ACK_WAIT_CAP_S
    if durable == "audit":
        return AUDIT_ACK_WAIT_S
    if durable == NOTIFIER_DELIVERIES_DURABLE:
        return NOTIFIER_ACK_WAIT_S
    return STAGE_ACK_WAIT_S


def executor_ack_wait(tool_timeout_s: float) -> float:
    """A tool's durable: its timeout plus a margin, at most the cap (heartbeats cover the rest)."""
    return min(tool_timeout_s + EXECUTOR_ACK_MARGIN_S, EXECUTOR_ACK_WAIT_CAP_S)


def heartbeat_interval(ack_wait_s: float) -> float:
    """How often a worker says `in_progress` for a message it still works on: a sixth of
    the AckWait, so a message in hand for a whole interval is kept no later than two
    intervals (a third of its AckWait) after it was handed over, leaving two thirds of
    the AckWait for a loaded loop to send it in."""
    return ack_wait_s / 6


def ack_waits(tool_timeouts: dict[str, float]) -> dict[tuple[str, str], float]:
    """(stream, durable) -> the AckWait it should have, for a registry's tools."""
    wanted = {}
    for h in handlers(sorted(tool_timeouts), with_audit=False):
        tool = h.durable.removeprefix("executor-")
        wait = (
            executor_ack_wait(tool_timeouts[tool])
            if h.service == "executor"
            else stage_ack_wait(h.durable)
        )
        wanted[(h.stream, h.durable)] = wait
    return wanted


async def refresh_ack_waits(
    nats_url: str, tool_timeouts: dict[str, float], **connect_options: Any
) -> list[str]:
    """Give durables that exist (made by an older version, or for a changed tool timeout)
    the AckWait their stage has now; the durables changed. Services create missing ones."""
    changed = []
    nc = await nats.connect(nats_servers(nats_url), **connect_options)
    try:
        js = nc.jetstream()
        for (stream, durable), wait in ack_waits(tool_timeouts).items():
            try:
                info = await js.consumer_info(stream, durable)
            except NotFoundError:
                continue
            if info.config.ack_wait is not None and abs(info.config.ack_wait - wait) < 1e-3:
                continue
            info.config.ack_wait = wait
            await js.add_consumer(stream, info.config)  # create-or-update of the same durable
            changed.append(durable)
    finally:
        await nc.close()
    return changed


# ---------------------------------------------------------------- the handler table


# The approval events the notifier tells webhooks about (services/notifier).
NOTIFIED_EVENTS = ("ApprovalRequested", "ApprovalGranted", "ApprovalDenied", "ApprovalExpired")


# What a stage's runner publishes for any durable when it gives up on a message
# (runtime/stage.py): not listed per row.
GIVE_UP_EMITS = ("MessageDeadLettered", "CallAbandoned")


@dataclass(frozen=True)
class Handler:
    """One durable consumer: which service reads what, and what it emits.

    `emits`: the names of the messages its handler publishes (event types, `ToolResult`,
    `PendingNotice`, the notifier's `Job`), checked as it publishes (runtime/emits.py)
    and against the service's code (tests/unit/test_stage_emits.py); besides these, any
    durable may give up on a message (GIVE_UP_EMITS). `note`: more, in words, for the docs.
    """

    service: str
    stream: str
    durable: str
    filter_subject: str
    emits: tuple[str, ...]
    note: str = ""


def handlers(tools: list[str], with_audit: bool = False) -> list[Handler]:
    """Every durable the gateway runs, as docs/architecture.md tabulates it."""
    from toolgate.contracts.events import TERMINAL_EVENTS

    evt = subjects.EVENTS_PREFIX
    table = [
        Handler(
            "validator",
            subjects.CALLS_STREAM,
            "validator",
            subjects.CALLS_FILTER,
            ("ArgumentsValidated", "ArgumentsRejected", "MessageDeadLettered", "CallRetried"),
        ),
        Handler(
            "policy",
            subjects.EVENTS_STREAM,
            "policy",
            f"{evt}.ArgumentsValidated.*",
            ("CallAuthorized", "CallDenied", "ApprovalRequested"),
        ),
        Handler(
            "policy",
            subjects.EVENTS_STREAM,
            "policy-approvals",
            f"{evt}.ApprovalGranted.*",
            ("CallAuthorized", "CallDenied"),
        ),
        Handler(
            "approvals",
            subjects.EVENTS_STREAM,
            "approvals",
            f"{evt}.ApprovalRequested.*",
            ("PendingNotice", "ApprovalGranted", "ApprovalDenied", "ApprovalExpired"),
        ),
        *(
            Handler(
                "executor",
                subjects.EVENTS_STREAM,
                f"executor-{tool}",
                f"{evt}.CallAuthorized.{tool}",
                ("ExecutionStarted", "ExecutionSucceeded", "ExecutionFailed", "ExecutionRefused"),
            )
            for tool in sorted(tools)
        ),
        *(
            Handler(
                "attacher",
                subjects.EVENTS_STREAM,
                f"attacher-{kind.__name__}",
                f"{evt}.{kind.__name__}.*",
                ("ToolResult", "ResultAttached"),
            )
            for kind in TERMINAL_EVENTS
        ),
        Handler(
            "attacher",
            subjects.EVENTS_STREAM,
            "attacher-CallRetried",
            f"{evt}.CallRetried.*",
            ("ToolResult", "PendingNotice"),
            "the stored ToolResult or PendingNotice again (not stored again)",
        ),
        *(
            Handler(
                "notifier",
                subjects.EVENTS_STREAM,
                f"notifier-{kind}",
                f"{evt}.{kind}.*",
                ("Job",),
                "a delivery per webhook that hears the tenant (TOOLGATE_NOTIFICATIONS)",
            )
            for kind in NOTIFIED_EVENTS
        ),
        Handler(
            "notifier",
            subjects.NOTIFICATIONS_STREAM,
            NOTIFIER_DELIVERIES_DURABLE,
            f"{subjects.NOTIFY_PREFIX}.>",
            (),
            "a signed webhook POST; MessageDeadLettered when given up",
        ),
    ]
    if with_audit:
        table += [
            Handler("audit", subjects.CALLS_STREAM, "audit", subjects.CALLS_FILTER, ()),
            Handler("audit", subjects.EVENTS_STREAM, "audit", f"{evt}.>", ()),
        ]
    return table


def rows_of(service: str, tools: list[str] | None = None) -> list[Handler]:
    """One service's rows (the executor's: a row per tool of `tools`)."""
    return [h for h in handlers(tools or [], with_audit=True) if h.service == service]
