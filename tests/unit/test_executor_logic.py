from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
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
from toolgate.services.executor.logic import (
    MAX_OUTPUT_BYTES,
    Conclude,
    OutcomeRecord,
    Refuse,
    Replay,
    Run,
    refusal_reason,
    run_tool,
    step_for_recorded,
    step_once_claimed,
)

SPEC = load_registry().get("echo")
POOL = ThreadPoolExecutor(4)


def ctx(tmp_path: Path) -> ToolContext:
    return ToolContext(
        call_id="c1",
        tool="echo",
        principal=Principal("t", "u", "a", "s"),
        task_id=None,
        data_dir=tmp_path,
    )


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


def too_large(arguments: dict[str, Any], ctx: ToolContext) -> Any:
    # One byte over: no message could carry it to the agent.
    return "x" * (MAX_OUTPUT_BYTES - 1)


async def async_ok(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    await asyncio.sleep(0)
    return {"payload": arguments}


@pytest.mark.parametrize(
    ("function", "status", "code", "retryable"),
    [
        (refuses, "execution_error", "TOOL_REFUSED", False),
        (unavailable, "execution_error", "TOOL_RAISED", True),
        (buggy, "execution_error", "TOOL_RAISED", True),
        (not_json, "invalid_tool_result", "OUTPUT_SCHEMA_VIOLATION", False),
        (too_large, "invalid_tool_result", "OUTPUT_TOO_LARGE", False),
    ],
)
async def test_tool_failures_are_classified(
    tmp_path: Path, function: Any, status: str, code: str, retryable: bool
) -> None:
    assert SPEC is not None
    outcome = await run_tool(function, {}, ctx(tmp_path), SPEC, POOL)
    assert (outcome.status, outcome.error.code if outcome.error else None) == (status, code)
    assert outcome.error is not None and outcome.error.retryable is retryable


async def test_output_of_exactly_the_largest_size_is_passed_on(tmp_path: Path) -> None:
    assert SPEC is not None

    def at_the_limit(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        return "x" * (MAX_OUTPUT_BYTES - 2)  # with its two quotes: MAX_OUTPUT_BYTES of JSON

    outcome = await run_tool(at_the_limit, {}, ctx(tmp_path), SPEC, POOL)
    assert outcome.status == "ok" and len(outcome.output) == MAX_OUTPUT_BYTES - 2


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


def authorized(
    tmp_path: Path,
    call: ToolCall,
    signed_for: ToolCall | None = None,
    event_principal: Principal | None = None,
) -> CallAuthorized:
    """A CallAuthorized carrying `call`, signed by the policy key for `signed_for`."""
    ensure_keypair(tmp_path)
    basis = signed_for or call
    p = basis.principal
    auth = sign(
        Authorization(
            call_id=basis.call_id,
            tool=basis.tool,
            arguments_sha256=arguments_sha256(basis.arguments),
            policy_version="v1",
            expires_at=utc_now(),
            tenant=p.tenant,
            agent=p.agent,
            user=p.user,
            session=p.session,
            task_id=basis.task_id,
        ),
        load_private_key(tmp_path),
    )
    return CallAuthorized(
        event_id="e1",
        call_id=call.call_id,
        occurred_at=utc_now(),
        service="policy",
        tool=call.tool,
        call=call,
        principal=event_principal or call.principal,
        policy_version="v1",
        authorization=auth,
    )


class TestRefusalReason:
    CALL = ToolCall(
        call_id="c1", tool="echo", arguments={"payload": 1}, principal=ALICE, task_id="task-1"
    )

    def test_the_call_it_was_signed_for_runs(self, tmp_path: Path) -> None:
        assert (
            refusal_reason(authorized(tmp_path, self.CALL), load_public_key(tmp_path), "echo")
            is None
        )

    @pytest.mark.parametrize(
        "change",
        [{"tenant": "globex"}, {"agent": "writer"}, {"user": "u-mallory"}, {"session": "s-other"}],
    )
    def test_a_signed_authorization_moved_to_another_principal_is_refused(
        self, tmp_path: Path, change: dict[str, str]
    ) -> None:
        moved = msgspec.structs.replace(
            self.CALL, principal=msgspec.structs.replace(ALICE, **change)
        )
        reason = refusal_reason(
            authorized(tmp_path, moved, signed_for=self.CALL), load_public_key(tmp_path), "echo"
        )
        assert reason == "authorization was issued for another principal, session or task"

    def test_a_signed_authorization_moved_to_another_task_is_refused(self, tmp_path: Path) -> None:
        moved = msgspec.structs.replace(self.CALL, task_id="task-other")
        assert "another principal, session or task" in str(
            refusal_reason(
                authorized(tmp_path, moved, signed_for=self.CALL), load_public_key(tmp_path), "echo"
            )
        )

    def test_an_event_principal_other_than_the_calls_is_refused(self, tmp_path: Path) -> None:
        other = msgspec.structs.replace(ALICE, tenant="globex")
        event = authorized(tmp_path, self.CALL, event_principal=other)
        assert refusal_reason(event, load_public_key(tmp_path), "echo") == (
            "the event's principal differs from the authorized call's"
        )


class TestWhatToDoWithARecordedCall:
    """The claim/replay/OUTCOME_UNKNOWN state machine, without NATS."""

    sha = "a" * 64

    def record(
        self, state: str, sha: str | None = None, attempt: int = 1, event: bytes | None = None
    ) -> OutcomeRecord:
        return OutcomeRecord(
            state=state,
            arguments_sha256=sha or self.sha,  # type: ignore[arg-type]
            attempt=attempt,
            worker="w",
            event=event,
        )

    def test_a_finished_call_replays_its_recorded_event(self) -> None:
        step = step_for_recorded(self.record("done", event=b"stored"), self.sha, SPEC)
        assert step == Replay(b"stored")

    def test_the_same_call_id_with_other_arguments_is_refused_not_run(self) -> None:
        step = step_for_recorded(self.record("done", sha="b" * 64, event=b"x"), self.sha, SPEC)
        assert isinstance(step, Refuse) and "CALL_ID_REUSED" in step.reason

    def test_an_interrupted_non_idempotent_call_ends_outcome_unknown(self) -> None:
        spec = SPEC.model_copy(update={"idempotent": False})  # type: ignore[union-attr]
        step = step_for_recorded(self.record("started", attempt=2), self.sha, spec)
        assert isinstance(step, Conclude) and step.attempt == 2
        assert step.outcome.error is not None
        assert step.outcome.error.code == "OUTCOME_UNKNOWN"
        assert step.outcome.error.retryable is False

    def test_an_interrupted_idempotent_call_runs_again_as_the_next_attempt(self) -> None:
        spec = SPEC.model_copy(update={"idempotent": True})  # type: ignore[union-attr]
        assert step_for_recorded(self.record("started", attempt=2), self.sha, spec) == Run(3)

    def test_a_claimed_call_runs_unless_its_authorization_ran_out(self) -> None:
        now = utc_now()
        event = CallAuthorized(
            event_id="e",
            call_id="c1",
            occurred_at=now,
            service="policy",
            call=ToolCall(
                call_id="c1", tool="echo", arguments={}, principal=Principal("t", "u", "a", "s")
            ),
            policy_version="v",
            authorization=Authorization(
                call_id="c1",
                tool="echo",
                arguments_sha256=self.sha,
                policy_version="v",
                expires_at=now + timedelta(seconds=5),
            ),
        )
        assert step_once_claimed(event, 1, now) == Run(1)
        late = step_once_claimed(event, 1, now + timedelta(seconds=6))
        assert isinstance(late, Conclude) and late.outcome.error is not None
        assert late.outcome.error.code == "POLICY_DENIED" and late.outcome.error.retryable
