from __future__ import annotations

from toolgate.contracts.calls import Principal, ToolError
from toolgate.contracts.events import ExecutionFailed, ExecutionSucceeded, utc_now
from toolgate.contracts.registry import load_registry
from toolgate.services.attacher.logic import ResultBuilder

BUILDER = ResultBuilder(load_registry())
PRINCIPAL = Principal(tenant="acme", user="u", agent="researcher", session="s")


def succeeded(output: object, tool: str = "search_sources") -> ExecutionSucceeded:
    return ExecutionSucceeded(
        event_id="e",
        call_id="c1",
        occurred_at=utc_now(),
        service="executor",
        tool=tool,
        principal=PRINCIPAL,
        output=output,
        duration_ms=1.0,
    )


def test_output_matching_its_schema_is_passed_on() -> None:
    result = BUILDER.result_for(succeeded({"items": []}))
    assert result.ok and result.status == "ok" and result.data == {"items": []}


def test_output_breaking_its_schema_is_withheld_with_paths() -> None:
    result = BUILDER.result_for(succeeded({"items": [{"title": 1}]}))
    assert result.status == "invalid_tool_result" and result.data is None
    assert result.error is not None
    assert {d.path for d in result.error.details} >= {"/items/0", "/items/0/title"}


def test_output_of_a_tool_without_known_schema_is_withheld() -> None:
    result = BUILDER.result_for(succeeded({"anything": 1}, tool="not_registered"))
    assert result.status == "invalid_tool_result" and result.data is None


def test_failure_keeps_its_status_and_retryability() -> None:
    event = ExecutionFailed(
        event_id="e",
        call_id="c1",
        occurred_at=utc_now(),
        service="executor",
        tool="fetch_document",
        status="timeout",
        error=ToolError(code="TOOL_TIMEOUT", message="slow", retryable=True),
    )
    result = BUILDER.result_for(event)
    assert result.status == "timeout" and result.error is not None and result.error.retryable
