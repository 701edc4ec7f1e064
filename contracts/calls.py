"""The public wire contract: what an agent platform publishes and receives.

Agents depend on these shapes. Change them only by adding optional fields;
never rename or retype one. Unknown fields are ignored on decode, so a
platform that sends a newer field to an older gateway is not refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final, Literal

import msgspec

CALL_ID_PATTERN: Final = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# The largest call the gateway stores: the calls stream refuses a larger one
# before storing it (the client turns that into PAYLOAD_TOO_LARGE).
MAX_CALL_BYTES: Final = 1024 * 1024

Status = Literal[
    "ok",
    "invalid_arguments",
    "unknown_tool",
    "denied",
    "approval_denied",
    "approval_expired",
    "execution_error",
    "timeout",
    "invalid_tool_result",
]


class ErrorCode:
    """The `error.code` vocabulary. A code names the cause; `status` names the class."""

    MALFORMED_CALL: Final = "MALFORMED_CALL"
    NESTING_TOO_DEEP: Final = "NESTING_TOO_DEEP"
    PRINCIPAL_MISMATCH: Final = "PRINCIPAL_MISMATCH"
    PAYLOAD_TOO_LARGE: Final = "PAYLOAD_TOO_LARGE"
    SCHEMA_VALIDATION_FAILED: Final = "SCHEMA_VALIDATION_FAILED"
    TOOL_NOT_FOUND: Final = "TOOL_NOT_FOUND"
    TOOL_NOT_ALLOWED: Final = "TOOL_NOT_ALLOWED"
    POLICY_DENIED: Final = "POLICY_DENIED"
    POLICY_ERROR: Final = "POLICY_ERROR"
    TASK_SCOPE_VIOLATION: Final = "TASK_SCOPE_VIOLATION"
    APPROVAL_REQUIRED: Final = "APPROVAL_REQUIRED"
    APPROVAL_DENIED: Final = "APPROVAL_DENIED"
    APPROVAL_EXPIRED: Final = "APPROVAL_EXPIRED"
    TOOL_TIMEOUT: Final = "TOOL_TIMEOUT"
    TOOL_RAISED: Final = "TOOL_RAISED"
    TOOL_REFUSED: Final = "TOOL_REFUSED"
    OUTCOME_UNKNOWN: Final = "OUTCOME_UNKNOWN"
    CALL_ID_REUSED: Final = "CALL_ID_REUSED"
    RATE_LIMITED: Final = "RATE_LIMITED"
    QUOTA_EXCEEDED: Final = "QUOTA_EXCEEDED"
    OUTPUT_SCHEMA_VIOLATION: Final = "OUTPUT_SCHEMA_VIOLATION"
    # An upstream MCP tool now serves another definition than the one an operator
    # imported and reviewed (its hash is pinned in the registry): refused until re-imported.
    UPSTREAM_CHANGED: Final = "UPSTREAM_CHANGED"
    # An upstream MCP server's tools/list names a tool twice: which entry is "the" tool
    # is then the upstream's choice (a changed definition beside the pinned one), so the
    # listing is refused whatever the order, until the upstream lists each name once.
    UPSTREAM_DUPLICATE_TOOL: Final = "UPSTREAM_DUPLICATE_TOOL"
    # An upstream MCP tool answered `isError: true`: its own failure on these arguments,
    # not retryable unless the entry says so (mcp.error_results_retryable).
    UPSTREAM_TOOL_ERROR: Final = "UPSTREAM_TOOL_ERROR"
    # The upstream MCP server exited (stdio) or its session broke while the call was in
    # flight: it may or may not have run; the executor opens a new session (retryable).
    UPSTREAM_LOST: Final = "UPSTREAM_LOST"
    # The upstream MCP server cannot be started or reached now (the executor retries
    # with backoff; retryable).
    UPSTREAM_UNAVAILABLE: Final = "UPSTREAM_UNAVAILABLE"
    # A stage of the gateway gave up on the call (its attempts ran out on an error no
    # retry mended). `retryable` says whether the tool surely did not run.
    GATEWAY_GAVE_UP: Final = "GATEWAY_GAVE_UP"
    # The tool's output is larger than a result may be (MAX_OUTPUT_BYTES).
    OUTPUT_TOO_LARGE: Final = "OUTPUT_TOO_LARGE"
    # End users verified by OIDC (`toolgate up --oidc-issuer URL`): the call carries the
    # user's access token in the NATS header `Authorization: Bearer <JWT>`.
    # No token (or no Bearer header) on a call to a tool that acts for a user.
    USER_TOKEN_REQUIRED: Final = "USER_TOKEN_REQUIRED"
    # Not a token of the issuer: bad signature, unknown key, wrong issuer, an algorithm
    # off the allow-list (none, HS*), missing claims, not a JWT.
    USER_TOKEN_INVALID: Final = "USER_TOKEN_INVALID"
    # Past its `exp` (beyond the allowed clock skew): at validation, or when the tool is
    # about to run (after an approval that took longer than the token lives).
    USER_TOKEN_EXPIRED: Final = "USER_TOKEN_EXPIRED"
    # Issued for another audience than the gateway's (`--oidc-audience`).
    USER_TOKEN_WRONG_AUDIENCE: Final = "USER_TOKEN_WRONG_AUDIENCE"
    # Its tenant claim (`--oidc-tenant-claim`) is not the calling agent's tenant.
    USER_TOKEN_WRONG_TENANT: Final = "USER_TOKEN_WRONG_TENANT"
    # The payload's `principal.user` names someone else than the token's `sub`.
    USER_MISMATCH: Final = "USER_MISMATCH"
    # The identity provider (discovery, JWKS) could not be reached: fails closed;
    # retryable under a new call_id.
    USER_TOKEN_UNVERIFIABLE: Final = "USER_TOKEN_UNVERIFIABLE"
    # An HTTP tool's upstream answered with a status other than 2xx (retryable for 5xx,
    # 429 and 408), or with what the tool cannot take (not JSON, too large, a redirect to
    # another host).
    UPSTREAM_HTTP_ERROR: Final = "UPSTREAM_HTTP_ERROR"
    UPSTREAM_BAD_RESPONSE: Final = "UPSTREAM_BAD_RESPONSE"
    # The credential for an upstream could not be had: its secret is unreadable, or the
    # token endpoint refused (not retryable) or failed (retryable).
    UPSTREAM_AUTH_FAILED: Final = "UPSTREAM_AUTH_FAILED"


class Principal(msgspec.Struct, frozen=True):
    """Who asks: the user, through which agent, in which session, of which tenant."""

    tenant: str
    user: str
    agent: str
    session: str


class ToolCall(msgspec.Struct, frozen=True):
    """A model's request for permission to run `tool` with `arguments`.

    Published as JSON to `toolgate.calls.<tenant>.<agent>` by that agent's own
    NATS identity. `principal.tenant` and `principal.agent` must name the same
    tenant and agent as the subject (else `denied` / PRINCIPAL_MISMATCH);
    `user` and `session` are the platform's word about its own end users.
    """

    call_id: str
    tool: str
    arguments: dict[str, Any]
    principal: Principal
    task_id: str | None = None
    context: dict[str, Any] = {}


class ErrorDetail(msgspec.Struct, frozen=True):
    """One precise problem, located by a JSON Pointer into the arguments or output."""

    path: str
    message: str


# At most this many ErrorDetails in one error.
MAX_DETAILS: Final = 50


def json_pointer(path: list[str | int]) -> str:
    """RFC 6901: the pointer of `path` (keys and indexes) into a JSON document."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


