"""`toolgate audit trace CALL_ID`: one call's story, in order, from the `events` view.

A call is (tenant, agent, call_id): two agents may use the same call_id for
two calls, and then the sender must be named (`--tenant`, `--agent`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from clickhouse_connect.driver.client import Client

from toolgate.contracts.calls import ErrorCode
from toolgate.runtime.outside_text import visible
from toolgate.services.audit.rows import CONTENT_COLUMNS, to_micros

# What a trace shows of each event: the recorded columns, without the call's own
# id (the trace is of one call) and the stream position it was read from.
TRACE_COLUMNS = tuple(
    c for c in CONTENT_COLUMNS if c not in ("call_id", "source_stream", "source_seq")
)

# Ties in time (same microsecond) are broken by the stage a type belongs to.
STAGE = {
    "CallRequested": 0,
    "ArgumentsValidated": 1,
    "ArgumentsRejected": 1,
    "MessageDeadLettered": 1,
    "UndecodableEvent": 1,
    "CallAuthorized": 2,
    "CallDenied": 2,
    "ApprovalRequested": 2,
    "ApprovalGranted": 3,
    "ApprovalDenied": 3,
    "ApprovalExpired": 3,
    "ExecutionStarted": 4,
    "ExecutionRefused": 4,
    "ExecutionSucceeded": 5,
    "ExecutionFailed": 5,
    "CallAbandoned": 5,
    "ResultAttached": 6,
    "CallRetried": 7,
}
OUTPUT_CHECKED = ("ok", "invalid_tool_result")


@dataclass(frozen=True)
class TraceStep:
    offset_ms: float
    occurred_at: datetime
    event_type: str
    service: str
    text: str


def read_call_events(
    client: Client, call_id: str, tenant: str | None = None, agent: str | None = None
) -> list[dict[str, Any]]:
    """The events of `call_id`; of one sender's call when `tenant` / `agent` are given."""
    where, params = ["call_id = {call_id:String}"], {"call_id": call_id}
    for column, value in (("tenant", tenant), ("agent", agent)):
        if value:
            where.append(f"{column} = {{{column}:String}}")
            params[column] = value
    result = client.query(
        f"SELECT {', '.join(TRACE_COLUMNS)} FROM events WHERE {' AND '.join(where)}",
        parameters=params,
    )
    rows = [dict(zip(TRACE_COLUMNS, r, strict=True)) for r in result.result_rows]
    rows.sort(key=lambda r: (r["occurred_at"], STAGE.get(r["event_type"], 9)))
    return rows


# The events whose arguments hash is the one the call's answers name.
CHECKED = ("ArgumentsValidated", "ArgumentsRejected")


