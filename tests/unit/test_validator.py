from __future__ import annotations

import msgspec
import pytest

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import load_registry
from toolgate.services.validator.logic import (
    MAX_ARGUMENT_DEPTH,
    CallChecker,
    Identity,
    Rejected,
    Undeliverable,
    Validated,
    nesting_depth,
)

PRINCIPAL = Principal(tenant="acme", user="u", agent="researcher", session="s")
# Who published the call, as the bus says (the calls subject it arrived on).
SENDER = Identity(tenant="acme", agent="researcher")


@pytest.fixture(scope="module")
def checker() -> CallChecker:
    return CallChecker(load_registry(), max_call_bytes=64 * 1024)


def raw(
    call_id: str = "call_1",
    tool: str = "search_sources",
    principal: Principal = PRINCIPAL,
    **arguments: object,
) -> bytes:
    return msgspec.json.encode(
        ToolCall(call_id=call_id, tool=tool, arguments=dict(arguments), principal=principal)
    )


def nested(depth: int) -> object:
    value: object = "leaf"
    for _ in range(depth):
        value = [value]
    return value


class TestCheckCall:
    def test_valid_call_is_validated(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query="agents", source_type="any", limit=3), SENDER)
        assert isinstance(outcome, Validated) and outcome.call.arguments["limit"] == 3
        assert outcome.call.principal == PRINCIPAL

    def test_every_schema_error_is_reported_with_its_json_path(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query="x", source_type="blog", limit=50, extra=1), SENDER)
        assert isinstance(outcome, Rejected) and outcome.status == "invalid_arguments"
        paths = sorted(d.path for d in outcome.error.details)
        assert paths == ["", "/limit", "/query", "/source_type"]

    def test_unknown_tool_is_unknown_tool(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(tool="rm_rf"), SENDER)
        assert isinstance(outcome, Rejected) and outcome.status == "unknown_tool"
        assert outcome.error.code == "TOOL_NOT_FOUND"

    def test_unsafe_call_id_cannot_be_answered_so_it_is_dead_lettered(
        self, checker: CallChecker
    ) -> None:
        outcome = checker.check(raw(call_id="toolgate.results.>"), SENDER)
        assert isinstance(outcome, Undeliverable) and "subject-safe" in outcome.reason

    def test_malformed_call_with_readable_call_id_gets_a_result_and_a_dead_letter(
        self, checker: CallChecker
    ) -> None:
        outcome = checker.check(b'{"call_id": "c1", "tool": 5}', SENDER)
        assert isinstance(outcome, Rejected) and outcome.error.code == "MALFORMED_CALL"
        assert outcome.dead_letter_reason is not None
        # Answered to the sender the bus authenticated: there is no payload principal.
        assert (outcome.principal.tenant, outcome.principal.agent) == ("acme", "researcher")

    def test_not_json_is_undeliverable(self, checker: CallChecker) -> None:
        assert isinstance(checker.check(b"\xff\x00garbage", SENDER), Undeliverable)

    @pytest.mark.parametrize(
        "body",
        [
            b'{"call_id": "c-7", "tool": "echo", "arguments": {"amount": NaN}}',
            b'{"tool": "echo", "call_id" :\n "c-7", "arguments": {"payl',
            b'\xff\x00{"call_id":"c-7"',
        ],
        ids=["NaN", "truncated", "garbage-before"],
    )
    def test_a_body_that_is_not_json_is_answered_on_the_one_call_id_it_names(
        self, checker: CallChecker, body: bytes
    ) -> None:
        outcome = checker.check(body, SENDER)
        assert isinstance(outcome, Rejected) and outcome.call_id == "c-7"
        assert outcome.error.code == "MALFORMED_CALL" and outcome.dead_letter_reason

    @pytest.mark.parametrize(
        "body",
        [
            # two different call_ids (one may be an argument's): no guess
            b'{"call_id": "c-7", "arguments": {"call_id": "c-8", "x": NaN}}',
            # only inside a string (its quotes escaped)
            b'{"arguments": {"note": "\\"call_id\\": \\"c-7\\""}, "x": NaN}',
            # not a subject-safe token, or too long
            b'{"call_id": "c.7", "x": NaN}',
            b'{"call_id": "%s", "x": NaN}' % (b"a" * 129),
        ],
        ids=["two-call-ids", "inside-a-string", "unsafe", "too-long"],
    )
    def test_a_body_that_is_not_json_without_one_clear_call_id_is_undeliverable(
        self, checker: CallChecker, body: bytes
    ) -> None:
        assert isinstance(checker.check(body, SENDER), Undeliverable)

    def test_oversized_call_is_payload_too_large(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query="q" * 100_000, source_type="any", limit=1), SENDER)
        assert isinstance(outcome, Rejected) and outcome.error.code == "PAYLOAD_TOO_LARGE"
        assert outcome.principal.tenant == "acme" and outcome.principal.agent == "researcher"

    def test_json_pointer_escapes_slash_and_tilde(self, checker: CallChecker) -> None:
        from toolgate.contracts.calls import json_pointer

        assert json_pointer(["a/b", "c~d", 0]) == "/a~1b/c~0d/0"


