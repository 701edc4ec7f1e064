"""Turning a terminal event into the one ToolResult the agent sees.

A tool's output reaches the agent only if it satisfies the tool's
output_schema; otherwise the agent gets `invalid_tool_result` and never the
malformed data.
"""

from __future__ import annotations

import jsonschema_rs
import msgspec

from toolgate.contracts.calls import (
    MAX_DETAILS,
    ErrorCode,
    ErrorDetail,
    Provenance,
    ToolError,
    ToolResult,
    failure,
    json_pointer,
    success,
)
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalExpired,
    ArgumentsRejected,
    CallAbandoned,
    CallDenied,
    Event,
    ExecutionFailed,
    ExecutionSucceeded,
)
from toolgate.contracts.registry import Registry, http_origin_and_path


class ResultBuilder:
    def __init__(self, registry: Registry) -> None:
        self._validators = {
            spec.name: jsonschema_rs.validator_for(spec.output_schema) for spec in registry
        }
        # Results of an upstream (MCP or HTTP) tool say where they came from: untrusted.
        self._provenance = {
            spec.name: Provenance(source="mcp", server=spec.mcp.server, tool=spec.mcp.tool)
            for spec in registry
            if spec.mcp is not None
        }
        for spec in registry:
            if spec.http is not None:
                origin, path = http_origin_and_path(spec.http.url)
                self._provenance[spec.name] = Provenance(
                    source="http", server=origin, tool=f"{spec.http.method} {path}"
                )

    def result_for(self, event: Event) -> ToolResult:
        if isinstance(event, ExecutionSucceeded | ExecutionFailed):
            result = (
                self._checked_output(event)
                if isinstance(event, ExecutionSucceeded)
                else failure(event.call_id, event.status, event.error)
            )
            provenance = self._provenance.get(event.tool)
            if provenance is not None:
                result = msgspec.structs.replace(result, provenance=provenance)
            return result
        if isinstance(
            event,
            ArgumentsRejected | CallDenied | ApprovalDenied | ApprovalExpired | CallAbandoned,
        ):
            return failure(event.call_id, event.status, event.error)
        raise TypeError(f"{type(event).__name__} is not a terminal event")

    def _checked_output(self, event: ExecutionSucceeded) -> ToolResult:
        validator = self._validators.get(event.tool)
        if validator is None:
            return failure(
                event.call_id,
                "invalid_tool_result",
                ToolError(
                    code=ErrorCode.OUTPUT_SCHEMA_VIOLATION,
                    message=f"no output_schema is known for {event.tool!r}; output withheld",
                ),
            )
        errors = [
            ErrorDetail(path=json_pointer(list(err.instance_path)), message=err.message)
            for _, err in zip(range(MAX_DETAILS), validator.iter_errors(event.output), strict=False)
        ]
        if errors:
            return failure(
                event.call_id,
                "invalid_tool_result",
                ToolError(
                    code=ErrorCode.OUTPUT_SCHEMA_VIOLATION,
                    message=f"{event.tool} returned output that breaks its output_schema; "
                    "the output was withheld",
                    retryable=False,
                    details=errors,
                ),
            )
        return success(event.call_id, event.output)
