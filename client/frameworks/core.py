"""What every framework integration shows a model, as pure functions (no I/O, no framework).

LangChain, LangGraph and the OpenAI Agents SDK all end a tool call the same
way: some text the model reads, flagged as an error or not. This module
decides that text once, from the gateway's `ToolResult` or `PendingNotice`,
so the three integrations cannot drift apart:

- `ok`: the data as JSON (an empty search stays `ok` with `items: []`: the
  seed's "nothing found" is an observation, not an error);
- an error: one text naming the status, the code, whether the tool ran, each
  problem with its JSON pointer, and what the model can do about it. Each
  status has a `Remedy`: `correct` (fix the arguments or pick another tool),
  `retry` (a transient failure the gateway marked retryable), `final` (do not
  try again: denied, a human said no, the tool is broken);
- waiting for a human: an `ApprovalRequest` record that a pause carries (LangGraph's
  interrupt); where the run does not pause, an error (`not_run`) naming the
  call_id: never a success, the tool has not run (DESIGN invariant 13).

`derive_call_id` gives each model tool call a call_id that is bound to the
conversation, the end user, the tool and the exact arguments: a model cannot
name an earlier call's id to be handed its stored result, and the same tool
call re-run after a resume gets the same call_id (so the gateway runs it once).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

import msgspec

from toolgate.contracts.authorization import arguments_sha256, canonical_json
from toolgate.contracts.calls import ErrorCode, PendingNotice, Status, ToolResult
from toolgate.contracts.registry import SIDE_EFFECT_ACTIONS, ToolSpec

Remedy = Literal["none", "correct", "retry", "final"]

# Fix the call (other arguments, another tool) and the model may try again.
CORRECTABLE: Final[frozenset[str]] = frozenset({"invalid_arguments", "unknown_tool"})
# Never worth repeating as it is: a decision, or a broken tool.
FINAL: Final[frozenset[str]] = frozenset(
    {"denied", "approval_denied", "approval_expired", "invalid_tool_result"}
)
# Depends on error.retryable (set by the gateway from the tool's metadata).
MAYBE_TRANSIENT: Final[frozenset[str]] = frozenset({"execution_error", "timeout"})

_RAN: Final[dict[str, str]] = {
    "invalid_arguments": "The tool did not run.",
    "unknown_tool": "The tool did not run.",
    "denied": "The tool did not run.",
    "approval_denied": "The tool did not run: a human refused it.",
    "approval_expired": "The tool did not run: no human decided in time.",
    "execution_error": "The tool started and failed.",
    "timeout": "The tool started and did not finish in time.",
    "invalid_tool_result": "The tool ran, but its output broke its contract; "
    "the output was withheld.",
}
_ADVICE: Final[dict[Remedy, str]] = {
    "correct": "Correct the call (the arguments, or another tool) and call again.",
    "retry": "This may be transient: you may call again later.",
    "final": "Do not call it again with these arguments.",
    "none": "",
}
CALL_ID_PREFIX: Final = "tg_"


def remedy_of(result: ToolResult) -> Remedy:
    """What the model can do about `result`: nothing to (ok), correct, retry, or stop."""
    if result.ok:
        return "none"
    if result.status in CORRECTABLE:
        return "correct"
    if result.status in MAYBE_TRANSIENT:
        return "retry" if result.error is not None and result.error.retryable else "final"
    if result.status == "denied" and result.error is not None and result.error.retryable:
        return "retry"  # RATE_LIMITED, QUOTA_EXCEEDED, POLICY_ERROR: later may differ
    return "final"


@dataclass(frozen=True)
class Observation:
    """What a framework hands the model for one tool call."""

    text: str
    is_error: bool
    status: Status | Literal["approval_pending"]
    remedy: Remedy
    call_id: str


def observe(result: ToolResult, tool: str) -> Observation:
    """The model's view of a final result: data as JSON, or one error text it can act on."""
    if result.ok:
        text = msgspec.json.encode(result.data).decode()
        return Observation(text, False, result.status, "none", result.call_id)
    remedy = remedy_of(result)
    error = result.error
    code = f" ({error.code})" if error is not None else ""
    lines = [f"ERROR {result.status}{code} from tool {tool}, call_id {result.call_id}."]
    if error is not None and error.message:
        lines.append(error.message)
    if error is not None:
        lines += [f"- {d.path or '/'}: {d.message}" for d in error.details]
    lines.append(_RAN.get(result.status, ""))
    lines.append(_ADVICE[remedy])
    text = "\n".join(line for line in lines if line)
    return Observation(text, True, result.status, remedy, result.call_id)


@dataclass(frozen=True)
class ApprovalRequest:
    """A call that waits for a human: what LangGraph's interrupt carries (JSON-ready)."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    arguments_sha256: str
    why: str
    expires_at: str | None
    kind: Literal["toolgate_approval"] = "toolgate_approval"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def approval_request(
    notice: PendingNotice, tool: str, arguments: dict[str, Any]
) -> ApprovalRequest:
    """The approval request of a pending call. The hash is the gateway's (what approvers
    vote on) when the notice carries it, else the hash of the arguments as sent."""
    return ApprovalRequest(
        call_id=notice.call_id,
        tool=tool,
        arguments=arguments,
        arguments_sha256=notice.arguments_sha256 or arguments_sha256(arguments),
        why=notice.message or "a human must approve this call",
        expires_at=notice.expires_at,
    )


def not_run(request: ApprovalRequest) -> Observation:
    """The model's view of a call that waits for a human, where the run cannot pause for it
    (DESIGN invariant 13): an error, never a success, since the tool has not run.

    The call itself stays in the approvals inbox (an agent cannot withdraw it): a human
    may still approve it, and then it runs once in the gateway with its result stored
    under the call_id; or it is refused or expires. The text says so and how to fetch it.
    """
    expiry = f" until {request.expires_at}" if request.expires_at else ""
    text = (
        f"ERROR approval_pending ({ErrorCode.APPROVAL_REQUIRED}) from tool {request.tool}, "
        f"call_id {request.call_id}.\n"
        f"The tool has not run: it waits for a human decision{expiry}: {request.why}.\n"
        "This run did not pause for it, so nothing was done. Do not call it again: "
        "the call stays in the approvals inbox. If a human approves it, it runs once in "
        f"the gateway; read its result later with `toolgate result {request.call_id}`."
    )
    return Observation(text, True, "approval_pending", "final", request.call_id)


def derive_call_id(
    namespace: str, tool_call_id: str, tool: str, arguments: dict[str, Any], user: str
) -> str:
    """The toolgate call_id of one model tool call, in one conversation (`namespace`).

    The same tool call (same id, tool and arguments, in the same conversation for
    the same user) always maps to the same call_id, so running it again (a graph
    resumed in another process) is answered from the gateway's stored result. Any
    difference gives another call_id, so a model that copies another call's id
    gets a call of its own, never that call's result.
    """
    material = canonical_json([namespace, user, tool_call_id, tool, arguments_sha256(arguments)])
    return CALL_ID_PREFIX + hashlib.sha256(material).hexdigest()[:40]


def may_need_a_human(spec: ToolSpec) -> bool:
    """Whether the registry alone says a call of this tool can wait for a human: it is
    declared `requires_approval`, it is `critical`, or it is a `high`-risk side effect
    (the policy engine's floor). A policy can still ask for a human on any other call."""
    if spec.requires_approval or spec.risk == "critical":
        return True
    return spec.risk == "high" and spec.action_class in SIDE_EFFECT_ACTIONS
