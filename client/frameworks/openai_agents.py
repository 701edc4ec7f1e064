"""OpenAI Agents SDK: function tools backed by the gateway, statuses mapped onto its hooks.

`gateway_function_tools(session)` gives one `FunctionTool` per tool this agent
may call (the registry's name, description and input schema, not strict:
the gateway checks the arguments). Invoking one publishes a `ToolCall`; what
the model reads is the same text as in the LangChain integration. The
gateway's statuses map onto the SDK's own extension points:

- **approval**: for a tool the registry says may need a human
  (`requires_approval`, `critical`, or a `high`-risk side effect), the SDK's
  `needs_approval` hook publishes the call and says yes when the gateway
  answers that a human must decide. The SDK then stops the run with an
  interruption (`result.interruptions`); the run state can be serialized
  (`result.to_state().to_json()`) and resumed later, in another process (give
  the session a `namespace`, e.g. the conversation id, so the resumed run's
  calls keep their call_ids). The human decides in toolgate (`toolgate
  approvals approve ...`); `state.approve(item)` only lets the run go on, and
  the tool invocation then fetches the gateway's final result for that call
  (it ran once, in the gateway, or it was refused). `state.reject(item)` ends
  it on the SDK side only: the gateway call stays waiting until a human
  decides or it expires. Other tools are published when invoked, after the
  SDK's own tool input guardrails (`needs_approval` runs before those, so it
  must not publish what a guardrail may still stop); should a policy ask for a
  human there (or a run be let go on before a human decided in toolgate), the
  tool call fails: an `approval_pending` error naming the call_id, which the
  output guardrail rejects like any error (or halts on, with
  `halt_on={"approval_pending"}`), never a success: the tool has not run.
- **tool output guardrail** (`gateway_status_guardrail`): `ok` is allowed;
  any error status is `reject_content` with the gateway's error text (so the
  run's `tool_output_guardrail_results` record which calls the gateway
  refused, and why); statuses in `halt_on` (e.g. `{"denied"}`) raise the
  SDK's tripwire instead, ending the run.

    pip install 'toolgate[openai-agents]'
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from agents import FunctionTool, RunContextWrapper
from agents.tool_context import ToolContext
from agents.tool_guardrails import (
    ToolGuardrailFunctionOutput,
    ToolOutputGuardrail,
    ToolOutputGuardrailData,
)

from toolgate.client.adapters import InvalidToolCallArguments, parse_arguments
from toolgate.client.gateway_client import ResultTimeout
from toolgate.contracts.calls import ErrorCode, PendingNotice, ToolError, ToolResult, failure
from toolgate.contracts.registry import ToolSpec

from .core import ApprovalRequest, Observation, may_need_a_human, observe
from .session import GatewaySession, timed_out

__all__ = ["GatewayOutput", "gateway_function_tools", "gateway_status_guardrail"]


@dataclass(frozen=True)
class GatewayOutput:
    """What a gateway-backed tool returns: the model reads `str()` of it; guardrails and the
    platform read the observation and the gateway's result or approval request."""

    observation: Observation
    outcome: ToolResult | ApprovalRequest

    def __str__(self) -> str:
        return self.observation.text


def gateway_status_guardrail(halt_on: Iterable[str] = ()) -> ToolOutputGuardrail[Any]:
    """A tool output guardrail over the gateway's status (see the module docstring)."""
    halting = frozenset(halt_on)

    def check(data: ToolOutputGuardrailData) -> ToolGuardrailFunctionOutput:
        output = data.output
        if not isinstance(output, GatewayOutput) or not output.observation.is_error:
            return ToolGuardrailFunctionOutput.allow()
        seen = output.observation
        info = {"call_id": seen.call_id, "status": seen.status, "remedy": seen.remedy}
        if seen.status in halting:
            return ToolGuardrailFunctionOutput.raise_exception(output_info=info)
        return ToolGuardrailFunctionOutput.reject_content(seen.text, output_info=info)

    return ToolOutputGuardrail(guardrail_function=check, name="toolgate_status")


def _malformed(call_id: str, message: str) -> ToolResult:
    return failure(
        call_id,
        "invalid_arguments",
        ToolError(code=ErrorCode.MALFORMED_CALL, message=message, retryable=False),
    )


def _function_tool(
    spec: ToolSpec, session: GatewaySession, guardrail: ToolOutputGuardrail[Any]
) -> FunctionTool:
    name = spec.name
    asks_first = may_need_a_human(spec)

    async def invoke(ctx: ToolContext[Any], raw_arguments: str) -> GatewayOutput:
        try:
            arguments = parse_arguments(ctx.tool_call_id, raw_arguments)
        except InvalidToolCallArguments as exc:
            result = _malformed(session.call_id_for(ctx.tool_call_id, name, {}), exc.message)
            return GatewayOutput(observe(result, name), result)
        if asks_first:
            # Published by needs_approval; the SDK invokes once it may go on (after a
            # human's approval, when the run resumes): wait for the final result, not
            # for the pending notice still stored from before.
            call_id = session.call_id_for(ctx.tool_call_id, name, arguments)
            final = await session.final(call_id, name, arguments, session.timeout)
            if final is not None:
                return GatewayOutput(observe(final, name), final)
        seen, outcome = await session.observe(name, arguments, ctx.tool_call_id)
        return GatewayOutput(seen, outcome)

    async def needs_approval(
        ctx: RunContextWrapper[Any], arguments: dict[str, Any], tool_call_id: str
    ) -> bool:
        # Published here, before the SDK decides whether to run the tool; the
        # invocation after it submits the same call_id, answered from the record.
        call_id = session.call_id_for(tool_call_id, name, arguments)
        try:
            outcome = await session.decide(call_id, name, arguments)
        except ResultTimeout:
            outcome = timed_out(call_id, session.timeout)
        return isinstance(outcome, PendingNotice)

    return FunctionTool(
        name=name,
        description=spec.description.strip(),
        params_json_schema=spec.input_schema,
        on_invoke_tool=invoke,
        strict_json_schema=False,
        tool_output_guardrails=[guardrail],
        # Asking the gateway in needs_approval publishes the call before the SDK's own
        # tool input guardrails run, so only tools that may need a human are asked there.
        needs_approval=needs_approval if asks_first else False,
    )


def gateway_function_tools(
    session: GatewaySession, *, halt_on: Iterable[str] = ()
) -> list[FunctionTool]:
    """One FunctionTool per tool this agent may call, each asking the gateway."""
    guardrail = gateway_status_guardrail(halt_on)
    return [_function_tool(spec, session, guardrail) for spec in session.tools()]
