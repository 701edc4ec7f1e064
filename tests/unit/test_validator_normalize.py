"""Arguments normalised to their schema's types, and the validator's hook: pure, no broker."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import Registry, ToolSpec
from toolgate.services.validator.logic import CallChecker, Identity, Rejected, Validated
from toolgate.services.validator.normalize import compile_normalizer, normalize

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "amount": {"type": "integer"},
        "maybe": {"type": ["integer", "null"]},
        "ratio": {"type": "number"},
        "label": {"type": "string"},
        "lines": {
            "type": "array",
            "items": {"type": "object", "properties": {"cents": {"type": "integer"}}},
        },
        "pair": {
            "type": "array",
            "prefixItems": [{"type": "number"}, {"type": "integer"}],
            "items": {"type": "integer"},
        },
        "counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        "patterned": {
            "type": "object",
            "patternProperties": {"^n": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
        },
    },
}


class TestNormalize:
    @pytest.mark.parametrize("raw", [b"900", b"900.0", b"9e2", b"9.0e+2", b"900.000"])
    def test_integral_numbers_in_integer_fields_become_ints(self, raw: bytes) -> None:
        value = msgspec.json.decode(b'{"amount": ' + raw + b"}")
        fixed = normalize(SCHEMA, value)
        assert fixed == {"amount": 900} and type(fixed["amount"]) is int

    def test_every_spelling_of_an_amount_hashes_the_same(self) -> None:
        spellings = [b"900", b"900.0", b"9e2", b"9E2", b"9.00e2"]
        hashes = {
            arguments_sha256(normalize(SCHEMA, msgspec.json.decode(b'{"amount": ' + raw + b"}")))
            for raw in spellings
        }
        assert len(hashes) == 1

    def test_a_huge_integral_number_becomes_the_int_it_equals(self) -> None:
        assert normalize(SCHEMA, {"amount": 1e20}) == {"amount": 10**20}

    def test_union_types_including_integer_are_normalised(self) -> None:
        assert normalize(SCHEMA, {"maybe": 5.0}) == {"maybe": 5}
        assert normalize(SCHEMA, {"maybe": None}) == {"maybe": None}

    def test_numbers_strings_and_fractions_are_left_alone(self) -> None:
        value = {"ratio": 2.0, "label": "900.0", "amount": 900.5}
        fixed = normalize(SCHEMA, value)
        assert fixed == value and type(fixed["ratio"]) is float
        assert type(fixed["amount"]) is float  # the schema rejects it before this runs

    def test_items_prefix_items_and_additional_properties_are_walked(self) -> None:
        value = {
            "lines": [{"cents": 1.0}, {"cents": 2}],
            "pair": [1.0, 2.0, 3.0],
            "counts": {"a": 4.0},
        }
        fixed = normalize(SCHEMA, value)
        assert fixed == {
            "lines": [{"cents": 1}, {"cents": 2}],
            "pair": [1.0, 2, 3],
            "counts": {"a": 4},
        }
        assert type(fixed["pair"][0]) is float  # its prefixItems entry is a number
        assert [type(line["cents"]) for line in fixed["lines"]] == [int, int]

    def test_pattern_properties_are_not_guessed(self) -> None:
        # Which of patternProperties / additionalProperties applies is not worked out
        # here: the float stays a float, and the policy denies floats.
        fixed = normalize(SCHEMA, {"patterned": {"n1": 1.0, "x": 2.0}})
        assert fixed == {"patterned": {"n1": 1.0, "x": 2.0}}
        assert all(type(v) is float for v in fixed["patterned"].values())

    def test_unchanged_input_comes_back_as_the_same_object_and_is_never_mutated(self) -> None:
        value = {"amount": 5, "lines": [{"cents": 1}], "label": "x"}
        assert normalize(SCHEMA, value) is value
        original = {"amount": 5.0, "lines": [{"cents": 1.0}]}
        snapshot = msgspec.json.encode(original)
        normalize(SCHEMA, original)
        assert msgspec.json.encode(original) == snapshot

    def test_schema_without_integers_needs_no_normaliser(self) -> None:
        assert (
            compile_normalizer(
                {"type": "object", "properties": {"q": {"type": "string"}, "r": {"type": "number"}}}
            )
            is None
        )
        assert compile_normalizer({}) is None and compile_normalizer(True) is None

    def test_values_of_unexpected_shape_are_returned_as_they_are(self) -> None:
        for value in ({"amount": "9"}, {"lines": "x"}, {"lines": [None, 1.0]}, [1.0], 3.0):
            assert normalize(SCHEMA, value) == value


REFUND = ToolSpec(
    name="refund_payment",
    description="Refund a payment.",
    function="x.y:z",
    input_schema={
        "type": "object",
        "properties": {"amount": {"type": "integer"}},
        "additionalProperties": False,
    },
    output_schema={"type": "object"},
    read_only=False,
    timeout_s=5,
    risk="medium",
    allowed_agents=["support"],
)
SUPPORT = Identity(tenant="acme", agent="support")


def refund_raw(amount: bytes) -> bytes:
    principal = msgspec.json.encode(Principal("acme", "u-carol", "support", "s-1"))
    return (
        b'{"call_id": "c1", "tool": "refund_payment", "arguments": {"amount": '
        + amount
        + b'}, "principal": '
        + principal
        + b"}"
    )


@pytest.fixture(scope="module")
def checker() -> CallChecker:
    return CallChecker(Registry({REFUND.name: REFUND}), max_call_bytes=64 * 1024)


class TestValidatorHook:
    @pytest.mark.parametrize("amount", [b"900", b"900.0", b"9e2"])
    def test_validated_call_carries_the_normalised_arguments(
        self, checker: CallChecker, amount: bytes
    ) -> None:
        outcome = checker.check(refund_raw(amount), SUPPORT)
        assert isinstance(outcome, Validated)
        assert outcome.call.arguments == {"amount": 900}
        assert type(outcome.call.arguments["amount"]) is int
        assert arguments_sha256(outcome.call.arguments) == arguments_sha256({"amount": 900})

    def test_non_integral_amount_is_invalid_arguments(self, checker: CallChecker) -> None:
        outcome = checker.check(refund_raw(b"900.5"), SUPPORT)
        assert isinstance(outcome, Rejected) and outcome.status == "invalid_arguments"

    def test_validated_call_is_otherwise_the_call_sent(self, checker: CallChecker) -> None:
        outcome = checker.check(refund_raw(b"9e2"), SUPPORT)
        assert isinstance(outcome, Validated)
        sent = msgspec.json.decode(refund_raw(b"900"), type=ToolCall)
        assert outcome.call == sent
