"""Deciding recorded calls again, here: nothing is published, no tool runs, no event is written.

Shared by `toolgate policy test` (the policy step of calls that reached it, under
a candidate bundle) and `toolgate audit replay` (every step before a tool runs,
under today's registry and today's active bundle):

    validation  the validator's own pure check (CallChecker): registry lookup,
                identity from the bus, JSON Schema, normalisation
    policy      the policy engine (CedarEngine.decide) of the bundle, which also
                applies the approval rule (approval policies and the registry's
                requires_approval / risk): allow, deny, or N approvers needed

What is compared is the gate's verdict before anything ran: its kind (rejected
by validation, denied, approval required, allowed), the status and error code
of a refusal, the policies that decided, and the approvers needed. Rate limits
are not re-counted (a rate-limit denial was not a policy decision), and what
humans later said (granted, denied, expired) is theirs, not the gate's.

Resources and time are the recorded ones, not today's: each call is decided
again on what its entity providers said at decision time (the decision event
keeps it) and at the recorded decision's time. A replay is asked "would
today's rules decide this call differently?"; deciding on today's data
(an order that has since changed hands, a clock past office hours) would
report a change in the data as a change in the rules, and would make the
replay reach the providers' databases and services. A tool that declares
resources now but did not then has nothing recorded to decide on: today's
engine denies it, which shows up as a change (the registry changed).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from toolgate.contracts.calls import ErrorCode, ToolCall
from toolgate.contracts.registry import ToolSpec
from toolgate.services.audit.replay import REPLAY_PREFIX, recorded_call
from toolgate.services.policy.bundle import read_bundle_dir
from toolgate.services.policy.bundle_store import POLICIES_BUCKET, fetch_active
from toolgate.services.policy.engine import CedarEngine, engine_from_files
from toolgate.services.policy.resources import ResourceSeen, recorded_resources
from toolgate.services.policy.rules import Decision
from toolgate.services.validator.logic import CallChecker, Identity, Rejected, Validated

ALLOW, DENY, APPROVAL, REJECTED = "allow", "deny", "approval", "rejected"
POLICY_EVENTS = {"CallAuthorized": ALLOW, "CallDenied": DENY, "ApprovalRequested": APPROVAL}
RECORDED_DECISIONS = {"ArgumentsRejected": REJECTED, **POLICY_EVENTS}


@dataclass(frozen=True)
class Recorded:
    """A call's first decision as the audit keeps it (before any approval)."""

    call_id: str
    tool: str
    agent: str
    decision: str  # allow | deny | approval | rejected (validation)
    error_code: str = ""
    required_approvals: int = 0
    call: ToolCall | None = None  # as validated; None: arguments not stored (or not decodable)
    at: datetime | None = None  # when it was decided
    # The resources the recorded decision looked up (owner, tenant, ...), so it is
    # decided again on what was known then, not on today's data.
    resources: list[ResourceSeen] | None = None
    tenant: str = ""
    status: str = ""
    policy_ids: Sequence[str] = ()
    policy_version: str = ""


def candidate_kind(decision: Decision) -> str:
    if decision.allowed:
        return ALLOW
    return APPROVAL if decision.awaits_approval else DENY


class RecordedClock:
    """The engine's clock: the time of the decision being replayed."""

    def __init__(self) -> None:
        self.at = datetime.now(UTC)

    def __call__(self) -> float:
        return self.at.timestamp()


def decide_as_recorded(
    engine: CedarEngine,
    spec: ToolSpec | None,
    call: ToolCall,
    recorded: Recorded | None,
    clock: RecordedClock | None,
) -> Decision:
    """The engine's decision on `call`, at the recorded time, on the recorded resources."""
    if clock is not None and recorded is not None and recorded.at is not None:
        clock.at = recorded.at  # policies that read the time see the recorded one
    return engine.decide(call, spec, resources=recorded.resources if recorded else None)


# -- the verdict, then and now ----------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What the gate decided on a call before anything ran: the compared part."""

    kind: str  # rejected | deny | approval | allow
    status: str = ""  # a refusal's result status ("" while the call may still run)
    error_code: str = ""
    policy_ids: tuple[str, ...] = ()
    required_approvals: int = 0

    def text(self) -> str:
        ids = f" by {', '.join(self.policy_ids)}" if self.policy_ids else ""
        if self.kind == ALLOW:
            return f"allowed{ids}"
        if self.kind == APPROVAL:
            return f"approval required ({self.required_approvals} approver(s)){ids}"
        stage = "rejected by validation" if self.kind == REJECTED else "denied"
        return f"{stage}: {self.status or '-'} {self.error_code or '-'}{ids}"


