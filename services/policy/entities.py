"""The six-tuple of a call as a Cedar request: pure functions, no I/O.

    principal  User::"<user>"         attrs tenant, roles (roles from the bundle, never the call)
    action     Action::"<class>"      the tool's action class (registry `action`: read, write,
                                      delete, send, publish, execute; undeclared: a read_only
                                      tool reads, any other writes), each `in Action::"call"`
    resource   <Type>::"<id>"         each resource the tool declares (registry `resources`),
                                      one evaluation per resource (resources.py)
               Task::"<id>"           for a task-scoped tool: the task its arguments name
               Tool::"<name>"         for a tool with neither
    context    agent (Agent entity: the user acts through it), tool (the Tool entity,
               also when the resource is something else), session, task (the call's own
               Task), time (epoch s), risk, approval {state, approvers, count}, arguments
               (all of them; see below); and when the bundle's schema declares them:
               session_kind ("interactive" | "automated" as the platform states it in the
               call's context, else "unspecified"), local_time {hour, minute, weekday,
               time_zone} (the decision's time in the tenant's time zone, bundle.yaml)

Arguments reach the context whole, or the call is denied: a policy must never
decide without an argument it might have read. Representable are booleans,
integers in Cedar's 64-bit range, strings of at most MAX_ARGUMENT_CHARS
characters, objects (records) and lists (sets: policies see membership, not
order or repeats), nested at most MAX_ARGUMENT_DEPTH lists and objects deep.
A fractional number becomes a Cedar `decimal` (policies compare it with
`.lessThan(decimal("500.0"))` and friends) when it has at most four
fractional digits and fits Cedar's decimal range; comparing a decimal with
`>` is a type error, and an error is a deny. Anything else (a float with more
digits, null, an integer like 10**20, a longer string, a deeper nesting, a key
Cedar's JSON reserves such as "__entity") raises Unrepresentable naming the
argument's path, and the engine denies the call.

A Task entity exists only when its tenant is known: the call's own task
belongs to the caller's tenant; any other task only if a task directory says
whose it is. A policy reading an unknown task's attributes errors, and an
error is a deny.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal
from zoneinfo import ZoneInfo

from toolgate.contracts.calls import ToolCall
from toolgate.contracts.registry import ToolSpec

CALL_ACTION = "call"
# Cedar's decimal: a 64-bit integer of ten-thousandths.
DECIMAL_LIMIT = 922337203685477.0
FINER_ACTIONS = ("read", "write", "send", "delete", "publish", "execute")
# What the platform may state in `context.session_kind`; unstated: "unspecified".
SESSION_KINDS = ("interactive", "automated")
UNSPECIFIED_SESSION = "unspecified"
WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
# The longest string argument a decision takes (longer: denied). Above every
# built-in tool's maxLength (save_evidence's claim and quote: 4000), low
# enough that one argument cannot make every decision slow.
MAX_ARGUMENT_CHARS = 8192
# Lists and objects inside `arguments` (the validator refuses calls deeper than
# 64 anyway; Cedar's own JSON parser gives up not far above that).
MAX_ARGUMENT_DEPTH = 16
CEDAR_LONG_MIN, CEDAR_LONG_MAX = -(2**63), 2**63 - 1
# Keys Cedar's JSON reads as escapes (an entity reference, an extension value):
# passed on, an argument could pose as an entity.
RESERVED_KEYS = frozenset({"__entity", "__extn", "__expr"})

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
    return spec.action_class


class InvalidContext(ValueError):
    """Something the platform stated in the call's context that a policy cannot take."""


def session_kind_of(call: ToolCall) -> str:
    """The session kind the platform stated, or "unspecified"; InvalidContext if unknown."""
    kind = call.context.get("session_kind")
    if kind is None:
        return UNSPECIFIED_SESSION
    if kind not in SESSION_KINDS:
        raise InvalidContext(
            f"context.session_kind must be one of {', '.join(SESSION_KINDS)} "
            f"(or absent), not {str(kind)[:40]!r}"
        )
    return str(kind)


def local_time(now_s: float, zone: ZoneInfo) -> dict[str, Any]:
    """The decision's time as the tenant's clock shows it."""
    at = datetime.fromtimestamp(now_s, zone)
    return {
        "hour": at.hour,
        "minute": at.minute,
        "weekday": WEEKDAYS[at.weekday()],
        "time_zone": zone.key,
    }


def task_target(call: ToolCall, spec: ToolSpec) -> str | None:
    """The task a task-scoped tool's arguments name ("" when they name none)."""
    if spec.task_scope is None:
        return None
    target = call.arguments.get(spec.task_scope)
    return target if isinstance(target, str) else ""


