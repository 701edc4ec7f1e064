"""What the executor decides without I/O: is this authorization good, what did the tool do."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from toolgate.contracts.authorization import arguments_sha256, verify
from toolgate.contracts.calls import ErrorCode, Status, ToolError
from toolgate.contracts.events import CallAuthorized
from toolgate.contracts.registry import ToolSpec
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

ToolFunction = Callable[[dict[str, Any], ToolContext], Any]


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
    if signed != (principal.tenant, principal.agent, principal.user, principal.session,
                  event.call.task_id):
        return "authorization was issued for another principal, session or task"
    if event.principal is not None and event.principal != principal:
        return "the event's principal differs from the authorized call's"
    if arguments_sha256(event.call.arguments) != auth.arguments_sha256:
        return "arguments differ from the ones that were authorized"
    return None


def is_expired(event: CallAuthorized, now: datetime) -> bool:
    return event.authorization.expires_at <= now


def resolve_function(spec: ToolSpec) -> ToolFunction:
    """Import the operator-chosen function named in the registry file (never a model's string)."""
    module_name, _, attr = spec.function.partition(":")
    function = getattr(importlib.import_module(module_name), attr, None)
    if not callable(function):
        raise ImportError(f"{spec.name}: {spec.function} is not a callable")
    return function  # type: ignore[no-any-return]


@dataclass(frozen=True)
class ToolOutcome:
    status: Status
    duration_ms: float
    output: Any = None
    error: ToolError | None = None


async def run_tool(function: ToolFunction, arguments: dict[str, Any], ctx: ToolContext,
                   spec: ToolSpec, pool: ThreadPoolExecutor) -> ToolOutcome:
    """Run under the tool's timeout; classify what happened. Never raises."""
    started = time.perf_counter()

    def elapsed() -> float:
        return (time.perf_counter() - started) * 1000

    try:
        if inspect.iscoroutinefunction(function):
            coro = function(arguments, ctx)
        else:
            # Sync tools run in our own pool: a hung tool holds one thread, not the loop.
            coro = asyncio.get_running_loop().run_in_executor(pool, function, arguments, ctx)
        output = await asyncio.wait_for(coro, timeout=spec.timeout_s)
    except TimeoutError:
        return ToolOutcome("timeout", elapsed(), error=ToolError(
            code=ErrorCode.TOOL_TIMEOUT,
            message=f"{spec.name} did not finish within {spec.timeout_s:g}s",
            retryable=spec.retryable_errors))
    except ToolRefused as exc:
        return ToolOutcome("execution_error", elapsed(), error=ToolError(
            code=ErrorCode.TOOL_REFUSED, message=str(exc), retryable=False))
    except ToolUnavailable as exc:
        return ToolOutcome("execution_error", elapsed(), error=ToolError(
            code=ErrorCode.TOOL_RAISED, message=str(exc), retryable=spec.retryable_errors))
    except Exception as exc:  # the tool's own bug: report it, never crash the executor
        return ToolOutcome("execution_error", elapsed(), error=ToolError(
            code=ErrorCode.TOOL_RAISED, message=f"{type(exc).__name__}: {exc}",
            retryable=spec.retryable_errors))
    try:
        msgspec.json.encode(output)
    except (TypeError, ValueError, OverflowError) as exc:
        return ToolOutcome("invalid_tool_result", elapsed(), error=ToolError(
            code=ErrorCode.OUTPUT_SCHEMA_VIOLATION,
            message=f"{spec.name} returned a value that is not JSON: {exc}", retryable=False))
    return ToolOutcome("ok", elapsed(), output=output)
