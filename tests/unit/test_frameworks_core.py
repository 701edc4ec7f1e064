"""The one view of a gateway answer that LangChain, LangGraph and the Agents SDK all show."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from toolgate.client.frameworks.core import (
    CORRECTABLE,
    FINAL,
    approval_request,
    derive_call_id,
    may_need_a_human,
    not_run,
    observe,
    remedy_of,
)
from toolgate.client.frameworks.session import GatewaySession, SessionError
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import (
    ErrorDetail,
    PendingNotice,
    Status,
    ToolError,
    failure,
    is_valid_call_id,
    success,
)


def error(status: Status, code: str, retryable: bool = False, *details: ErrorDetail):
    return failure("c1", status, ToolError(code, f"{code} happened", retryable, list(details)))


class TestObserve:
    def test_ok_is_the_data_as_json_and_not_an_error(self) -> None:
        seen = observe(success("c1", {"items": [{"title": "t"}]}), "search_sources")
        assert not seen.is_error and seen.remedy == "none" and seen.status == "ok"
        assert json.loads(seen.text) == {"items": [{"title": "t"}]}

    def test_an_empty_search_is_an_observation_not_an_error(self) -> None:
        seen = observe(success("c1", {"items": []}), "search_sources")
        assert not seen.is_error and json.loads(seen.text) == {"items": []}

    def test_invalid_arguments_name_each_pointer_and_say_fix_it(self) -> None:
        result = error(
            "invalid_arguments",
            "SCHEMA_VALIDATION_FAILED",
            False,
            ErrorDetail("/limit", "50 is greater than the maximum of 10"),
        )
        seen = observe(result, "search_sources")
        assert seen.is_error and seen.remedy == "correct"
        assert "ERROR invalid_arguments (SCHEMA_VALIDATION_FAILED)" in seen.text
        assert "- /limit: 50 is greater than the maximum of 10" in seen.text
        assert "The tool did not run." in seen.text and "Correct the call" in seen.text
        assert "call_id c1" in seen.text

    def test_the_seeds_three_failures_stay_distinct(self) -> None:
        not_run = observe(error("invalid_arguments", "X"), "t").text
        failed = observe(error("execution_error", "TOOL_RAISED", True), "t").text
        broken = observe(error("invalid_tool_result", "OUTPUT_SCHEMA_VIOLATION"), "t").text
        assert "did not run" in not_run
        assert "started and failed" in failed and "may call again later" in failed
        assert "output broke its contract" in broken and "withheld" in broken

    @pytest.mark.parametrize(
        ("status", "code", "retryable", "remedy"),
        [
            ("invalid_arguments", "SCHEMA_VALIDATION_FAILED", False, "correct"),
            ("unknown_tool", "TOOL_NOT_FOUND", False, "correct"),
            ("denied", "TOOL_NOT_ALLOWED", False, "final"),
            ("denied", "RATE_LIMITED", True, "retry"),
            ("approval_denied", "APPROVAL_DENIED", False, "final"),
            ("approval_expired", "APPROVAL_EXPIRED", False, "final"),
            ("execution_error", "TOOL_RAISED", True, "retry"),
            ("execution_error", "OUTCOME_UNKNOWN", False, "final"),
            ("timeout", "TOOL_TIMEOUT", True, "retry"),
            ("invalid_tool_result", "OUTPUT_SCHEMA_VIOLATION", False, "final"),
        ],
    )
    def test_each_status_has_one_remedy(
        self, status: Status, code: str, retryable: bool, remedy: str
    ) -> None:
        result = error(status, code, retryable)
        assert remedy_of(result) == remedy
        seen = observe(result, "t")
        assert seen.is_error and seen.remedy == remedy and seen.status == status

    def test_every_error_status_is_classified(self) -> None:
        statuses = set(Status.__args__) - {"ok"}  # type: ignore[attr-defined]
        assert statuses - CORRECTABLE - FINAL == {"execution_error", "timeout"}
        assert not CORRECTABLE & FINAL


class TestWaiting:
    def test_a_call_not_paused_for_is_an_error_naming_the_call_id_never_a_success(
        self,
    ) -> None:
        notice = PendingNotice(
            call_id="tg_1",
            message="waiting for 1 human approval(s) of this high-risk call",
            expires_at="2026-12-01T09:00:00+00:00",
            arguments_sha256="ab" * 32,
        )
        request = approval_request(notice, "approved_action", {"amount": 7})
        assert request.arguments_sha256 == "ab" * 32  # what approvers vote on
        seen = not_run(request)  # DESIGN invariant 13: waiting for a human is not done
        assert seen.is_error and seen.status == "approval_pending" and seen.remedy == "final"
        assert seen.text.startswith(
            "ERROR approval_pending (APPROVAL_REQUIRED) from tool approved_action, call_id tg_1."
        )
        assert "The tool has not run" in seen.text and "2026-12-01T09:00:00" in seen.text
        assert "Do not call it again" in seen.text and "toolgate result tg_1" in seen.text
        assert request.as_dict()["kind"] == "toolgate_approval"
        json.dumps(request.as_dict())  # an interrupt payload must be JSON-ready

    def test_without_the_gateways_hash_the_hash_of_the_arguments_sent(self) -> None:
        request = approval_request(PendingNotice(call_id="tg_1"), "t", {"b": 1, "a": 2})
        assert request.arguments_sha256 == arguments_sha256({"a": 2, "b": 1})
        assert request.why and request.expires_at is None


class TestDeriveCallId:
    def test_same_call_same_id_and_a_valid_subject_token(self) -> None:
        one = derive_call_id("thread-1", "call_abc", "search_sources", {"q": 1}, "u-alice")
        assert one == derive_call_id("thread-1", "call_abc", "search_sources", {"q": 1}, "u-alice")
        assert is_valid_call_id(one) and one.startswith("tg_")

    @pytest.mark.parametrize(
        "changed",
        [
            ("thread-2", "call_abc", "search_sources", {"q": 1}, "u-alice"),
            ("thread-1", "call_abd", "search_sources", {"q": 1}, "u-alice"),
            ("thread-1", "call_abc", "fetch_document", {"q": 1}, "u-alice"),
            ("thread-1", "call_abc", "search_sources", {"q": 2}, "u-alice"),
            ("thread-1", "call_abc", "search_sources", {"q": 1}, "u-bob"),
        ],
    )
    def test_anything_else_is_another_call(self, changed: tuple) -> None:
        base = derive_call_id("thread-1", "call_abc", "search_sources", {"q": 1}, "u-alice")
        assert derive_call_id(*changed) != base

    def test_a_model_naming_an_existing_call_id_does_not_get_that_id(self) -> None:
        assert derive_call_id("t", "victim_call_1", "count_runs", {}, "u") != "victim_call_1"


def test_importing_toolgate_and_the_core_needs_no_framework() -> None:
    code = (
        "import sys, toolgate, toolgate.client.gateway_client, toolgate.client.frameworks, "
        "toolgate.client.frameworks.core, toolgate.client.frameworks.session\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('langchain', 'langchain_core', 'langgraph', 'agents')]\n"
        "print(bad)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_langgraph_integration_needs_no_langchain_package() -> None:
    """The [langgraph] extra is langgraph + langchain-core: no `langchain` import."""
    code = (
        "import sys, toolgate.client.frameworks.langgraph\n"
        "print('langchain' in {m.split('.')[0] for m in sys.modules})"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


async def test_a_session_without_agent_creds_is_a_precise_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No creds given, none in $TOOLGATE_NATS_CREDS, no `toolgate up` here: say so."""
    monkeypatch.chdir(tmp_path)
    for name in ("TOOLGATE_NATS_CREDS", "TOOLGATE_NATS_URL", "TOOLGATE_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(SessionError, match="no agent creds: give creds="):
        await GatewaySession.connect(user="u-alice", session="s-1")


def test_which_tools_may_need_a_human_by_the_registry_alone() -> None:
    from tests.harness import TEST_TOOLS_DIR
    from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry

    registry = load_registry(BUILTIN_TOOLS_DIR, TEST_TOOLS_DIR)
    flagged = {spec.name for spec in registry if may_need_a_human(spec)}
    assert flagged == {"approved_action"}  # requires_approval: true
    spec = registry.get("count_runs")
    assert spec is not None
    high_write = spec.model_copy(update={"risk": "high"})  # a high-risk side effect
    assert may_need_a_human(high_write)
    assert not may_need_a_human(spec.model_copy(update={"risk": "high", "action": "read"}))
    assert may_need_a_human(spec.model_copy(update={"risk": "critical", "action": "read"}))
