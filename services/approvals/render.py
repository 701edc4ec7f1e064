"""Showing an approval to a human, safely: as text in a terminal, as HTML in the inbox.

Arguments come from a model. Whatever they hold is shown as data: control
and invisible formatting characters (ANSI escapes, bidi overrides that make
text read differently than it is) become visible `\\uXXXX` escapes, and in
HTML everything is escaped as well.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from toolgate.runtime.outside_text import visible, visible_json
from toolgate.services.approvals.protocol import ApprovalView

__all__ = ["as_text", "pretty_arguments", "visible", "votes_line"]


def pretty_arguments(arguments: Any) -> str:
    """Indented, key-sorted JSON; every string readable, nothing hidden."""
    return visible_json(arguments, indent=2, sort_keys=True)


def time_left(expires_at: datetime, now: datetime) -> str:
    seconds = int((expires_at - now).total_seconds())
    if seconds <= 0:
        return "expired"
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"in {hours}h {minutes}m"
    if minutes:
        return f"in {minutes}m {seconds}s"
    return f"in {seconds}s"


def votes_line(state: ApprovalView) -> str:
    approvers = state.approvers
    text = f"{len(approvers)} of {state.required_approvals}"
    if approvers:
        text += " (" + ", ".join(visible(a) for a in approvers) + ")"
    denials = [v for v in state.votes if v.decision == "deny"]
    if denials:
        text += "; denied by " + ", ".join(visible(v.approver) for v in denials)
    return text


def as_text(state: ApprovalView, now: datetime) -> str:
    """The block `toolgate approvals list/show` prints for one call (headed by its call
    key, TENANT.AGENT.CALL_ID, which `approve` and `deny` take)."""
    p = state.call.principal
    lines = [
        f"{visible(state.key)}  {visible(state.call.tool)}  risk={visible(state.risk)}  "
        f"[{state.status}]",
        f"  requester:  {visible(state.requester)} (tenant {visible(p.tenant)}, "
        f"agent {visible(p.agent)}, session {visible(p.session)}"
        + (f", task {visible(state.call.task_id)}" if state.call.task_id else "")
        + ")",
        f"  policy:     {visible(state.policy_version)}"
        + (f" ({', '.join(visible(i) for i in state.policy_ids)})" if state.policy_ids else ""),
    ]
    if state.request_reason:
        lines.append(f"  why:        {visible(state.request_reason)}")
    lines += [
        f"  expires:    {state.expires_at.isoformat()} ({time_left(state.expires_at, now)})",
        f"  approvals:  {votes_line(state)}",
        f"  sha256:     {state.arguments_sha256}",
        "  arguments:",
    ]
    lines += ["    " + line for line in pretty_arguments(state.call.arguments).splitlines()]
    for vote in state.votes:
        lines.append(
            f"  vote:       {vote.decision} by {visible(vote.approver)} at "
            f"{vote.at.isoformat()}: {visible(vote.reason)}"
        )
    return "\n".join(lines)
