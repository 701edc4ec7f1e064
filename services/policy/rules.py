"""The policy engine seam: `decide(call, spec) -> Decision`, deterministic, deny by default.

The Cedar engine (engine.py) implements it; the service (app.py) depends only
on this protocol. No model takes part in a decision; any error is a deny.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from toolgate.contracts.calls import Status, ToolCall, ToolError
from toolgate.contracts.registry import ToolSpec


@dataclass(frozen=True)
class Decision:
    allowed: bool
    policy_version: str
    # The policies that decided: the permits of an allow, the forbids of a deny.
    policy_ids: list[str] = field(default_factory=list)
    status: Status = "denied"
    error: ToolError | None = None
    # Set when approval policies gate the call: not allowed until
    # `required_approvals` distinct approvers said yes; allowed once they have.
    requires_approval: bool = False
    required_approvals: int = 0
    # Why a human must approve, in the approval policies' own words (their @reason);
    # empty when none gives one. What an approver reads as "why".
    approval_reason: str = ""

    @property
    def awaits_approval(self) -> bool:
        return self.requires_approval and not self.allowed


class PolicyEngine(Protocol):
    version: str

    def decide(
        self, call: ToolCall, spec: ToolSpec | None, approvers: Sequence[str] = ()
    ) -> Decision: ...
