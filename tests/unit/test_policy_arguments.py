"""Arguments the policy cannot see are a deny: the Cedar context holds them all, or none."""

from __future__ import annotations

from typing import Any

import pytest

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import Registry, ToolSpec, load_registry
from toolgate.services.policy.bundle import (
    DEFAULT_BUNDLE_DIR,
    SCHEMA_FILE,
    build_bundle,
    read_bundle_dir,
)
from toolgate.services.policy.engine import CedarEngine
from toolgate.services.policy.entities import (
    MAX_ARGUMENT_CHARS,
    MAX_ARGUMENT_DEPTH,
    Unrepresentable,
    context_arguments,
)

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")


def nested(depth: int) -> dict[str, Any]:
    """Arguments `depth` objects deep, counting the arguments object itself."""
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


class TestContextArguments:
    def test_representable_arguments_pass_whole_and_unchanged(self) -> None:
        arguments = {
            "limit": 3,
            "ok": True,
            "query": "q",
            "text": "x" * MAX_ARGUMENT_CHARS,
            "nested": {"a": [1, "b", {"c": False}]},
            "items": [],
            "big": 2**63 - 1,
            "small": -(2**63),
            "__private": 1,
        }
        assert context_arguments(arguments) is arguments

    @pytest.mark.parametrize(
        ("arguments", "path", "words"),
        [
            ({"amount": 0.123456}, "/amount", "fractional number"),
            ({"amount": 1e-05}, "/amount", "fractional number"),
            ({"amount": 1e300}, "/amount", "fractional number"),
            ({"amount": 10**20}, "/amount", "64-bit range"),
            ({"amount": 2**63}, "/amount", "64-bit range"),
            ({"amount": -(2**63) - 1}, "/amount", "64-bit range"),
            ({"note": "x" * (MAX_ARGUMENT_CHARS + 1)}, "/note", f"{MAX_ARGUMENT_CHARS + 1} char"),
            ({"note": None}, "/note", "null"),
            ({"lines": [{"cents": 1}, {"cents": 1.55555}]}, "/lines/1/cents", "fractional"),
            ({"a/b": {"c~d": [None]}}, "/a~1b/c~0d/0", "null"),
            (
                {"owner": {"__entity": {"type": "User", "id": "root"}}},
                "/owner/__entity",
                "Cedar JSON escape",
            ),
            ({"__extn": {"fn": "ip", "arg": "10.0.0.1"}}, "/__extn", "Cedar JSON escape"),
            ({"blob": b"bytes"}, "/blob", "bytes"),
        ],
    )
    def test_unrepresentable_arguments_are_named_by_path(
        self, arguments: dict[str, Any], path: str, words: str
    ) -> None:
        with pytest.raises(Unrepresentable) as raised:
            context_arguments(arguments)
        assert raised.value.path == path and words in str(raised.value)

    def test_nesting_is_limited(self) -> None:
        assert context_arguments(nested(MAX_ARGUMENT_DEPTH))
        with pytest.raises(Unrepresentable, match="nests more than"):
            context_arguments(nested(MAX_ARGUMENT_DEPTH + 1))
        deep_list: Any = 1
        for _ in range(MAX_ARGUMENT_DEPTH):
            deep_list = [deep_list]
        with pytest.raises(Unrepresentable, match="nests more than"):
            context_arguments({"x": deep_list})


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


def call(tool: str, arguments: dict[str, Any]) -> ToolCall:
    return ToolCall(
        call_id="c1", tool=tool, arguments=arguments, principal=ALICE, task_id="task_c04"
    )


def engine_with(policies: str) -> CedarEngine:
    return CedarEngine(
        build_bundle(
            {SCHEMA_FILE: read_bundle_dir(DEFAULT_BUNDLE_DIR)[SCHEMA_FILE], "test.cedar": policies}
        )
    )


