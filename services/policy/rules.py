"""The registry's rules as a policy engine: deterministic, deny by default.

`PolicyEngine` is the seam: a Cedar-backed engine implements the same
`decide()` and the service does not change. No model takes part in a
decision; any error is a deny.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from toolgate.contracts.calls import ErrorCode, Status, ToolCall, ToolError
from toolgate.contracts.registry import Registry, ToolSpec


@dataclass(frozen=True)
class Decision:
    allowed: bool
    policy_version: str
    policy_ids: list[str] = field(default_factory=list)
    status: Status = "denied"
    error: ToolError | None = None


class PolicyEngine(Protocol):
    version: str

    def decide(self, call: ToolCall, spec: ToolSpec | None) -> Decision: ...


def _deny(version: str, code: str, message: str, rule: str) -> Decision:
    return Decision(allowed=False, policy_version=version, policy_ids=[rule], status="denied",
                    error=ToolError(code=code, message=message, retryable=False))


class RegistryRules:
    """allowed_agents, task scope, approval; everything else denied."""

    def __init__(self, registry: Registry) -> None:
        self.version = f"registry-rules:{registry.version}"

    def decide(self, call: ToolCall, spec: ToolSpec | None) -> Decision:
        if spec is None:
            return _deny(self.version, ErrorCode.TOOL_NOT_ALLOWED,
                         f"tool {call.tool!r} is not registered here", "default-deny")
        principal = call.principal
        if not all((principal.tenant, principal.user, principal.agent, principal.session)):
            return _deny(self.version, ErrorCode.POLICY_DENIED,
                         "principal must name tenant, user, agent and session", "principal-known")
        if not spec.agent_allowed(principal.agent):
            return _deny(self.version, ErrorCode.TOOL_NOT_ALLOWED,
                         f"agent {principal.agent!r} may not use {spec.name}", "allowed-agents")
        if spec.task_scope is not None:
            target = call.arguments.get(spec.task_scope)
            if not call.task_id or target != call.task_id:
                return _deny(self.version, ErrorCode.TASK_SCOPE_VIOLATION,
                             f"{spec.name} may write only into the call's own task "
                             f"({call.task_id!r}), not {target!r}", "task-scope")
        if spec.requires_approval or spec.risk == "critical":
            # No approval service is wired to these rules: fail closed.
            return _deny(self.version, ErrorCode.APPROVAL_REQUIRED,
                         f"{spec.name} needs a human approval, which these rules cannot grant",
                         "approval-required")
        return Decision(allowed=True, policy_version=self.version,
                        policy_ids=["allowed-agents", "task-scope"], status="ok")
