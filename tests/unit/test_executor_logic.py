from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest

from toolgate.contracts.authorization import (
    arguments_sha256,
    ensure_keypair,
    load_private_key,
    load_public_key,
    sign,
)
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import Authorization, CallAuthorized, utc_now
from toolgate.contracts.registry import load_registry
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable
from toolgate.services.executor.logic import refusal_reason, run_tool

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


ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")


def authorized(tmp_path: Path, call: ToolCall, signed_for: ToolCall | None = None,
               event_principal: Principal | None = None) -> CallAuthorized:
    """A CallAuthorized carrying `call`, signed by the policy key for `signed_for`."""
    ensure_keypair(tmp_path)
    basis = signed_for or call
    p = basis.principal
    auth = sign(Authorization(
        call_id=basis.call_id, tool=basis.tool, arguments_sha256=arguments_sha256(
            basis.arguments), policy_version="v1", expires_at=utc_now(), tenant=p.tenant,
        agent=p.agent, user=p.user, session=p.session, task_id=basis.task_id),
        load_private_key(tmp_path))
    return CallAuthorized(event_id="e1", call_id=call.call_id, occurred_at=utc_now(),
                          service="policy", tool=call.tool, call=call,
                          principal=event_principal or call.principal,
                          policy_version="v1", authorization=auth)


class TestRefusalReason:
    CALL = ToolCall(call_id="c1", tool="echo", arguments={"payload": 1}, principal=ALICE,
                    task_id="task-1")

    def test_the_call_it_was_signed_for_runs(self, tmp_path: Path) -> None:
        assert refusal_reason(authorized(tmp_path, self.CALL), load_public_key(tmp_path),
                              "echo") is None

    @pytest.mark.parametrize("change", [
        {"tenant": "globex"}, {"agent": "writer"}, {"user": "u-mallory"},
        {"session": "s-other"}])
    def test_a_signed_authorization_moved_to_another_principal_is_refused(
            self, tmp_path: Path, change: dict[str, str]) -> None:
        moved = msgspec.structs.replace(
            self.CALL, principal=msgspec.structs.replace(ALICE, **change))
        reason = refusal_reason(authorized(tmp_path, moved, signed_for=self.CALL),
                                load_public_key(tmp_path), "echo")
        assert reason == "authorization was issued for another principal, session or task"

    def test_a_signed_authorization_moved_to_another_task_is_refused(
            self, tmp_path: Path) -> None:
        moved = msgspec.structs.replace(self.CALL, task_id="task-other")
        assert "another principal, session or task" in str(refusal_reason(
            authorized(tmp_path, moved, signed_for=self.CALL), load_public_key(tmp_path),
            "echo"))

    def test_an_event_principal_other_than_the_calls_is_refused(self, tmp_path: Path) -> None:
        other = msgspec.structs.replace(ALICE, tenant="globex")
        event = authorized(tmp_path, self.CALL, event_principal=other)
        assert refusal_reason(event, load_public_key(tmp_path), "echo") == (
            "the event's principal differs from the authorized call's")
