"""`toolgate policy test DIR`: what a candidate bundle would decide differently.

For each call decided since a time, the recorded decision is the call's first
policy decision (CallAuthorized: allow, CallDenied: deny, ApprovalRequested:
approval), the one made before any approval. The candidate bundle decides the
call again with no approval, at the recorded decision's time, and the two are
compared. Calls whose arguments the audit did not keep, rate-limit denials
(not a policy decision) and tools no longer registered are counted apart.
Reading the recorded decisions and deciding again are cli/redecide.py's, shared
with `toolgate audit replay`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from toolgate.cli.redecide import (
    ALLOW,
    APPROVAL,
    DENY,
    RECORDED_DECISIONS,
    Recorded,
    RecordedClock,
    candidate_kind,
    decide_as_recorded,
    read_recorded,
)
from toolgate.contracts.calls import ErrorCode
from toolgate.contracts.registry import Registry
from toolgate.runtime.timespec import parse_since as parse_since  # one --since format
from toolgate.services.audit.progress import Progress
from toolgate.services.policy.bundle import PolicyBundle
from toolgate.services.policy.engine import CedarEngine
from toolgate.services.policy.rules import Decision

__all__ = ["ALLOW", "APPROVAL", "DENY", "RECORDED_DECISIONS", "Recorded", "read_recorded"]

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
class Outcome:
    recorded: Recorded
    kind: str  # a CHANGE_NAMES value, "approvals N -> M", or one of NOT_CHANGES
    candidate: str = ""
    policy_ids: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.kind not in NOT_CHANGES


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
    decision = decide_as_recorded(engine, spec, recorded.call, recorded, clock)
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
