"""The tool arguments a bundle's policies read, checked against the registry: pure, no I/O.

A policy reads an argument as `context.arguments.NAME` (or `context.arguments
has NAME`, or `context.arguments["NAME"]`). A NAME that no tool the policy
can apply to takes makes the rule silently inert: `context.arguments has
amonut` is false for every call, so a forbid on it never forbids. `toolgate
policy check` and `push` refuse it, naming file, line and the names the
tools in scope do take.

Which tools a policy can apply to (its scope) comes from its head, read from
Cedar's own JSON form of the policy (`cedarpy.policies_to_json_str`), and
from the conjuncts of its `when` clauses:

    action == / in Action::"A", or in [...]   tools whose registry action is A
                                              (Action::"call": every tool)
    resource == Tool::"X"                     the tool X (a tool is its calls'
                                              resource when it declares no
                                              resources and no task_scope)
    resource == T::"id", resource is T        tools whose calls have resources of
                                              type T (Task: the task-scoped tools)
    resource in ...                           any tool
    when { context.tool == Tool::"X" && ... } the tool X

A tool whose input_schema admits properties it does not list (no
`additionalProperties: false`, or `patternProperties`) may take any name: a
policy that can apply to one is not checked. Nor is a policy that applies to
no tool of the registry: it is written for tools another gateway serves (one
bundle for several), and what they take is not known here. Only the top-level name is
checked (`context.arguments.order.id` reads `order`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import cedarpy

from toolgate.contracts.registry import Registry, ToolSpec
from toolgate.services.policy.cedar_source import (
    Statement,
    location_at,
    split_statements,
    tokens,
)

ALL_TOOLS_ACTION = "call"


@dataclass(frozen=True)
class UnknownArgument:
    """A policy reads an argument that no tool in its scope takes."""

    file: str
    line: int
    column: int
    policy_id: str
    argument: str
    tools: tuple[str, ...]  # the tools the policy can apply to
    known: tuple[str, ...]  # the argument names those tools take

    def __str__(self) -> str:
        if len(self.tools) == 1:
            takes = f"{self.tools[0]} takes {', '.join(self.known) or 'none'}"
        else:
            takes = f"its {len(self.tools)} tools take {', '.join(self.known) or 'none'}"
        return (
            f"{self.file}:{self.line}:{self.column}: policy {self.policy_id!r} reads "
            f"context.arguments.{self.argument}, which no tool it applies to takes ({takes})"
        )


def unknown_arguments(files: Mapping[str, str], registry: Registry) -> list[UnknownArgument]:
    """Each argument a policy of the bundle's `files` reads that no tool in its scope takes.

    The files must parse (build_bundle checked them).
    """
    found: list[UnknownArgument] = []
    for name in sorted(files):
        if name.endswith(".cedar"):
            found += _unknown_in_file(name, files[name], registry)
    return found


def _unknown_in_file(name: str, text: str, registry: Registry) -> list[UnknownArgument]:
    policies = json.loads(cedarpy.policies_to_json_str(text))["staticPolicies"]
    statements = split_statements(text)
    found: list[UnknownArgument] = []
    for positional_id, policy in policies.items():
        read = _arguments_read(policy.get("conditions") or [])
        if not read:
            continue
        tools = tools_in_scope(policy, registry)
        if not tools or any(_takes_any_name(spec) for spec in tools):
            continue  # a rule for tools not served here; a tool that takes any name
        known = sorted({arg for spec in tools for arg in _argument_names(spec)})
        index = int(positional_id.removeprefix("policy") or 0)
        statement = statements[index] if index < len(statements) else None
        for argument in read:
            if argument in known:
                continue
            where = location_at(text, _offset_of(text, argument, statement))
            found.append(
                UnknownArgument(
                    file=name,
                    line=where.line,
                    column=where.column,
                    policy_id=str((policy.get("annotations") or {}).get("id", positional_id)),
                    argument=argument,
                    tools=tuple(spec.name for spec in tools),
                    known=tuple(known),
                )
            )
    return found


def unchecked_policies(files: Mapping[str, str], registry: Registry) -> list[tuple[str, str]]:
    """(file, policy id) of each policy that reads arguments but applies to no tool of
    `registry`: its argument names could not be checked here (a rule for another
    gateway's tools, or a registry that is not the one the gateway serves)."""
    found: list[tuple[str, str]] = []
    for name in sorted(files):
        if not name.endswith(".cedar"):
            continue
        policies = json.loads(cedarpy.policies_to_json_str(files[name]))["staticPolicies"]
        for positional_id, policy in policies.items():
            if _arguments_read(policy.get("conditions") or []) and not tools_in_scope(
                policy, registry
            ):
                found.append(
                    (name, str((policy.get("annotations") or {}).get("id", positional_id)))
                )
    return found


def tools_in_scope(policy: Mapping[str, Any], registry: Registry) -> list[ToolSpec]:
    """The registry's tools a policy (Cedar JSON) can apply to, by its head and `when`."""
    tools = list(registry)
    actions = _actions(policy.get("action") or {})
    if actions is not None and ALL_TOOLS_ACTION not in actions:
        tools = [spec for spec in tools if spec.action_class in actions]
    tools = [spec for spec in tools if _resource_fits(policy.get("resource") or {}, spec)]
    named = _tools_named_in_when(policy.get("conditions") or [])
    if named is not None:
        tools = [spec for spec in tools if spec.name in named]
    return tools


def resource_types(spec: ToolSpec) -> set[str]:
    """The entity types of a tool's calls' resources (engine.py: one evaluation each)."""
    types = {resource.type for resource in spec.resources}
    if spec.task_scope is not None:
        types.add("Task")
    return types or {"Tool"}


def _actions(constraint: Mapping[str, Any]) -> set[str] | None:
    """The actions an action constraint allows; None: any."""
    op = constraint.get("op")
    if op == "==" or (op == "in" and "entity" in constraint):
        return {str(constraint["entity"].get("id"))}
    if op == "in":
        return {str(entity.get("id")) for entity in constraint.get("entities") or []}
    return None


def _resource_fits(constraint: Mapping[str, Any], spec: ToolSpec) -> bool:
    op = constraint.get("op")
    if op == "==" and isinstance(constraint.get("entity"), dict):
        entity = constraint["entity"]
        if entity.get("type") == "Tool":
            return resource_types(spec) == {"Tool"} and entity.get("id") == spec.name
        return entity.get("type") in resource_types(spec)
    if op == "is":
        return constraint.get("entity_type") in resource_types(spec)
    return True  # All, `in` (an entity's ancestors are data), a slot


def _tools_named_in_when(conditions: Iterable[Mapping[str, Any]]) -> set[str] | None:
    """Tools a `when` conjunct `context.tool == Tool::"X"` (or resource ==) pins; None: any."""
    named: set[str] | None = None
    for condition in conditions:
        if condition.get("kind") != "when":
            continue
        for conjunct in _conjuncts(condition.get("body")):
            tool = _tool_compared(conjunct)
            if tool is not None:
                named = {tool} if named is None else named & {tool}
    return named


def _conjuncts(expr: Any) -> list[Any]:
    if isinstance(expr, dict) and "&&" in expr:
        return _conjuncts(expr["&&"].get("left")) + _conjuncts(expr["&&"].get("right"))
    return [expr]


def _tool_compared(expr: Any) -> str | None:
    if not isinstance(expr, dict) or "==" not in expr:
        return None
    sides = [expr["=="].get("left"), expr["=="].get("right")]
    for side, other in (sides, sides[::-1]):
        if side in ({".": {"left": {"Var": "context"}, "attr": "tool"}}, {"Var": "resource"}):
            value = other.get("Value") if isinstance(other, dict) else None
            entity = value.get("__entity") if isinstance(value, dict) else None
            if isinstance(entity, dict) and entity.get("type") == "Tool":
                return str(entity.get("id"))
    return None


_CONTEXT_ARGUMENTS = {".": {"left": {"Var": "context"}, "attr": "arguments"}}


def _arguments_read(conditions: Iterable[Mapping[str, Any]]) -> list[str]:
    """The top-level argument names the conditions read, in order, each once."""
    names: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for op in (".", "has"):
                access = node.get(op)
                if isinstance(access, dict) and access.get("left") == _CONTEXT_ARGUMENTS:
                    attr = str(access.get("attr"))
                    if attr not in names:
                        names.append(attr)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for condition in conditions:
        walk(condition.get("body"))
    return names


def _argument_names(spec: ToolSpec) -> list[str]:
    properties = spec.input_schema.get("properties")
    return list(properties) if isinstance(properties, dict) else []


def _takes_any_name(spec: ToolSpec) -> bool:
    schema = spec.input_schema
    return schema.get("additionalProperties", True) is not False or bool(
        schema.get("patternProperties")
    )


def _offset_of(text: str, argument: str, statement: Statement | None) -> int:
    """Where the policy reads `argument` (its first token naming it), else where it starts."""
    start, end = (statement.start, statement.end) if statement else (0, len(text))
    for first, last in tokens(text, start, end):
        if text[first:last] in (argument, f'"{argument}"'):
            return first
    return start
