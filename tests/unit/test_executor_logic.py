from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from toolgate.contracts.calls import Principal
from toolgate.contracts.registry import load_registry
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable
from toolgate.services.executor.logic import run_tool

SPEC = load_registry().get("echo")
POOL = ThreadPoolExecutor(4)


def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(call_id="c1", tool="echo", principal=Principal("t", "u", "a", "s"),
                       task_id=None, data_dir=tmp_path)


def sleeps(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    time.sleep(5)
    return {}


def refuses(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    raise ToolRefused("host not allowed")


def unavailable(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    raise ToolUnavailable("backend down")


def buggy(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    raise KeyError("oops")


def not_json(arguments: dict[str, Any], ctx: ToolContext) -> Any:
    return {"when": object()}


async def async_ok(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"payload": arguments}


@pytest.mark.parametrize(("function", "status", "code", "retryable"), [
    (refuses, "execution_error", "TOOL_REFUSED", False),
    (unavailable, "execution_error", "TOOL_RAISED", True),
    (buggy, "execution_error", "TOOL_RAISED", True),
    (not_json, "invalid_tool_result", "OUTPUT_SCHEMA_VIOLATION", False),
])
async def test_tool_failures_are_classified(tmp_path: Path, function: Any, status: str,
                                            code: str, retryable: bool) -> None:
    assert SPEC is not None
    outcome = await run_tool(function, {}, ctx(tmp_path), SPEC, POOL)
    assert (outcome.status, outcome.error.code if outcome.error else None) == (status, code)
    assert outcome.error is not None and outcome.error.retryable is retryable


async def test_tool_past_its_timeout_is_a_timeout(tmp_path: Path) -> None:
    assert SPEC is not None
    fast = SPEC.model_copy(update={"timeout_s": 0.05})
    outcome = await run_tool(sleeps, {}, ctx(tmp_path), fast, POOL)
    assert outcome.status == "timeout" and outcome.error is not None


async def test_async_tool_runs_on_the_loop(tmp_path: Path) -> None:
    assert SPEC is not None
    outcome = await run_tool(async_ok, {"x": 1}, ctx(tmp_path), SPEC, POOL)
    assert outcome.status == "ok" and outcome.output == {"payload": {"x": 1}}