class Unrepresentable(ValueError):
    """An argument the Cedar context cannot hold: the call is denied, naming it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"argument {path or '/'} {why}")
        self.path = path
        self.why = why


def context_arguments(arguments: Mapping[str, Any]) -> Mapping[str, Any]:
    """The call's arguments as the Cedar context gets them: all of them, unchanged.

    Raises Unrepresentable for the first argument Cedar could not hold as it is.
    """
    fractions: list[str] = []
    _check_record(arguments, "", 1, fractions)
    # The common case (no fractional numbers) passes the arguments through untouched.
    return _with_decimals(arguments) if fractions else arguments


def cedar_decimal(value: float) -> dict[str, Any] | None:
    """Cedar's JSON for `decimal("...")`, or None if Cedar's decimal cannot hold `value`
    exactly (more than four fractional digits, or beyond its range)."""
    text = repr(value)
    if "e" in text or "inf" in text or "nan" in text:
        text = format(value, "f")
    if not -DECIMAL_LIMIT < value < DECIMAL_LIMIT or "n" in text:
        return None
    whole, _, fraction = text.partition(".")
    if len(fraction.rstrip("0")) > 4 or float(text) != value:
        return None
    return {"__extn": {"fn": "decimal", "arg": f"{whole}.{(fraction or '0')[:4]}"}}


def _with_decimals(value: Any) -> Any:
    if type(value) is float:
        return cedar_decimal(value)
    if isinstance(value, dict):
        return {key: _with_decimals(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_with_decimals(item) for item in value]
    return value


def _pointer(path: str, key: str | int) -> str:
    return f"{path}/" + str(key).replace("~", "~0").replace("/", "~1")


def _check_record(record: Mapping[str, Any], path: str, depth: int, fractions: list[str]) -> None:
    if depth > MAX_ARGUMENT_DEPTH:
        raise Unrepresentable(path, f"nests more than {MAX_ARGUMENT_DEPTH} lists and objects deep")
    for key, value in record.items():
        if not isinstance(key, str):
            raise Unrepresentable(path, f"has a key that is not a string: {key!r:.40}")
        if key in RESERVED_KEYS:
            raise Unrepresentable(_pointer(path, key), "is named like a Cedar JSON escape")
        _check_value(value, _pointer(path, key), depth, fractions)


def _check_value(value: Any, path: str, depth: int, fractions: list[str]) -> None:
    # Exact types first: the common arguments cost one comparison each.
    kind = type(value)
    if kind is str:
        if len(value) > MAX_ARGUMENT_CHARS:
            raise Unrepresentable(
                path,
                f"is a string of {len(value)} characters; a policy "
                f"decision takes at most {MAX_ARGUMENT_CHARS}",
            )
    elif kind is bool:
        pass
    elif kind is int:
        if not CEDAR_LONG_MIN <= value <= CEDAR_LONG_MAX:
            raise Unrepresentable(path, "is an integer outside Cedar's 64-bit range")
    elif kind is float:
        if cedar_decimal(value) is None:
            raise Unrepresentable(
                path,
                f"is a fractional number ({value!r:.40}) that Cedar's "
                "decimal cannot hold exactly (at most 4 fractional "
                "digits, |x| < 922337203685477)",
            )
        fractions.append(path)
    elif value is None:
        raise Unrepresentable(path, "is null, which Cedar cannot hold")
    elif isinstance(value, dict):
        _check_record(value, path, depth + 1, fractions)
    elif isinstance(value, list):
        if depth + 1 > MAX_ARGUMENT_DEPTH:
            raise Unrepresentable(
                path, f"nests more than {MAX_ARGUMENT_DEPTH} lists and objects deep"
            )
        for index, item in enumerate(value):
            _check_value(item, _pointer(path, index), depth + 1, fractions)
    else:
        raise Unrepresentable(path, f"is a {kind.__name__}, which Cedar cannot hold")


def action_entities(names: Iterable[str] = FINER_ACTIONS) -> list[dict[str, Any]]:
    parent = [uid("Action", CALL_ACTION)]
    return [{"uid": uid("Action", CALL_ACTION), "attrs": {}, "parents": []}] + [
        {"uid": uid("Action", name), "attrs": {}, "parents": parent} for name in names
    ]


def tool_entity(spec: ToolSpec) -> dict[str, Any]:
    return {
        "uid": uid("Tool", spec.name),
        "parents": [],
        "attrs": {
            "risk": spec.risk,
            "read_only": spec.read_only,
            "requires_approval": spec.requires_approval,
            "any_agent": "*" in spec.allowed_agents,
            "allowed_agents": [ref("Agent", a) for a in spec.allowed_agents if a != "*"],
        },
    }


def task_tenant(task_id: str, call: ToolCall, directory: TaskTenants | None) -> str | None:
    if directory is not None and (tenant := directory(task_id)) is not None:
        return tenant
    return call.principal.tenant if task_id == call.task_id else None


def call_entities(
    call: ToolCall,
    spec: ToolSpec,
    roles: Mapping[str, list[str]],
    directory: TaskTenants | None = None,
) -> list[dict[str, Any]]:
    """The entities of this call besides its tool: user, agent, the tasks it involves."""
    principal = call.principal
    entities: list[dict[str, Any]] = [
        {
            "uid": uid("User", principal.user),
            "parents": [],
            "attrs": {
                "tenant": principal.tenant,
                "roles": roles.get(f"{principal.tenant}/{principal.user}", []),
            },
        },
        {"uid": uid("Agent", principal.agent), "parents": [], "attrs": {}},
    ]
    task_ids = {t for t in (call.task_id, task_target(call, spec)) if t}
    for task_id in sorted(task_ids):
        tenant = task_tenant(task_id, call, directory)
        if tenant is not None:
            entities.append(
                {"uid": uid("Task", task_id), "parents": [], "attrs": {"tenant": tenant}}
            )
    return entities


def request_for(
    call: ToolCall,
    spec: ToolSpec,
    approval: ApprovalState,
    now_s: int,
    resource: dict[str, str] | None = None,
    extra_context: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The Cedar request; `resource` overrides the Task or Tool it would otherwise name."""
    target = task_target(call, spec)
    context: dict[str, Any] = {
        "agent": ref("Agent", call.principal.agent),
        "tool": ref("Tool", spec.name),
        "session": call.principal.session,
        "time": now_s,
        "risk": spec.risk,
        "approval": approval.as_context(),
        "arguments": context_arguments(call.arguments),
    }
    if call.task_id:
        context["task"] = ref("Task", call.task_id)
    if extra_context:
        context.update(extra_context)
    if resource is None:
        resource = uid("Task", target) if target is not None else uid("Tool", spec.name)
    return {
        "principal": uid("User", call.principal.user),
        "action": uid("Action", action_of(spec)),
        "resource": resource,
        "context": context,
    }
