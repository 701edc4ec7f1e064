"""The resources of a call, and their entities: pure functions, no I/O.

A tool's registry entry names the resources it acts on (`resources`: an
entity type and the JSON pointer of its id in the arguments). Each id found
there is one resource, looked up by the bundle's entity provider for its
type (providers.py) and given to Cedar as an entity whose attributes are
what the provider said. Each resource is the request's `resource` in an
evaluation of its own: the call is allowed only if every one is.

An id the arguments do not hold (absent, not a string, empty, a list of
something else, too many) cannot be looked up: the call is denied, naming
the argument. A resource whose lookup failed or found nothing is a deny too,
with the provider's reason.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from toolgate.contracts.calls import ToolCall
from toolgate.contracts.events import ResourceSeen
from toolgate.contracts.registry import ToolSpec, pointer_steps
from toolgate.services.policy.entities import (
    Unrepresentable,
    context_arguments,
    ref,
    uid,
)

# The most resources one call may name (each is an evaluation and a lookup).
MAX_RESOURCES = 32
MAX_ID_CHARS = 256


class ResourceProblem(ValueError):
    """The call's resources cannot be known: the call is denied with this reason."""

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def resource_refs(call: ToolCall, spec: ToolSpec) -> list[tuple[str, str]]:
    """(type, id) of each resource the call names, in declaration order, without repeats."""
    found: list[tuple[str, str]] = []
    for resource in spec.resources:
        value = _at(call.arguments, resource.id)
        ids = value if isinstance(value, list) else [value]
        if value is None or (isinstance(value, list) and not value):
            raise ResourceProblem(
                f"argument {resource.id} names no {resource.type}, so the policy cannot look it up"
            )
        for item in ids:
            if not isinstance(item, str) or not item or len(item) > MAX_ID_CHARS:
                raise ResourceProblem(
                    f"argument {resource.id} must name each {resource.type} by a non-empty "
                    f"string of at most {MAX_ID_CHARS} characters"
                )
            found.append((resource.type, item))
    unique = list(dict.fromkeys(found))
    if len(unique) > MAX_RESOURCES:
        raise ResourceProblem(
            f"the call names {len(unique)} resources; a decision takes at most {MAX_RESOURCES}"
        )
    return unique


def _at(arguments: Mapping[str, Any], pointer: str) -> Any:
    value: Any = arguments
    for step in pointer_steps(pointer):
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            return None
    return value


def known_resources(
    refs: Sequence[tuple[str, str]], seen: Sequence[ResourceSeen] | None
) -> list[ResourceSeen]:
    """The lookup of each ref, or ResourceProblem with the first reason to deny."""
    if not refs:
        return []
    by_ref = {(s.type, s.id): s for s in seen or ()}
    known = []
    for entity_type, resource_id in refs:
        found = by_ref.get((entity_type, resource_id))
        if found is None:
            raise ResourceProblem(
                f"{entity_type} {resource_id!r} was not looked up, so the "
                "policy cannot decide on it"
            )
        if found.error:
            raise ResourceProblem(
                f"{entity_type} {resource_id!r} could not be looked up: {found.error}",
                retryable=True,
            )
        if not found.found:
            raise ResourceProblem(
                f"{entity_type} {resource_id!r} is not known (its "
                f"{found.provider or 'entity'} provider has no such resource "
                "for this tenant)"
            )
        known.append(found)
    return known


def resource_entity(seen: ResourceSeen, references: Mapping[str, str]) -> dict[str, Any]:
    """The Cedar entity of a found resource: the provider's attributes, as Cedar holds them.

    A null attribute is left out (Cedar has no null: `resource has x` is false); an
    attribute named in `references` becomes a reference to that entity type; any
    other value must fit Cedar as an argument must, or the call is denied.
    """
    plain: dict[str, Any] = {}
    refs: dict[str, Any] = {}
    for name, value in seen.attributes.items():
        if value is None:
            continue
        if name in references:
            if not isinstance(value, str):
                raise ResourceProblem(
                    f"attribute {name} of {seen.type} {seen.id!r} names a "
                    f"{references[name]} by a {type(value).__name__}, not "
                    "an id"
                )
            refs[name] = ref(references[name], value)
        else:
            plain[name] = value
    try:
        attrs = dict(context_arguments(plain))
    except Unrepresentable as exc:
        raise ResourceProblem(
            f"attribute {exc.path.lstrip('/')} of {seen.type} {seen.id!r} "
            f"{exc.why}, so the policy cannot evaluate this call"
        ) from exc
    attrs.update(refs)
    return {"uid": uid(seen.type, seen.id), "attrs": attrs, "parents": []}


def recorded_resources(decision: Mapping[str, Any]) -> list[ResourceSeen] | None:
    """The resources a recorded decision event looked up (its JSON as the audit keeps it),
    for deciding again on what was known then: `engine.decide(call, spec,
    resources=recorded_resources(event))`. None when the event recorded none (a tool
    that declares resources is then denied: nothing says what the policy knew)."""
    found = decision.get("resources")
    if not found:
        return None
    return msgspec.convert(found, list[ResourceSeen])
