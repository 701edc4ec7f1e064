"""`toolgate policy test DIR`: what a candidate bundle would decide differently.

For each call decided since a time, the recorded decision is the call's first
policy decision (CallAuthorized: allow, CallDenied: deny, ApprovalRequested:
approval), the one made before any approval. The candidate bundle decides the
call again with no approval, at the recorded decision's time, and the two are
compared. Calls whose arguments the audit did not keep, rate-limit denials
(not a policy decision) and tools no longer registered are counted apart.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from toolgate.contracts.calls import ErrorCode, ToolCall
from toolgate.contracts.registry import Registry
from toolgate.runtime.timespec import parse_since as parse_since  # one --since format
from toolgate.services.audit.progress import Progress
from toolgate.services.audit.replay import REPLAY_PREFIX, recorded_call
from toolgate.services.policy.bundle import PolicyBundle
from toolgate.services.policy.engine import CedarEngine
from toolgate.services.policy.resources import ResourceSeen, recorded_resources
from toolgate.services.policy.rules import Decision

ALLOW, DENY, APPROVAL = "allow", "deny", "approval"
RECORDED_DECISIONS = {"CallAuthorized": ALLOW, "CallDenied": DENY, "ApprovalRequested": APPROVAL}
UNCHANGED = "unchanged"
SKIPPED = "skipped: arguments not stored"
NOT_COMPARABLE = "not comparable: rate limited"
NOT_REGISTERED = "tool not registered"
NOT_CHANGES = (UNCHANGED, SKIPPED, NOT_COMPARABLE, NOT_REGISTERED)
CHANGE_NAMES = {
    (ALLOW, DENY): "allow -> deny",
    (DENY, ALLOW): "deny -> allow",
    (ALLOW, APPROVAL): "allow -> approval (approval newly required)",
    (DENY, APPROVAL): "deny -> approval (approval newly required)",
    (APPROVAL, ALLOW): "approval -> allow (approval no longer required)",
    (APPROVAL, DENY): "approval -> deny (approval no longer required)",
}


@dataclass(frozen=True)
class Recorded:
    call_id: str
    tool: str
    agent: str
    decision: str  # allow | deny | approval
    error_code: str = ""
    required_approvals: int = 0
    call: ToolCall | None = None  # None: arguments not stored (or not decodable)
    at: datetime | None = None  # when it was decided
    # The resources the recorded decision looked up (owner, tenant, ...), so the
    # candidate bundle decides on what was known then, not on today's data.
    resources: list[ResourceSeen] | None = None


@dataclass(frozen=True)
class Outcome:
    recorded: Recorded
    kind: str  # a CHANGE_NAMES value, "approvals N -> M", or one of NOT_CHANGES
    candidate: str = ""
    policy_ids: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.kind not in NOT_CHANGES


def candidate_kind(decision: Decision) -> str:
    if decision.allowed:
        return ALLOW
    return APPROVAL if decision.awaits_approval else DENY


def classify(recorded: Recorded, decision: Decision) -> str:
    new = candidate_kind(decision)
    if new != recorded.decision:
        return CHANGE_NAMES[(recorded.decision, new)]
    if (
        new == APPROVAL
        and recorded.required_approvals
        and recorded.required_approvals != decision.required_approvals
    ):
        return f"approvals {recorded.required_approvals} -> {decision.required_approvals}"
    return UNCHANGED


class RecordedClock:
    """The engine's clock: the time of the decision being replayed."""

    def __init__(self) -> None:
        self.at = datetime.now(UTC)

    def __call__(self) -> float:
        return self.at.timestamp()


def compare(
    recorded: Recorded, engine: CedarEngine, registry: Registry, clock: RecordedClock | None = None
) -> Outcome:
    if recorded.decision == DENY and recorded.error_code == ErrorCode.RATE_LIMITED:
        return Outcome(recorded, NOT_COMPARABLE)
    if recorded.call is None:
        return Outcome(recorded, SKIPPED)
    spec = registry.get(recorded.call.tool)
    if spec is None:
        return Outcome(recorded, NOT_REGISTERED)
    if clock is not None and recorded.at is not None:
        clock.at = recorded.at  # policies that read the time see the recorded one
    decision = engine.decide(recorded.call, spec, resources=recorded.resources)
    return Outcome(
        recorded, classify(recorded, decision), candidate_kind(decision), decision.policy_ids
    )