class ToolError(msgspec.Struct, frozen=True):
    code: str
    message: str
    retryable: bool = False
    details: list[ErrorDetail] = []


class Provenance(msgspec.Struct, frozen=True):
    """Where a result's content came from when it is not toolgate's own code: an upstream
    MCP server's tool, or an HTTP API (an `http:` entry). Such content is untrusted: a
    platform treats it as data, never as instructions to its model."""

    source: Literal["mcp", "http"]
    server: str  # the upstream's URL as the registry names it (http: its origin)
    tool: str  # the upstream tool's own name (http: "METHOD /path/{template}")
    trust: Literal["untrusted"] = "untrusted"


class ToolResult(msgspec.Struct, frozen=True):
    """The one final observation of a call, stored once on
    `toolgate.results.<tenant>.<agent>.<call_id>`."""

    call_id: str
    ok: bool
    status: Status
    data: Any = None
    error: ToolError | None = None
    # Only on results of an upstream (MCP or HTTP) tool; absent from the JSON otherwise.
    provenance: Provenance | msgspec.UnsetType = msgspec.UNSET


class PendingNotice(msgspec.Struct, frozen=True):
    """Published to `toolgate.results.<tenant>.<agent>.<call_id>.pending` while a human decides."""

    call_id: str
    status: Literal["approval_pending"] = "approval_pending"
    message: str = ""
    expires_at: str | None = None
    # SHA-256 of the canonical arguments the approvers see and vote on (as validated).
    arguments_sha256: str | None = None