def recorded_verdict(recorded: Recorded) -> Verdict:
    refused = recorded.decision in (DENY, REJECTED)
    return Verdict(
        recorded.decision,
        recorded.status if refused else "",
        recorded.error_code if refused else "",
        tuple(sorted(recorded.policy_ids)),
        recorded.required_approvals if recorded.decision == APPROVAL else 0,
    )


def verdict_of(decision: Decision) -> Verdict:
    """The policy service's verdict on an engine decision (logic.after_validation's choice)."""
    kind = candidate_kind(decision)
    code = decision.error.code if decision.error else ErrorCode.POLICY_DENIED
    return Verdict(
        kind,
        decision.status if kind == DENY else "",
        code if kind == DENY else "",
        tuple(sorted(decision.policy_ids)),
        decision.required_approvals if kind == APPROVAL else 0,
    )


def differences(then: Verdict, now: Verdict) -> list[str]:
    """What changed, field by field ([] when nothing did)."""
    found = []
    for name, old, new in (
        ("decision", then.kind, now.kind),
        ("status", then.status, now.status),
        ("error code", then.error_code, now.error_code),
        ("policies", ", ".join(then.policy_ids), ", ".join(now.policy_ids)),
        ("approvers needed", then.required_approvals, now.required_approvals),
    ):
        if old != new:
            found.append(f"{name} {old or '-'} -> {new or '-'}")
    return found


def decide_again(
    published: dict[str, Any],
    identity: Identity,
    checker: CallChecker,
    engine: CedarEngine,
    recorded: Recorded | None,
    clock: RecordedClock | None = None,
) -> Verdict:
    """Today's verdict on a call as it was published by `identity`: validated by the
    validator's check, then decided by the engine (at the recorded time, on the
    recorded resources)."""
    outcome = checker.check(json.dumps(published).encode(), identity)
    if isinstance(outcome, Rejected):
        return Verdict(REJECTED, outcome.status, outcome.error.code)
    if not isinstance(outcome, Validated):
        return Verdict(REJECTED, "-", "DEAD_LETTER")  # no result at all: a dead letter
    call = outcome.call
    return verdict_of(
        decide_as_recorded(engine, checker.registry.get(call.tool), call, recorded, clock)
    )


@dataclass(frozen=True)
class Redecided:
    """One recorded call decided again: the verdicts then and now, or why it cannot be."""

    tenant: str
    agent: str
    call_id: str
    tool: str
    then: Verdict | None = None
    now: Verdict | None = None
    why_not: str = ""  # why the two cannot be compared
    then_version: str = ""  # the bundle the recorded decision was made under

    @property
    def same(self) -> bool | None:
        """Whether today's verdict is the recorded one (None: not comparable)."""
        if self.then is None or self.now is None:
            return None
        return not differences(self.then, self.now)

    def text(self, today_version: str) -> str:
        head = f"{self.tenant}.{self.agent} {self.call_id} ({self.tool or '?'})"
        lines = []
        if self.then is not None:
            under = f" under bundle {self.then_version}" if self.then_version else ""
            lines.append(f"  recorded: {self.then.text()}{under}")
        if self.now is not None:
            lines.append(f"  today:    {self.now.text()} under bundle {today_version}")
        if self.same is None:
            verdict = f"NOT COMPARED decision: {self.why_not}"
        elif self.same:
            verdict = "SAME decision"
        else:
            assert self.then is not None and self.now is not None
            verdict = "DIFFERENT decision: " + "; ".join(differences(self.then, self.now))
        return "\n".join([f"{head}: {verdict}", *lines])


def redecide(
    published: dict[str, Any] | None,
    why_not: str,
    identity: Identity,
    recorded: Recorded | None,
    checker: CallChecker,
    engine: CedarEngine,
    clock: RecordedClock,
    call_id: str,
    tool: str,
) -> Redecided:
    """One call decided again and set beside its recorded decision."""
    key: dict[str, Any] = {
        "tenant": identity.tenant,
        "agent": identity.agent,
        "call_id": call_id,
        "tool": tool,
    }
    then = recorded_verdict(recorded) if recorded is not None else None
    version = recorded.policy_version if recorded is not None else ""
    if published is None:
        return Redecided(**key, then=then, why_not=why_not, then_version=version)
    now = decide_again(published, identity, checker, engine, recorded, clock)
    if recorded is None:
        why = "no decision was recorded for it (still in flight, or dead-lettered)"
        return Redecided(**key, now=now, why_not=why)
    if recorded.decision == DENY and recorded.error_code == ErrorCode.RATE_LIMITED:
        why = "it was rate limited (not a policy decision; rate limits are not counted again)"
        return Redecided(**key, now=now, why_not=why, then_version=version)
    return Redecided(**key, then=then, now=now, then_version=version)