class TestIdentityFromTheBus:
    @pytest.mark.parametrize(
        "claimed",
        [
            Principal(tenant="globex", user="u", agent="researcher", session="s"),
            Principal(tenant="acme", user="u", agent="writer", session="s"),
        ],
        ids=["other-tenant", "other-agent"],
    )
    def test_a_payload_naming_another_principal_is_denied(
        self, checker: CallChecker, claimed: Principal
    ) -> None:
        outcome = checker.check(
            raw(principal=claimed, query="agents", source_type="any", limit=1), SENDER
        )
        assert isinstance(outcome, Rejected) and outcome.status == "denied"
        assert outcome.error.code == "PRINCIPAL_MISMATCH" and not outcome.error.retryable
        # The refusal goes to the sender, never to the principal the payload named.
        assert (outcome.principal.tenant, outcome.principal.agent) == ("acme", "researcher")

    def test_user_and_session_are_the_platforms_word(self, checker: CallChecker) -> None:
        claimed = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
        outcome = checker.check(
            raw(principal=claimed, query="agents", source_type="any", limit=1),
            Identity(tenant="acme", agent="researcher"),
        )
        assert isinstance(outcome, Validated) and outcome.call.principal == claimed

    def test_the_same_payload_from_another_agent_is_that_agents_problem(
        self, checker: CallChecker
    ) -> None:
        outcome = checker.check(
            raw(query="agents", source_type="any", limit=1),
            Identity(tenant="globex", agent="researcher"),
        )
        assert isinstance(outcome, Rejected) and outcome.error.code == "PRINCIPAL_MISMATCH"
        assert outcome.principal.tenant == "globex"


class TestNesting:
    def test_depth_is_counted_in_lists_and_objects(self) -> None:
        assert nesting_depth("x", 64) == 0
        assert nesting_depth({"a": [1, {"b": []}]}, 64) == 4
        assert nesting_depth(nested(1000), 64) == 65  # counts no further than the limit + 1

    def test_arguments_deeper_than_the_limit_are_refused(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query=nested(MAX_ARGUMENT_DEPTH)), SENDER)
        assert isinstance(outcome, Rejected) and outcome.status == "invalid_arguments"
        assert outcome.error.code == "NESTING_TOO_DEEP"

    def test_arguments_at_the_limit_reach_the_schema_check(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query=nested(MAX_ARGUMENT_DEPTH - 1)), SENDER)
        assert isinstance(outcome, Rejected) and outcome.error.code == "SCHEMA_VALIDATION_FAILED"

    def test_a_call_too_deep_to_decode_still_gets_an_answer(self, checker: CallChecker) -> None:
        body = (
            b'{"call_id": "deep_1", "tool": "echo", "arguments": {"a": '
            + b"[" * 5000
            + b"]" * 5000
            + b'}, "principal": {}}'
        )
        outcome = checker.check(body, SENDER)
        assert isinstance(outcome, Rejected) and outcome.call_id == "deep_1"
        assert outcome.error.code == "NESTING_TOO_DEEP"
