from __future__ import annotations

import msgspec
import pytest

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import load_registry
from toolgate.services.validator.logic import CallChecker, Rejected, Undeliverable, Validated

PRINCIPAL = Principal(tenant="acme", user="u", agent="researcher", session="s")


@pytest.fixture(scope="module")
def checker() -> CallChecker:
    return CallChecker(load_registry(), max_call_bytes=64 * 1024)


def raw(call_id: str = "call_1", tool: str = "search_sources", **arguments: object) -> bytes:
    return msgspec.json.encode(ToolCall(call_id=call_id, tool=tool, arguments=dict(arguments),
                                        principal=PRINCIPAL))


class TestCheckCall:
    def test_valid_call_is_validated(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query="agents", source_type="any", limit=3))
        assert isinstance(outcome, Validated) and outcome.call.arguments["limit"] == 3

    def test_every_schema_error_is_reported_with_its_json_path(self,
                                                               checker: CallChecker) -> None:
        outcome = checker.check(raw(query="x", source_type="blog", limit=50, extra=1))
        assert isinstance(outcome, Rejected) and outcome.status == "invalid_arguments"
        paths = sorted(d.path for d in outcome.error.details)
        assert paths == ["", "/limit", "/query", "/source_type"]

    def test_unknown_tool_is_unknown_tool(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(tool="rm_rf"))
        assert isinstance(outcome, Rejected) and outcome.status == "unknown_tool"
        assert outcome.error.code == "TOOL_NOT_FOUND"

    def test_unsafe_call_id_cannot_be_answered_so_it_is_dead_lettered(
            self, checker: CallChecker) -> None:
        outcome = checker.check(raw(call_id="toolgate.results.>"))
        assert isinstance(outcome, Undeliverable) and "subject-safe" in outcome.reason

    def test_malformed_call_with_readable_call_id_gets_a_result_and_a_dead_letter(
            self, checker: CallChecker) -> None:
        outcome = checker.check(b'{"call_id": "c1", "tool": 5}')
        assert isinstance(outcome, Rejected) and outcome.error.code == "MALFORMED_CALL"
        assert outcome.dead_letter_reason is not None

    def test_not_json_is_undeliverable(self, checker: CallChecker) -> None:
        assert isinstance(checker.check(b"\xff\x00garbage"), Undeliverable)

    def test_oversized_call_is_payload_too_large(self, checker: CallChecker) -> None:
        outcome = checker.check(raw(query="q" * 100_000, source_type="any", limit=1))
        assert isinstance(outcome, Rejected) and outcome.error.code == "PAYLOAD_TOO_LARGE"

    def test_json_pointer_escapes_slash_and_tilde(self, checker: CallChecker) -> None:
        from toolgate.services.validator.logic import json_pointer
        assert json_pointer(["a/b", "c~d", 0]) == "/a~1b/c~0d/0"