# -- reading the audit store -----------------------------------------------------------

_DECIDED_SINCE = (
    "SELECT tenant, agent, call_id FROM events WHERE event_type IN "
    "('CallAuthorized', 'CallDenied', 'ApprovalRequested') "
    "AND occurred_at >= {since:DateTime64(6, 'UTC')} AND call_id != '' "
    f"AND NOT startsWith(call_id, '{REPLAY_PREFIX}')"
)


def read_recorded(
    client: Any, since: datetime | None = None, call_ids: Sequence[str] | None = None
) -> list[Recorded]:
    """Each call's first decision, with the call as validated: the policy decisions made
    since `since` (what `policy test` compares), or, given `call_ids`, the first decision
    of each of those calls, a validation rejection included (what `audit replay` compares).

    A call is its (tenant, agent, call_id): the same call_id from two agents is two calls.
    """
    params: dict[str, Any]
    if call_ids is not None:
        types, params = RECORDED_DECISIONS, {"ids": list(call_ids)}
        chosen, having = "call_id IN {ids:Array(String)}", ""
    else:
        assert since is not None
        types, params = POLICY_EVENTS, {"since": since}
        chosen = f"(tenant, agent, call_id) IN ({_DECIDED_SINCE})"
        having = "HAVING first >= {since:DateTime64(6, 'UTC')} "
    listed = ", ".join(f"'{t}'" for t in types)
    decisions = client.query(
        "SELECT tenant, agent, call_id, argMin(event_type, occurred_at), "
        "argMin(tool, occurred_at), argMin(error_code, occurred_at), "
        "argMin(payload, occurred_at), min(occurred_at) AS first, "
        "argMin(status, occurred_at), argMin(policy_version, occurred_at) FROM events "
        f"WHERE event_type IN ({listed}) AND {chosen} GROUP BY tenant, agent, call_id "
        f"{having}ORDER BY first, call_id",
        parameters=params,
    ).result_rows
    validated = {
        tuple(r[:3]): (r[3], r[4])
        for r in client.query(
            "SELECT tenant, agent, call_id, argMax(payload, occurred_at), "
            "argMax(note, occurred_at) "
            f"FROM events WHERE event_type = 'ArgumentsValidated' AND {chosen} "
            "GROUP BY tenant, agent, call_id",
            parameters=params,
        ).result_rows
    }
    found = []
    for row in decisions:
        tenant, agent, call_id, event_type, tool, code, payload, first, status, version = row
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
                tenant=tenant,
                status=status,
                policy_ids=[str(p) for p in document.get("policy_ids") or []],
                policy_version=version,
            )
        )
    return found


# -- today's active bundle -------------------------------------------------------------


@dataclass(frozen=True)
class ActiveBundle:
    engine: CedarEngine
    source: str  # where it came from, for the operator


async def load_active_bundle(js: JetStreamContext, keys_dir: Path, local_dir: Path) -> ActiveBundle:
    """Today's active bundle, read from the policies bucket (never created or written here)
    and judged by the policy service's own ActivePolicy, as a starting replica judges it:
    signature, validity, and the local bundle only if nothing was ever pushed.
    PolicyStateError (its `reason` one line) if a starting replica would refuse it;
    BundleError if the local bundle is broken."""
    from toolgate.services.policy.app import ActivePolicy, where

    local = engine_from_files(read_bundle_dir(local_dir))
    try:
        kv = await js.key_value(POLICIES_BUCKET)
    except NotFoundError:
        entry = None  # no bucket: nothing was ever pushed
    else:
        entry = await fetch_active(kv)
    policy = ActivePolicy(local, keys_dir)
    quiet = logging.NullHandler()  # the service's log lines are for the service's log
    logging.getLogger("toolgate.policy").addHandler(quiet)
    try:
        policy.start(entry)
    finally:
        logging.getLogger("toolgate.policy").removeHandler(quiet)
    if entry is None:
        return ActiveBundle(policy.engine, f"the local bundle {local_dir}: none was ever pushed")
    return ActiveBundle(policy.engine, where(entry))
