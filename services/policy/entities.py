"""The six-tuple of a call as a Cedar request: pure functions, no I/O.

    principal  User::"<user>"         attrs tenant, roles (roles from the bundle, never the call)
    action     Action::"read"|"write"  each `in Action::"call"`; a read_only tool reads,
                                      any other writes (send and delete are declared for
                                      tools that will name their actions)
    resource   Task::"<id>"           for a task-scoped tool: the task its arguments name
               Tool::"<name>"         for any other tool
    context    agent (Agent entity: the user acts through it), tool (the Tool entity,
               also when the resource is a Task), session, task (the call's own Task),
               time (epoch s), risk, approval {state, approvers, count}, arguments
               (scalar top-level arguments only)

A Task entity exists only when its tenant is known: the call's own task
belongs to the caller's tenant; any other task only if a task directory says
whose it is. A policy reading an unknown task's attributes errors, and an
error is a deny.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from toolgate.contracts.calls import ToolCall
from toolgate.contracts.registry import ToolSpec

CALL_ACTION = "call"
FINER_ACTIONS = ("read", "write", "send", "delete")
# Longer strings are left out of the context: policies compare ids and
# enums, and a large argument would only slow every decision down.
MAX_ARGUMENT_CHARS = 256
CEDAR_LONG = range(-(2**63), 2**63)

# Where a task lives: its tenant, or None when the directory does not know it.
TaskTenants = Callable[[str], str | None]


@dataclass(frozen=True)
class ApprovalState:
    state: Literal["none", "granted"]
    approvers: tuple[str, ...] = ()
    count: int = 0

    def as_context(self) -> dict[str, Any]:
        return {"state": self.state, "approvers": list(self.approvers), "count": self.count}


NO_APPROVAL = ApprovalState("none")


def uid(entity_type: str, entity_id: str) -> dict[str, str]:
    return {"type": entity_type, "id": entity_id}


def ref(entity_type: str, entity_id: str) -> dict[str, Any]:
    """An entity reference inside attributes or context (Cedar JSON's escape)."""
    return {"__entity": uid(entity_type, entity_id)}


def action_of(spec: ToolSpec) -> str:
    # The registry has no per-tool action list yet; read_only is all it says.
    return "read" if spec.read_only else "write"


def task_target(call: ToolCall, spec: ToolSpec) -> str | None:
    """The task a task-scoped tool's arguments name ("" when they name none)."""
    if spec.task_scope is None:
        return None
    target = call.arguments.get(spec.task_scope)
    return target if isinstance(target, str) else ""


def selected_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    selected: dict[str, Any] = {}
    for name, value in arguments.items():
        if name.startswith("__"):  # Cedar JSON reserves __entity / __extn
            continue
        if isinstance(value, bool) or (isinstance(value, int) and value in CEDAR_LONG):
            selected[name] = value
        elif isinstance(value, str) and len(value) <= MAX_ARGUMENT_CHARS:
            selected[name] = value
    return selected


def action_entities() -> list[dict[str, Any]]:
    parent = [uid("Action", CALL_ACTION)]
    return [{"uid": uid("Action", CALL_ACTION), "attrs": {}, "parents": []}] + [
        {"uid": uid("Action", name), "attrs": {}, "parents": parent} for name in FINER_ACTIONS]


def tool_entity(spec: ToolSpec) -> dict[str, Any]:
    return {"uid": uid("Tool", spec.name), "parents": [], "attrs": {
        "risk": spec.risk,
        "read_only": spec.read_only,
        "requires_approval": spec.requires_approval,
        "any_agent": "*" in spec.allowed_agents,
        "allowed_agents": [ref("Agent", a) for a in spec.allowed_agents if a != "*"],
    }}


def task_tenant(task_id: str, call: ToolCall, directory: TaskTenants | None) -> str | None:
    if directory is not None and (tenant := directory(task_id)) is not None:
        return tenant
    return call.principal.tenant if task_id == call.task_id else None


def call_entities(call: ToolCall, spec: ToolSpec, roles: Mapping[str, list[str]],
                  directory: TaskTenants | None = None) -> list[dict[str, Any]]:
    """The entities of this call besides its tool: user, agent, the tasks it involves."""
    principal = call.principal
    entities: list[dict[str, Any]] = [
        {"uid": uid("User", principal.user), "parents": [], "attrs": {
            "tenant": principal.tenant,
            "roles": roles.get(f"{principal.tenant}/{principal.user}", []),
        }},
        {"uid": uid("Agent", principal.agent), "parents": [], "attrs": {}},
    ]
    task_ids = {t for t in (call.task_id, task_target(call, spec)) if t}
    for task_id in sorted(task_ids):
        tenant = task_tenant(task_id, call, directory)
        if tenant is not None:
            entities.append({"uid": uid("Task", task_id), "parents": [],
                             "attrs": {"tenant": tenant}})
    return entities


def request_for(call: ToolCall, spec: ToolSpec, approval: ApprovalState,
                now_s: int) -> dict[str, Any]:
    target = task_target(call, spec)
    context: dict[str, Any] = {
        "agent": ref("Agent", call.principal.agent),
        "tool": ref("Tool", spec.name),
        "session": call.principal.session,
        "time": now_s,
        "risk": spec.risk,
        "approval": approval.as_context(),
        "arguments": selected_arguments(call.arguments),
    }
    if call.task_id:
        context["task"] = ref("Task", call.task_id)
    return {
        "principal": uid("User", call.principal.user),
        "action": uid("Action", action_of(spec)),
        "resource": uid("Task", target) if target is not None else uid("Tool", spec.name),
        "context": context,
    }
