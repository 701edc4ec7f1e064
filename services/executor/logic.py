"""What the executor decides without I/O: is this authorization good, what to do with a
call given its outcome record (run, replay, refuse, or end it unrun), what the tool did."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from toolgate.contracts.authorization import arguments_sha256, verify
from toolgate.contracts.calls import ErrorCode, Status, ToolError
from toolgate.contracts.events import CallAuthorized
from toolgate.contracts.registry import ToolSpec
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable, is_inline

# The largest output a tool may return (as JSON). Its terminal event, its stored
# outcome and its result each carry it, in messages of at most MAX_MESSAGE_BYTES
# (8 MiB, runtime/topology.py) beside the call's own fields; a larger output
# would fail every publish and leave the agent without an answer.
MAX_OUTPUT_BYTES = 4 * 1024 * 1024

ToolFunction = Callable[[dict[str, Any], ToolContext], Any]


class OutcomeRecord(msgspec.Struct, frozen=True):
    """The executor's memory of one call, kept under (tenant, agent, call_id)."""

    state: Literal["started", "done"]
    arguments_sha256: str
    attempt: int
    worker: str
    # The encoded terminal event (ExecutionSucceeded / ExecutionFailed), when done.
    event: bytes | None = None
    # When its ExecutionStarted says it started, for a tool recorded once (its start is
    # published with its end, and replayed from this record): a replay under the same
    # event id is the same event, even past the stream's duplicate window.
    started_at: datetime | None = None


@dataclass(frozen=True)
class Refuse:
    """Do not run, and do not end the call: this message is not a valid request to run."""

    reason: str


@dataclass(frozen=True)
class Replay:
    """The call ran before: publish its recorded terminal event again."""

    stored_event: bytes


@dataclass(frozen=True)
class Conclude:
    """End the call with this outcome without running the tool."""

    outcome: ToolOutcome
    attempt: int


@dataclass(frozen=True)
class Run:
    attempt: int


Step = Refuse | Replay | Conclude | Run


def step_for_recorded(record: OutcomeRecord, arguments_sha256: str, spec: ToolSpec) -> Step:
    """A record exists for this call (it was claimed before): what now?

    Invariant 2: redelivery never re-runs a side effect. A finished call replays;
    an interrupted one runs again only if its tool is idempotent, else it ends
    OUTCOME_UNKNOWN. `Run` asks the caller to re-claim the record first.
    """
    if record.arguments_sha256 != arguments_sha256:
        return Refuse(f"{ErrorCode.CALL_ID_REUSED}: call_id already ran with other arguments")
    if record.state == "done" and record.event is not None:
        return Replay(record.event)
    # `started` and never finished: the last attempt died mid-run.
    if not spec.idempotent:
        return Conclude(
            ToolOutcome(
                "execution_error",
                0.0,
                error=ToolError(
                    code=ErrorCode.OUTCOME_UNKNOWN,
                    message=f"an earlier attempt of {spec.name} was interrupted; it may or may not "
                    "have taken effect, so it is not run again",
                    retryable=False,
                ),
            ),
            record.attempt,
        )
    return Run(record.attempt + 1)


def step_once_claimed(event: CallAuthorized, attempt: int, now: datetime) -> Conclude | Run:
    """This worker holds the call's record: run it, unless the authorization ran out."""
    if is_expired(event, now):
        return Conclude(
            ToolOutcome(
                "execution_error",
                0.0,
                error=ToolError(
                    code=ErrorCode.POLICY_DENIED,
                    message="the authorization expired before execution",
                    retryable=True,
                ),
            ),
            attempt,
        )
    return Run(attempt)


def user_token_problem(
    token: str | None, expires_at: float | None, now_s: float, leeway_s: float
) -> Conclude | None:
    """A tool that acts for the user, with an OIDC issuer configured: the sealed token of
    the call must be there and not have expired (an approval may outlast it). None: run.
    `expires_at`: the token's `exp` (it was verified by the validator)."""
    if token is None:
        code, message = (
            ErrorCode.USER_TOKEN_REQUIRED,
            "no user token is held for this call (it was never sent, or was kept longer "
            "than the gateway keeps one): send the call again with the user's token",
        )
    elif expires_at is None or expires_at + leeway_s <= now_s:
        code, message = (
            ErrorCode.USER_TOKEN_EXPIRED,
            "the user's token expired before the tool could run (an approval took longer "
            "than the token lives): send the call again, under a new call_id, with a fresh token",
        )
    else:
        return None
    return Conclude(ToolOutcome("denied", 0.0, error=ToolError(code, message, True)), 0)