def senders(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The (tenant, agent) pairs these rows name: more than one, and a call_id was reused
    by several agents (each its own call)."""
    return sorted({(r["tenant"], r["agent"]) for r in rows if r["tenant"] or r["agent"]})


def story(rows: list[dict[str, Any]]) -> list[TraceStep]:
    if not rows:
        return []
    start = to_micros(rows[0]["occurred_at"])
    checked = called(rows)
    steps = []
    for row in rows:
        offset = (to_micros(row["occurred_at"]) - start) / 1000.0
        for text in describe(row, checked):
            steps.append(
                TraceStep(offset, row["occurred_at"], row["event_type"], row["service"], text)
            )
    return steps


def called(rows: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(tool, arguments_sha256) of the call these rows tell, as the validator checked it
    (what its answers name); None when no row of the check records the hash."""
    for row in rows:
        if row["event_type"] in CHECKED and row.get("arguments_sha256"):
            return row["tool"], row["arguments_sha256"]
    return None


def describe(row: dict[str, Any], call: tuple[str, str] | None = None) -> list[str]:
    """What an auditor reads for one event (some events tell two steps); `call`: the
    (tool, arguments_sha256) of the call the rows tell (`called`)."""
    payload = _payload(row)
    kind, error = row["event_type"], payload.get("error") or {}
    policy = f"policy {row['policy_version']}" + (
        f", rules {','.join(payload['policy_ids'])}" if payload.get("policy_ids") else ""
    )
    note = f" [{row['note']}]" if row["note"] else ""
    if kind == "CallRequested":
        args = (
            f"arguments sha256 {row['arguments_sha256'][:16]}"
            if row["arguments_sha256"]
            else "arguments not recorded"
        )
        return [
            f"requested {row['tool'] or '?'} by agent {row['agent'] or '?'} for user "
            f"{row['user'] or '?'} (tenant {row['tenant'] or '?'}, session "
            f"{row['session'] or '?'}, task {row['task_id'] or '-'}); {args}{note}"
        ]
    if kind == "ArgumentsValidated":
        return [f"arguments validated against the input_schema of {row['tool']}"]
    if kind == "ArgumentsRejected":
        return [
            f"arguments rejected: {row['status']} {row['error_code']}: {error.get('message', '')}"
        ]
    if kind == "CallAuthorized":
        return [f"policy decision: allowed ({policy})"]
    if kind == "CallDenied":
        return [
            f"policy decision: denied {row['error_code']} ({policy}): {error.get('message', '')}"
        ]
    if kind == "ApprovalRequested":
        return [
            f"approval requested: risk {payload.get('risk', '?')}, "
            f"{payload.get('required_approvals', 1)} approval(s), expires "
            f"{payload.get('expires_at', '?')} ({policy})"
        ]
    if kind == "ApprovalGranted":
        quorum = ", quorum reached" if payload.get("quorum_reached") else ""
        reason = payload.get("reason") or ""
        return [
            f"approval granted by {row['approver']}{quorum}" + (f": {reason}" if reason else "")
        ]
    if kind == "ApprovalDenied":
        return [f"approval denied by {row['approver']}: {payload.get('reason', '')}"]
    if kind == "ApprovalExpired":
        return ["approval expired: nobody decided in time"]
    if kind == "ExecutionStarted":
        return [
            f"execution started (attempt {payload.get('attempt', '?')}, worker "
            f"{payload.get('worker', '?')})"
        ]
    if kind in ("ExecutionSucceeded", "ExecutionFailed"):
        how = (
            "succeeded"
            if kind == "ExecutionSucceeded"
            else f"failed: {row['status']} {row['error_code']}"
        )
        replayed = " (recorded outcome replayed, not run again)" if payload.get("replayed") else ""
        return [f"execution finished, {how}, in {row['duration_ms'] or 0:.1f} ms{replayed}"]
    if kind == "ExecutionRefused":
        return [f"execution refused: {payload.get('reason', '')}"]
    if kind == "ResultAttached":
        lines = []
        if row["status"] in OUTPUT_CHECKED:
            if row["error_code"] == ErrorCode.OUTPUT_TOO_LARGE:
                lines.append("result withheld: the tool's output was larger than a result may be")
            else:
                verdict = (
                    "valid"
                    if row["status"] == "ok"
                    else f"INVALID ({row['error_code']}): the tool's output broke its output_schema"
                )
                lines.append(f"result checked against the output_schema: {verdict}")
        return lines + [
            f"result attached: {row['status']}"
            + (f" {row['error_code']}" if row["error_code"] else "")
            + _provenance(payload)
        ]
    if kind == "MessageDeadLettered":
        return [f"dead-lettered: {payload.get('reason', '')}"]
    if kind == "CallAbandoned":
        return [f"{row['service']} gave up on the call: {error.get('message', '')}"]
    if kind == "CallRetried":
        if (
            call is not None
            and row.get("arguments_sha256")
            and ((row["tool"], row["arguments_sha256"]) != call)
        ):
            return [
                f"the agent sent this call_id again for another call ({row['tool']}, arguments "
                f"sha256 {row['arguments_sha256'][:16]}): not a retry, nothing run; never "
                "given this call's answer (CALL_ID_REUSED once it has its result)"
            ]
        return ["the agent sent this call_id again: nothing run again, its answer sent again"]
    return [f"{kind}{note}"]


def _provenance(payload: dict[str, Any]) -> str:
    """Where an upstream tool's result came from (its server and tool), as recorded."""
    result = payload.get("result")
    provenance = result.get("provenance") if isinstance(result, dict) else None
    if not isinstance(provenance, dict):
        return ""
    return (
        f", content from upstream {provenance.get('source', '?')} server "
        f"{provenance.get('server', '?')} tool {provenance.get('tool', '?')} "
        f"({provenance.get('trust', 'untrusted')})"
    )


def _payload(row: dict[str, Any]) -> dict[str, Any]:
    try:
        value = json.loads(row["payload"] or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def format_trace(call_id: str, steps: list[TraceStep]) -> str:
    """The trace as a person reads it: users, tools, reasons and messages came from
    outside, so each line shows its control and bidi characters as escapes."""
    if not steps:
        return f"no audit events for call {visible(call_id)}"
    lines = [f"call {visible(call_id)}"]
    for step in steps:
        stamp = step.occurred_at.strftime("%Y-%m-%d %H:%M:%S.%f")
        lines.append(
            f"  {stamp}  +{step.offset_ms:9.1f} ms  {visible(step.service):<10} "
            f"{visible(step.text)}"
        )
    return "\n".join(lines)