@dataclass
class Report:
    version: str
    since: datetime
    outcomes: list[Outcome]

    @property
    def changed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.changed]

    def summary(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)

    def by(self, column: str) -> dict[str, Counter[str]]:
        """Counts of changes per tool or per agent."""
        found: dict[str, Counter[str]] = {}
        for o in self.changed:
            found.setdefault(getattr(o.recorded, column) or "-", Counter())[o.kind] += 1
        return dict(sorted(found.items()))

    def examples(self, limit: int) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for o in self.outcomes:
            if o.kind != UNCHANGED:
                ids = found.setdefault(o.kind, [])
                if len(ids) < limit:
                    ids.append(o.recorded.call_id)
        return found

    def to_json(self, limit: int) -> dict[str, Any]:
        return {
            "bundle": self.version,
            "since": self.since.isoformat(),
            "calls": len(self.outcomes),
            "changed": len(self.changed),
            "summary": dict(self.summary()),
            "by_tool": {k: dict(v) for k, v in self.by("tool").items()},
            "by_agent": {k: dict(v) for k, v in self.by("agent").items()},
            "examples": self.examples(limit),
        }

    def text(self, limit: int) -> str:
        lines = [
            f"bundle {self.version}: {len(self.outcomes)} call(s) decided since "
            f"{self.since.isoformat()}, {len(self.changed)} would change"
        ]
        for kind, count in sorted(self.summary().items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {count:>7}  {kind}")
        for column in ("tool", "agent"):
            table = self.by(column)
            if table:
                lines.append(f"changes by {column}:")
                width = max(len(name) for name in table)
                for name, counts in table.items():
                    lines.append(
                        f"  {name:<{width}}  "
                        + ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items()))
                    )
        examples = self.examples(limit)
        if examples and limit > 0:
            lines.append("examples:")
            for kind, ids in sorted(examples.items()):
                lines.append(f"  {kind}: {' '.join(ids)}")
        return "\n".join(lines)


def evaluate_history(
    bundle: PolicyBundle,
    registry: Registry,
    recorded: list[Recorded],
    since: datetime,
    progress: Progress | None = None,
) -> Report:
    clock = RecordedClock()
    engine = CedarEngine(bundle, clock=clock)
    items = progress.counted(recorded) if progress is not None else recorded
    return Report(engine.version, since, [compare(r, engine, registry, clock) for r in items])


# -- reading the audit store -----------------------------------------------------------

_DECIDED_SINCE = (
    "SELECT tenant, agent, call_id FROM events WHERE event_type IN "
    "('CallAuthorized', 'CallDenied', 'ApprovalRequested') "
    "AND occurred_at >= {since:DateTime64(6, 'UTC')} AND call_id != '' "
    f"AND NOT startsWith(call_id, '{REPLAY_PREFIX}')"
)


def read_recorded(client: Any, since: datetime) -> list[Recorded]:
    """Each call's first policy decision since `since`, with the call as validated.

    A call is its (tenant, agent, call_id): the same call_id from two agents is two calls.
    """
    params = {"since": since}
    decisions = client.query(
        "SELECT tenant, agent, call_id, argMin(event_type, occurred_at), "
        "argMin(tool, occurred_at), argMin(error_code, occurred_at), "
        "argMin(payload, occurred_at), min(occurred_at) AS first FROM events "
        "WHERE event_type IN ('CallAuthorized', 'CallDenied', 'ApprovalRequested') "
        f"AND (tenant, agent, call_id) IN ({_DECIDED_SINCE}) GROUP BY tenant, agent, call_id "
        "HAVING first >= {since:DateTime64(6, 'UTC')} ORDER BY first, call_id",
        parameters=params,
    ).result_rows
    validated = {
        tuple(r[:3]): (r[3], r[4])
        for r in client.query(
            "SELECT tenant, agent, call_id, argMax(payload, occurred_at), "
            "argMax(note, occurred_at) "
            "FROM events WHERE event_type = 'ArgumentsValidated' "
            f"AND (tenant, agent, call_id) IN ({_DECIDED_SINCE}) GROUP BY tenant, agent, call_id",
            parameters=params,
        ).result_rows
    }
    found = []
    for tenant, agent, call_id, event_type, tool, code, payload, first in decisions:
        call = None
        if (tenant, agent, call_id) in validated:
            call, _ = recorded_call(*validated[(tenant, agent, call_id)], tenant, agent)
        document = json.loads(payload)
        required = document.get("required_approvals", 0) if event_type == "ApprovalRequested" else 0
        at = first if first.tzinfo else first.replace(tzinfo=UTC)
        found.append(
            Recorded(
                call_id,
                tool,
                agent,
                RECORDED_DECISIONS[event_type],
                code,
                int(required or 0),
                call,
                at,
                recorded_resources(document),
            )
        )
    return found