class TestEngineDenies:
    @pytest.mark.parametrize(
        "payload",
        [
            1.23456,
            9e300,
            10**20,
            None,
            "x" * (MAX_ARGUMENT_CHARS + 1),
            {"k": [0.00001]},
            nested(MAX_ARGUMENT_DEPTH),
        ],
    )
    def test_an_argument_the_context_cannot_hold_is_a_deny_naming_it(
        self, registry: Registry, payload: Any
    ) -> None:
        # The default bundle allows echo whatever its payload; not this one.
        engine = CedarEngine(build_bundle(read_bundle_dir(DEFAULT_BUNDLE_DIR)))
        decision = engine.decide(call("echo", {"payload": payload}), registry.get("echo"))
        assert not decision.allowed and not decision.awaits_approval
        assert decision.error is not None and decision.error.code == "POLICY_DENIED"
        assert "argument /payload" in decision.error.message
        assert "cannot evaluate" in decision.error.message

    def test_a_short_fraction_reaches_the_policy_as_a_cedar_decimal(
        self, registry: Registry
    ) -> None:
        assert context_arguments({"t": 0.5, "n": [1.25]}) == {
            "t": {"__extn": {"fn": "decimal", "arg": "0.5"}},
            "n": [{"__extn": {"fn": "decimal", "arg": "1.25"}}],
        }
        engine = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("too-hot") forbid (principal, action, resource)\n'
            "when { context.arguments has payload"
            ' && context.arguments.payload.greaterThan(decimal("0.9")) };'
        )
        echo = registry.get("echo")
        assert engine.decide(call("echo", {"payload": 0.7}), echo).allowed
        hot = engine.decide(call("echo", {"payload": 1.5}), echo)
        assert not hot.allowed and hot.policy_ids == ["too-hot"]

    def test_a_decimal_compared_like_an_integer_is_a_deny(self, registry: Registry) -> None:
        # `>` on a decimal is a type error in Cedar; an error is a deny, never a pass.
        engine = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("big") forbid (principal, action, resource)\n'
            "when { context.arguments has payload && context.arguments.payload > 500 };"
        )
        decision = engine.decide(call("echo", {"payload": 900.5}), registry.get("echo"))
        assert not decision.allowed

    def test_the_same_call_with_a_representable_payload_is_allowed(
        self, registry: Registry
    ) -> None:
        engine = CedarEngine(build_bundle(read_bundle_dir(DEFAULT_BUNDLE_DIR)))
        payload = {"k": [1, "two", True], "text": "x" * 300}
        assert engine.decide(call("echo", {"payload": payload}), registry.get("echo")).allowed

    def test_policies_read_nested_arguments(self, registry: Registry) -> None:
        engine = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("no-prod") forbid (principal, action, resource)\n'
            "when { context.arguments has payload && context.arguments.payload has target"
            ' && context.arguments.payload.target.env == "prod" };\n'
            '@id("no-drop") forbid (principal, action, resource)\n'
            "when { context.arguments has payload && context.arguments.payload has tags"
            ' && context.arguments.payload.tags.contains("drop") };'
        )
        echo = registry.get("echo")
        assert engine.decide(call("echo", {"payload": {"target": {"env": "dev"}}}), echo).allowed
        prod = engine.decide(call("echo", {"payload": {"target": {"env": "prod"}}}), echo)
        assert prod.policy_ids == ["no-prod"]
        drop = engine.decide(call("echo", {"payload": {"tags": ["a", "drop"]}}), echo)
        assert drop.policy_ids == ["no-drop"]

    def test_a_long_argument_is_no_longer_invisible_to_a_policy(self, registry: Registry) -> None:
        # Before: strings over 256 characters were dropped, so `has` was false.
        engine = engine_with(
            '@id("all") permit (principal, action, resource);\n'
            '@id("must-be-short") forbid (principal, action, resource)\n'
            "when { context.arguments has query };"
        )
        decision = engine.decide(
            call("search_sources", {"query": "q" * 300}), registry.get("search_sources")
        )
        assert not decision.allowed and decision.policy_ids == ["must-be-short"]


def test_the_critical_path_refuses_before_asking_a_human(registry: Registry) -> None:
    # An approval gate never gets to show a human a call the policy cannot read.
    engine = CedarEngine(build_bundle(read_bundle_dir(DEFAULT_BUNDLE_DIR)))
    critical: ToolSpec = registry.get("echo").model_copy(  # type: ignore[union-attr]
        update={"risk": "critical"}
    )
    decision = engine.decide(call("echo", {"payload": 2.123456}), critical, ["ann", "bob"])
    assert not decision.allowed and not decision.awaits_approval
    assert decision.error is not None and decision.error.code == "POLICY_DENIED"