def is_valid_call_id(call_id: object) -> bool:
    """A call_id must be a subject-safe token: it names its result subject."""
    return isinstance(call_id, str) and CALL_ID_PATTERN.fullmatch(call_id) is not None


def failure(call_id: str, status: Status, error: ToolError) -> ToolResult:
    return ToolResult(call_id=call_id, ok=False, status=status, data=None, error=error)


def success(call_id: str, data: Any) -> ToolResult:
    return ToolResult(call_id=call_id, ok=True, status="ok", data=data, error=None)


# Which call an answer (a ToolResult, or a `.pending` notice) answers: its tool and the
# SHA-256 of its canonical arguments (contracts/authorization.py `arguments_sha256`), in
# the NATS headers of the message, stored and live (added to contract v2; the bodies are
# unchanged). A call_id names one call of its agent: a later call with the same call_id
# and another tool or other arguments is not that call's retry, and must not be given
# that call's answer (GatewayClient checks; the attacher refuses it, see below).
ANSWERS_TOOL_HEADER: Final = "Toolgate-Tool"
ANSWERS_ARGUMENTS_HEADER: Final = "Toolgate-Arguments-Sha256"
# On the refusal of such a call (a ToolResult `CALL_ID_REUSED`, published to the call_id's
# result subject and never stored: the subject keeps the first call's result). Its other
# two headers name the refused call, so a client waiting for the first call can tell the
# refusal is not its answer.
REFUSED_HEADER: Final = "Toolgate-Refused"


def answer_headers(tool: str, arguments_sha256: str | None) -> dict[str, str]:
    """The headers naming the call an answer answers (none if its arguments are unknown)."""
    if not arguments_sha256:
        return {}
    return {ANSWERS_TOOL_HEADER: tool, ANSWERS_ARGUMENTS_HEADER: arguments_sha256}


def answered_call(headers: Mapping[str, str] | None) -> tuple[str, str] | None:
    """(tool, arguments_sha256) of the call an answer answers; None if it does not say
    (an answer stored before these headers, or one of a call whose arguments were unreadable)."""
    if not headers:
        return None
    sha = headers.get(ANSWERS_ARGUMENTS_HEADER)
    if not sha:
        return None
    return headers.get(ANSWERS_TOOL_HEADER, ""), sha


def call_id_reused(call_id: str, tool: str) -> ToolResult:
    """The answer to a call whose call_id already names another call of its agent."""
    return failure(
        call_id,
        "invalid_arguments",
        ToolError(
            code=ErrorCode.CALL_ID_REUSED,
            message=(
                f"call_id {call_id!r} already names another call of this agent (another "
                f"tool or other arguments than this {tool!r} call): nothing ran for this "
                "one; give each call its own call_id, and reuse one only to retry the "
                "very same call"
            ),
            retryable=False,
        ),
    )
