"""A tool served by an upstream MCP server: the executor's function for an `mcp:` registry entry.

Each call opens a Streamable HTTP session with the official `mcp` SDK client,
lists the upstream's tools, and refuses the call (UPSTREAM_CHANGED) unless
the tool's definition (name, description, schemas) still hashes to what the
operator imported and reviewed; only then does it call the tool. A listing that
names a tool twice is refused (UPSTREAM_DUPLICATE_TOOL): with two definitions
under one name, the pin would check one and the upstream could serve the other. The timeout
is the executor's (`timeout_s` of the registry entry, around this whole
function). What comes back is untrusted: the attacher checks it against the
registry's `output_schema` like any tool's output and marks the result with
its provenance.

Output: the upstream's `structuredContent` when it sends one, else
`{"content": [...]}` (its content blocks as JSON). `isError: true` is a
failure of the tool (execution_error / TOOL_RAISED, retryable per the entry).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from toolgate.contracts.calls import ErrorCode
from toolgate.contracts.registry import McpUpstream, mcp_definition_sha256
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

# The most of an upstream's error text carried into error.message.
MAX_ERROR_TEXT = 2000
# At most this many tools/list pages are read looking for the tool.
MAX_LIST_PAGES = 50


def upstream_headers(
    upstream: McpUpstream, environ: dict[str, str] | None = None
) -> dict[str, str]:
    """The HTTP headers the registry entry asks for, from the executor's environment."""
    environ = dict(os.environ) if environ is None else environ
    headers = {}
    for header, variable in upstream.headers_from_env.items():
        value = environ.get(variable)
        if value is None:
            raise ToolRefused(
                f"header {header} for {upstream.url} comes from ${variable}, which is not set in "
                "the executor's environment"
            )
        headers[header] = value
    return headers


def definition_hash(tool: Any) -> str:
    """The pinned hash of an SDK `Tool` as the upstream lists it."""
    return mcp_definition_sha256(tool.name, tool.description, tool.input_schema, tool.output_schema)


def duplicate_tool_names(tools: list[Any]) -> list[str]:
    """The names a tools/list gives to more than one tool, in the order first seen."""
    seen: set[str] = set()
    twice: list[str] = []
    for tool in tools:
        if tool.name in seen and tool.name not in twice:
            twice.append(tool.name)
        seen.add(tool.name)
    return twice


def pinned_tool(tools: list[Any], upstream: McpUpstream) -> Any:
    """The upstream's tool for this registry entry, if its listing is unambiguous and its
    definition is the one pinned; ToolRefused otherwise."""
    twice = duplicate_tool_names(tools)
    if twice:
        raise ToolRefused(
            f"{upstream.url} lists the tool {twice[0]!r} more than once"
            + (f" (and {', '.join(repr(n) for n in twice[1:])})" if twice[1:] else "")
            + "; refused until the upstream lists each tool once",
            code=ErrorCode.UPSTREAM_DUPLICATE_TOOL,
        )
    tool = next((t for t in tools if t.name == upstream.tool), None)
    if tool is None:
        raise ToolRefused(
            f"{upstream.url} no longer lists the tool {upstream.tool!r}; re-import "
            "and review it (toolgate tools import-mcp)",
            code=ErrorCode.UPSTREAM_CHANGED,
        )
    if definition_hash(tool) != upstream.definition_sha256:
        raise ToolRefused(
            f"{upstream.url} now serves another definition of {upstream.tool!r} (its "
            "name, description or schemas changed since it was imported); refused "
            "until an operator re-imports and reviews it (toolgate tools import-mcp)",
            code=ErrorCode.UPSTREAM_CHANGED,
        )
    return tool


def content_as_json(blocks: list[Any]) -> list[dict[str, Any]]:
    return [block.model_dump(mode="json", by_alias=True, exclude_none=True) for block in blocks]


def error_text(blocks: list[Any]) -> str:
    text = " ".join(str(getattr(block, "text", "")) for block in blocks).strip()
    if len(text) > MAX_ERROR_TEXT:
        text = text[:MAX_ERROR_TEXT] + "..."
    return text or "(no text)"


def output_of(result: Any) -> Any:
    """What the tool returned, as the attacher will check it."""
    if result.structured_content is not None:
        return result.structured_content
    return {"content": content_as_json(result.content)}


async def list_upstream_tools(client: Any) -> list[Any]:
    """Every tool the upstream lists (all pages)."""
    tools: list[Any] = []
    cursor: str | None = None
    for _ in range(MAX_LIST_PAGES):
        page = await client.list_tools(cursor=cursor, cache_mode="refresh")
        tools.extend(page.tools)
        cursor = page.next_cursor
        if cursor is None:
            break
    return tools


def open_client(url: str, headers: dict[str, str]) -> Any:
    """An SDK client (an async context manager) for one upstream, with these headers."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))
    return Client(streamable_http_client(url, http_client=http), cache=None), http


def leaf_of(exc: BaseException) -> BaseException:
    """The first real error inside the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def as_tool_error(exc: BaseException, upstream: McpUpstream) -> BaseException:
    """What the executor reports for a failed upstream call: our own refusals as they
    are, an unreachable or failing upstream as ToolUnavailable (TOOL_RAISED, retryable
    per the entry); a cancellation (the timeout) as it is."""
    cause = leaf_of(exc)
    if isinstance(cause, ToolRefused | ToolUnavailable | asyncio.CancelledError):
        return cause
    from mcp.shared.exceptions import MCPError

    if isinstance(cause, MCPError):
        return ToolUnavailable(f"{upstream.url} answered {upstream.tool!r} with an error: {cause}")
    return ToolUnavailable(
        f"cannot use the upstream MCP server {upstream.url}: {type(cause).__name__}: {cause}"
    )


def upstream_tool(upstream: McpUpstream):
    """The executor's function for one `mcp:` registry entry."""
    import mcp_types as types

    async def call_upstream(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        headers = upstream_headers(upstream)
        client, http = open_client(upstream.url, headers)
        try:
            async with http, client:
                pinned_tool(await list_upstream_tools(client), upstream)
                # Not client.call_tool: the SDK would check the output against the
                # upstream's own schema and raise; the attacher checks it against the
                # registry's, and says invalid_tool_result.
                result = await client.session.send_request(
                    types.CallToolRequest(
                        params=types.CallToolRequestParams(name=upstream.tool, arguments=arguments)
                    ),
                    types.CallToolResult,
                )
        except Exception as exc:
            raise as_tool_error(exc, upstream) from None
        if result.is_error:
            raise ToolUnavailable(
                f"upstream tool {upstream.tool!r} at {upstream.url} reported an error: "
                f"{error_text(result.content)}"
            )
        return output_of(result)

    return call_upstream
