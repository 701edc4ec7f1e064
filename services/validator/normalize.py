"""Arguments in their schema's types: an integral number in an "integer" field is an int.

JSON has one number type. msgspec decodes `900.0` and `9e2` as floats, and
JSON Schema counts a number with a zero fraction as an integer, so all three
of `900`, `900.0` and `9e2` pass `{"type": "integer"}`. The policy and the
arguments hash must see one value for one amount, so once the schema check
has passed, such a float is replaced by the int it equals (`1e20` becomes
10**20, which the policy then refuses as too large for Cedar). A non-integral
number there never gets this far: the schema rejects it.

Walked: `properties`, `additionalProperties` (when there are no
`patternProperties`), `items` and `prefixItems`, with `type` "integer" or a
list of types that includes "integer". Not walked: `$ref`, `allOf` /
`anyOf` / `oneOf`, `patternProperties`, conditionals; a float under those
stays a float, and the policy denies a float (fail closed).

Pure: no I/O; the input is never changed, and comes back as the same object
when nothing needed normalising (the common case costs one walk, no copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Normalizer = Callable[[Any], Any]


@dataclass(frozen=True)
class _Plan:
    """Where integers live under one schema node; only nodes that lead to one are kept."""

    integer: bool = False
    properties: Mapping[str, _Plan] = field(default_factory=dict)
    additional: _Plan | None = None
    prefix: tuple[_Plan | None, ...] = ()
    items: _Plan | None = None


def compile_normalizer(schema: Any) -> Normalizer | None:
    """The normaliser of values valid under `schema`; None when it has no integer to fix."""
    plan = _plan(schema)
    if plan is None:
        return None
    return lambda value: _apply(plan, value)


def normalize(schema: Any, value: Any) -> Any:
    """`value` (valid under `schema`) with integral floats in integer fields made ints."""
    normalizer = compile_normalizer(schema)
    return value if normalizer is None else normalizer(value)


def _is_integer_type(declared: Any) -> bool:
    if isinstance(declared, list):
        return "integer" in declared
    return bool(declared == "integer")


def _plan(schema: Any) -> _Plan | None:
    if not isinstance(schema, Mapping):
        return None  # true / false schemas, or nothing
    integer = _is_integer_type(schema.get("type"))
    properties: dict[str, _Plan] = {}
    declared = schema.get("properties")
    if isinstance(declared, Mapping):
        for name, sub in declared.items():
            found = _plan(sub)
            if found is not None:
                properties[name] = found
    additional = None
    if "patternProperties" not in schema:
        additional = _plan(schema.get("additionalProperties"))
    # Kept whole even when no entry leads to an integer: `items` starts after it.
    prefix: tuple[_Plan | None, ...] = ()
    declared_prefix = schema.get("prefixItems")
    if isinstance(declared_prefix, list):
        prefix = tuple(_plan(sub) for sub in declared_prefix)
    items = _plan(schema.get("items"))
    if not (integer or properties or additional or any(prefix) or items):
        return None
    return _Plan(
        integer=integer, properties=properties, additional=additional, prefix=prefix, items=items
    )


def _apply(plan: _Plan, value: Any) -> Any:
    if type(value) is float:
        if plan.integer and math.isfinite(value) and value.is_integer():
            return int(value)
        return value
    if isinstance(value, dict):
        return _apply_object(plan, value)
    if isinstance(value, list):
        return _apply_array(plan, value)
    return value


def _apply_object(plan: _Plan, value: dict[str, Any]) -> dict[str, Any]:
    if not (plan.properties or plan.additional):
        return value
    changed: dict[str, Any] | None = None
    for name, item in value.items():
        sub = plan.properties.get(name) if name in plan.properties else plan.additional
        if sub is None:
            continue
        fixed = _apply(sub, item)
        if fixed is not item:
            if changed is None:
                changed = dict(value)
            changed[name] = fixed
    return value if changed is None else changed


def _apply_array(plan: _Plan, value: list[Any]) -> list[Any]:
    if not (any(plan.prefix) or plan.items):
        return value
    changed: list[Any] | None = None
    for index, item in enumerate(value):
        sub = plan.prefix[index] if index < len(plan.prefix) else plan.items
        if sub is None:
            continue
        fixed = _apply(sub, item)
        if fixed is not item:
            if changed is None:
                changed = list(value)
            changed[index] = fixed
    return value if changed is None else changed
