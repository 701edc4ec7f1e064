"""Showing an approval to a human, safely: as text in a terminal, as HTML in the inbox.

Arguments come from a model. Whatever they hold is shown as data: control
and invisible formatting characters (ANSI escapes, bidi overrides that make
text read differently than it is) become visible `\\uXXXX` escapes, and in
HTML everything is escaped as well.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from toolgate.runtime.outside_text import visible, visible_json
from toolgate.services.approvals.protocol import ApprovalView

__all__ = ["as_text", "duplicates", "pretty_arguments", "utc_text", "visible", "votes_line"]


def utc_text(moment: datetime) -> str:
    """A time as the inbox prints it server-side: UTC, to the second (a script adds the
    approver's own zone beside it)."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duplicates(states: Iterable[ApprovalView]) -> dict[str, list[str]]:
    """For each pending call, the other pending calls with the same tenant, agent, tool
    and arguments hash: likely a client's retry of one call (keys absent: none)."""
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for state in states:
        if state.status != "pending":
            continue
        same = (state.tenant, state.agent, state.call.tool, state.arguments_sha256)
        groups.setdefault(same, []).append(state.key)
    found: dict[str, list[str]] = {}
    for keys in groups.values():
        if len(keys) > 1:
            for key in keys:
                found[key] = sorted(k for k in keys if k != key)
    return found


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


def _tool_lines(state: ApprovalView) -> list[str]:
    """The registry's word on the tool: what it does; for an upstream MCP tool, its server
    and pinned definition."""
    info = state.tool_info
    if info is None:
        return []
    lines = [f"  tool:       {visible(' '.join(info.description.split()))}"]
    if info.server:
        lines.append(
            f"  upstream:   {visible(info.server)} (tool {visible(info.upstream_tool)}, "
            f"pinned sha256 {visible(info.pin)})"
        )
    return lines


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
        *_tool_lines(state),
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
