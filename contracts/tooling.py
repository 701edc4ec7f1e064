"""The interface between the executor and a tool's function.

A tool function is `def f(arguments: dict, ctx: ToolContext) -> dict` (or an
`async def`). It receives only validated arguments and a context the runtime
built: the function never chooses where it writes, the runtime does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from .calls import Principal


@dataclass(frozen=True)
class ToolContext:
    call_id: str
    tool: str
    principal: Principal
    task_id: str | None
    # The tool's own storage root, chosen by the runtime: <data-dir>/tools/<tool>.
    data_dir: Path
    settings: Mapping[str, Any] = field(default_factory=dict)
    # The end user's verified access token (OIDC), for tools that act on the user's
    # behalf (RFC 8693 token exchange). None when no issuer is configured or the tool
    # acts for no user. Never printed: kept out of repr.
    subject_token: str | None = field(default=None, repr=False)

    @property
    def idempotency_key(self) -> str:
        """(tenant, agent, call_id): a call_id is only unique per agent, so a tool that
        dedupes side effects keys them by this, never by the call_id alone."""
        return f"{self.principal.tenant}.{self.principal.agent}.{self.call_id}"


class ToolRefused(Exception):
    """The tool will not do this (a host outside the allow-list, say): not retryable.

    `code` names the cause when it is more precise than TOOL_REFUSED (an upstream
    MCP tool whose definition changed: UPSTREAM_CHANGED)."""

    def __init__(self, message: str = "", *, code: str = "TOOL_REFUSED") -> None:
        super().__init__(message)
        self.code = code


F = TypeVar("F", bound=Callable[..., Any])
_INLINE = "__toolgate_inline__"


def runs_inline(function: F) -> F:
    """Mark a sync tool function that returns at once and never blocks (pure work on
    its arguments, microseconds): the executor calls it on its event loop instead of
    handing it to a thread, whose hand-off costs more than such a tool's whole work.
    Its timeout cannot be enforced there, so mark nothing that does I/O or may hang."""
    setattr(function, _INLINE, True)
    return function


def is_inline(function: Callable[..., Any]) -> bool:
    return getattr(function, _INLINE, False) is True


class ToolUnavailable(Exception):
    """A backend the tool needs did not answer: retryable (per the entry's
    `retryable_errors`). `code` names the cause when it is more precise than TOOL_RAISED
    (an HTTP upstream that answered 503: UPSTREAM_HTTP_ERROR; an upstream MCP server that
    exited mid-call: UPSTREAM_LOST)."""

    def __init__(self, message: str = "", *, code: str = "TOOL_RAISED") -> None:
        super().__init__(message)
        self.code = code
