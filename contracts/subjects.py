"""Subjects, streams and buckets, declared as data. Handlers never spell a subject.

Public (agents depend on them; wire contract v2, identity from the bus):

- `toolgate.calls.<tenant>.<agent>`: where an agent publishes its calls. The
  server lets each agent identity publish only to its own subject, so the
  validator reads tenant and agent from the subject, never from the payload.
- `toolgate.results.<tenant>.<agent>.<call_id>`: the one final ToolResult,
  stored once; `...<call_id>.pending` while a human decides.

Everything under `toolgate.evt.` is internal: `toolgate.evt.<EventType>.<tool>`,
so a consumer can filter by event and by tool (one executor durable per tool).
"""

from __future__ import annotations

import re
from typing import Final

from .events import Event

TOOL_NAME_PATTERN: Final = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
# Tenant and agent names are subject tokens (and KV key parts): no dots, no wildcards.
IDENTITY_TOKEN_PATTERN: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

CALLS_PREFIX: Final = "toolgate.calls"
RESULTS_PREFIX: Final = "toolgate.results"
EVENTS_PREFIX: Final = "toolgate.evt"
APPROVALS_PREFIX: Final = "toolgate.approvals"
# The notifier's own deliveries (one message per notification and webhook); internal.
NOTIFY_PREFIX: Final = "toolgate.notify"
UNKNOWN_TOOL_TOKEN: Final = "_unknown"
PENDING_SUFFIX: Final = "pending"

CALLS_STREAM: Final = "TOOLGATE_CALLS"
EVENTS_STREAM: Final = "TOOLGATE_EVENTS"
RESULTS_STREAM: Final = "TOOLGATE_RESULTS"
# A work queue of webhook deliveries: a message stays until delivered or given up.
NOTIFICATIONS_STREAM: Final = "TOOLGATE_NOTIFICATIONS"
# The audit sinks' signed checkpoints, kept where the ClickHouse writer cannot delete
# them: no message of this stream can be deleted or purged (deny_delete, deny_purge).
AUDIT_SEALS_STREAM: Final = "TOOLGATE_AUDIT_SEALS"
AUDIT_SEALS_SUBJECT: Final = "toolgate.audit.seals"
OUTCOMES_BUCKET: Final = "toolgate_outcomes"
CALL_IDS_BUCKET: Final = "toolgate_call_ids"
EVIDENCE_BUCKET: Final = "toolgate_evidence"
APPROVALS_BUCKET: Final = "toolgate_approvals"
POLICIES_BUCKET: Final = "toolgate_policies"
# The last bundle the policy service accepted (its high-water mark): only the policy
# role (and the operator) may write it, so a bucket writer cannot lower it.
POLICY_ACCEPTED_BUCKET: Final = "toolgate_policy_accepted"
RATE_LIMITS_BUCKET: Final = "toolgate_rate_limits"
# (tenant, agent, call_id) -> the end user's access token, sealed (AES-GCM) by the
# validator for the executor alone (runtime/user_tokens.py); never the token in clear.
USER_TOKENS_BUCKET: Final = "toolgate_user_tokens"
# The served tool registry (`toolgate tools push`, runtime/served_registry.py), and the
# validator's record of the last one it accepted (its high-water mark: only it writes it).
REGISTRY_BUCKET: Final = "toolgate_registry"
REGISTRY_ACCEPTED_BUCKET: Final = "toolgate_registry_accepted"
# An agent asks for its own tool listing on TOOLS_PREFIX.<tenant>.<agent> (request/reply;
# the validator answers, taking who asks from the subject the server let it publish on).
TOOLS_PREFIX: Final = "toolgate.tools"

# Every call of every agent (what the validator and the audit consume).
CALLS_FILTER: Final = f"{CALLS_PREFIX}.*.*"


def is_identity_token(value: object) -> bool:
    return isinstance(value, str) and IDENTITY_TOKEN_PATTERN.fullmatch(value) is not None


def calls_subject(tenant: str, agent: str) -> str:
    """The one subject this agent may publish its calls to."""
    return f"{CALLS_PREFIX}.{tenant}.{agent}"


def identity_of_calls_subject(subject: str) -> tuple[str, str] | None:
    """(tenant, agent) of `toolgate.calls.<tenant>.<agent>`, or None if it is not one."""
    prefix = CALLS_PREFIX + "."
    if not subject.startswith(prefix):
        return None
    parts = subject[len(prefix) :].split(".")
    if len(parts) != 2 or not all(is_identity_token(p) for p in parts):
        return None
    return parts[0], parts[1]


def agent_results_prefix(tenant: str, agent: str) -> str:
    """Everything under here belongs to this agent alone."""
    return f"{RESULTS_PREFIX}.{tenant}.{agent}"


def tools_listing_subject(tenant: str, agent: str) -> str:
    """Where an agent asks for the tools it may call (only its own: a locked bus lets it
    publish on no other agent's)."""
    return f"{TOOLS_PREFIX}.{tenant}.{agent}"


def identity_of_tools_subject(subject: str) -> tuple[str, str] | None:
    """(tenant, agent) of a tools_listing_subject, or None if it is not one."""
    prefix = TOOLS_PREFIX + "."
    if not subject.startswith(prefix):
        return None
    parts = subject[len(prefix) :].split(".")
    if len(parts) != 2 or not all(is_identity_token(p) for p in parts):
        return None
    return parts[0], parts[1]


def results_subject(tenant: str, agent: str, call_id: str) -> str:
    return f"{agent_results_prefix(tenant, agent)}.{call_id}"


def pending_subject(tenant: str, agent: str, call_id: str) -> str:
    return f"{results_subject(tenant, agent, call_id)}.{PENDING_SUFFIX}"


def notification_subject(tenant: str, webhook_id: str) -> str:
    """Where the notifier queues one delivery of `tenant`'s call to one webhook."""
    return f"{NOTIFY_PREFIX}.{tenant}.{webhook_id}"


def direct_get_prefix(stream: str) -> str:
    """JetStream's subject-scoped read of a stored message: `<this>.<subject>`."""
    return f"$JS.API.DIRECT.GET.{stream}"


def call_key(tenant: str, agent: str, call_id: str) -> str:
    """A call's identity: (tenant, agent, call_id). Also its KV key (dots are allowed there)."""
    return f"{tenant}.{agent}.{call_id}"


def event_subject(event_type: type[Event] | str, tool: str) -> str:
    name = event_type if isinstance(event_type, str) else event_type.__name__
    # A tool name the model invented may hold dots or wildcards: never put it in a subject.
    token = tool if TOOL_NAME_PATTERN.fullmatch(tool) else UNKNOWN_TOOL_TOKEN
    return f"{EVENTS_PREFIX}.{name}.{token}"


def event_filter(event_type: type[Event], tool: str = "*") -> str:
    """The subject filter a consumer of `event_type` (for one tool, or all) uses."""
    return f"{EVENTS_PREFIX}.{event_type.__name__}.{tool}"


def subject_of(event: Event) -> str:
    return event_subject(type(event), event.tool)