def refusal_reason(event: CallAuthorized, public_key: Ed25519PublicKey, tool: str) -> str | None:
    """Why this message must not run, or None. Checked before anything runs."""
    auth = event.authorization
    if not verify(auth, public_key):
        return "authorization signature is missing or invalid"
    if auth.call_id != event.call.call_id or event.call_id != auth.call_id:
        return "authorization was issued for another call_id"
    if auth.tool != event.call.tool or auth.tool != tool:
        return f"authorization is for tool {auth.tool!r}, not {tool!r}"
    principal = event.call.principal
    signed = (auth.tenant, auth.agent, auth.user, auth.session, auth.task_id)
    if signed != (
        principal.tenant,
        principal.agent,
        principal.user,
        principal.session,
        event.call.task_id,
    ):
        return "authorization was issued for another principal, session or task"
    if event.principal is not None and event.principal != principal:
        return "the event's principal differs from the authorized call's"
    if arguments_sha256(event.call.arguments) != auth.arguments_sha256:
        return "arguments differ from the ones that were authorized"
    return None


def is_expired(event: CallAuthorized, now: datetime) -> bool:
    return event.authorization.expires_at <= now


def resolve_function(spec: ToolSpec) -> ToolFunction:
    """Import the operator-chosen function named in the registry file (never a model's string).

    A tool declared as an upstream MCP tool (`mcp:`) is a call to that server instead, one
    declared `http:` one HTTP request."""
    if spec.mcp is not None:
        from toolgate.services.executor.upstream_mcp import upstream_tool

        return upstream_tool(spec.mcp)
    if spec.http is not None:
        from toolgate.services.executor.upstream_http import http_tool

        return http_tool(spec.name, spec.http, spec.timeout_s)
    assert spec.function is not None  # the registry requires one of the two
    module_name, _, attr = spec.function.partition(":")
    function = getattr(importlib.import_module(module_name), attr, None)
    if not callable(function):
        raise ImportError(f"{spec.name}: {spec.function} is not a callable")
    return function


@dataclass(frozen=True)
class ToolOutcome:
    status: Status
    duration_ms: float
    output: Any = None
    error: ToolError | None = None


async def run_tool(
    function: ToolFunction,
    arguments: dict[str, Any],
    ctx: ToolContext,
    spec: ToolSpec,
    pool: ThreadPoolExecutor,
) -> ToolOutcome:
    """Run under the tool's timeout; classify what happened. Never raises."""
    started = time.perf_counter()

    def elapsed() -> float:
        return (time.perf_counter() - started) * 1000

    try:
        if inspect.iscoroutinefunction(function):
            output = await asyncio.wait_for(function(arguments, ctx), timeout=spec.timeout_s)
        elif is_inline(function):  # declared instant and non-blocking (runs_inline)
            output = function(arguments, ctx)
        else:
            # Sync tools run in our own pool: a hung tool holds one thread, not the loop.
            in_pool = asyncio.get_running_loop().run_in_executor(pool, function, arguments, ctx)
            output = await asyncio.wait_for(in_pool, timeout=spec.timeout_s)
    except TimeoutError:
        return ToolOutcome(
            "timeout",
            elapsed(),
            error=ToolError(
                code=ErrorCode.TOOL_TIMEOUT,
                message=f"{spec.name} did not finish within {spec.timeout_s:g}s",
                retryable=spec.retryable_errors,
            ),
        )
    except ToolRefused as exc:
        return ToolOutcome(
            "execution_error",
            elapsed(),
            error=ToolError(code=exc.code, message=str(exc), retryable=False),
        )
    except ToolUnavailable as exc:
        return ToolOutcome(
            "execution_error",
            elapsed(),
            error=ToolError(code=exc.code, message=str(exc), retryable=spec.retryable_errors),
        )
    except Exception as exc:  # the tool's own bug: report it, never crash the executor
        return ToolOutcome(
            "execution_error",
            elapsed(),
            error=ToolError(
                code=ErrorCode.TOOL_RAISED,
                message=f"{type(exc).__name__}: {exc}",
                retryable=spec.retryable_errors,
            ),
        )
    try:
        size = len(msgspec.json.encode(output))
    except (TypeError, ValueError, OverflowError) as exc:
        return ToolOutcome(
            "invalid_tool_result",
            elapsed(),
            error=ToolError(
                code=ErrorCode.OUTPUT_SCHEMA_VIOLATION,
                message=f"{spec.name} returned a value that is not JSON: {exc}",
                retryable=False,
            ),
        )
    if size > MAX_OUTPUT_BYTES:
        return ToolOutcome(
            "invalid_tool_result",
            elapsed(),
            error=ToolError(
                code=ErrorCode.OUTPUT_TOO_LARGE,
                message=f"{spec.name} returned {size} bytes of output; a result holds at most "
                f"{MAX_OUTPUT_BYTES} (the output was withheld)",
                retryable=False,
            ),
        )
    return ToolOutcome("ok", elapsed(), output=output)
