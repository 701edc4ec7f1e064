"""A tool served by an upstream MCP server: the executor's function for an `mcp:` registry entry.

The executor keeps one session per upstream server (`UpstreamSession`), shared by every
registry entry that names the same server: Streamable HTTP (`url`) or stdio (`command`,
a process it starts). Opening the session lists the
upstream's tools, and so does a `notifications/tools/list_changed` (or its 2026-07-28
form, a `subscriptions/listen` event): each call checks its entry's pin against that
listing, without listing again. A definition that no longer hashes to the pin is refused
(UPSTREAM_CHANGED) naming what changed (`definition_changes`); a listing that names a
tool twice is refused (UPSTREAM_DUPLICATE_TOOL): with two definitions under one name, the
pin would check one and the upstream could serve the other.

Sessions are opened when the executor starts (`open_sessions`). A session that fails
is opened again; a stdio server that exits is started again, with backoff
(`FIRST_BACKOFF_S` doubling to `MAX_BACKOFF_S`, reset once a session stayed up
`STABLE_S`). Calls in flight when it goes end UPSTREAM_LOST, calls while it is down
UPSTREAM_UNAVAILABLE (both retryable per the entry's `retryable_errors`). A stdio server
gets exactly the environment its entry names (`stdio_environment`), nothing else of the
executor's.

The timeout is the executor's (`timeout_s` of the registry entry, around each call). What
comes back is untrusted: the attacher checks it against the registry's `output_schema`
like any tool's output and marks the result with its provenance.

Output: the upstream's `structuredContent` when it sends one, else `{"content": [...]}`
(its content blocks as JSON). `isError: true` is a failure of the tool:
execution_error / UPSTREAM_TOOL_ERROR, not retryable unless the entry says
`error_results_retryable: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from toolgate.contracts.calls import ErrorCode
from toolgate.contracts.registry import McpUpstream, PinnedDefinition, mcp_definition_sha256
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable

log = logging.getLogger(__name__)

# The most of an upstream's error text carried into error.message.
MAX_ERROR_TEXT = 2000
# At most this many tools/list pages are read looking for the tool.
MAX_LIST_PAGES = 50
# A refusal names at most this many changed schema paths.
MAX_CHANGES_SHOWN = 12
# Restarting a server that exited (stdio) or re-opening a failed session (HTTP).
FIRST_BACKOFF_S = 0.25
MAX_BACKOFF_S = 30.0
STABLE_S = 30.0
# Opening a session (start, handshake, first listing) takes at most this long.
OPEN_TIMEOUT_S = 60.0


# ---------------------------------------------------------------- what the entry says


def upstream_headers(
    upstream: McpUpstream, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The HTTP headers the registry entry asks for, from the executor's environment."""
    environ = os.environ if environ is None else environ
    headers = {}
    for header, variable in upstream.headers_from_env.items():
        value = environ.get(variable)
        if value is None:
            raise ToolRefused(
                f"header {header} for {upstream.server} comes from ${variable}, which is not set "
                "in the executor's environment"
            )
        headers[header] = value
    return headers


def stdio_environment(
    upstream: McpUpstream, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The whole environment of a stdio server: the entry's literal `env`, and the
    variables it names in `env_from_gateway` copied from the executor's environment."""
    environ = os.environ if environ is None else environ
    missing = [name for name in upstream.env_from_gateway if name not in environ]
    if missing:
        raise ToolRefused(
            f"{upstream.server} takes ${', $'.join(missing)} from the environment (the "
            "executor's, when it runs), where it is not set"
        )
    return {**{name: environ[name] for name in upstream.env_from_gateway}, **upstream.env}


def stdio_command(
    upstream: McpUpstream, environ: Mapping[str, str] | None = None
) -> tuple[str, list[str]]:
    """How the executor starts a stdio server: through `env -i`, so the process gets the
    entry's environment and nothing else (the SDK would add HOME, PATH, USER, ... of
    ours). `env` finds the command on the PATH the entry gives it, if any."""
    assert upstream.command is not None
    env_binary = shutil.which("env") or "/usr/bin/env"
    assignments = [
        f"{name}={value}" for name, value in stdio_environment(upstream, environ).items()
    ]
    return env_binary, ["-i", *assignments, upstream.command, *upstream.args]


def server_key(upstream: McpUpstream) -> tuple[Any, ...]:
    """Entries with the same key share one session (one process, for stdio)."""
    if upstream.url is not None:
        return ("http", upstream.url, tuple(sorted(upstream.headers_from_env.items())))
    return (
        "stdio",
        upstream.command,
        tuple(upstream.args),
        tuple(sorted(upstream.env.items())),
        tuple(sorted(upstream.env_from_gateway)),
        upstream.cwd,
    )


# ---------------------------------------------------------------- pins


def definition_of(tool: Any) -> PinnedDefinition:
    """An SDK `Tool` as the pin keeps it."""
    return PinnedDefinition(
        description=tool.description or "",
        input_schema=tool.input_schema,
        output_schema=tool.output_schema,
    )


def definition_hash(tool: Any) -> str:
    """The pinned hash of an SDK `Tool` as the upstream lists it."""
    return mcp_definition_sha256(tool.name, tool.description, tool.input_schema, tool.output_schema)


def _escape(step: str) -> str:
    return step.replace("~", "~0").replace("/", "~1")


def json_changes(old: Any, new: Any, path: str = "") -> list[str]:
    """The JSON pointers at which `new` differs from `old`: "/properties/tz/description
    changed", "/required added", ... ("" is the whole value)."""
    if isinstance(old, dict) and isinstance(new, dict):
        found: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            at = f"{path}/{_escape(str(key))}"
            if key not in new:
                found.append(f"{at} removed")
            elif key not in old:
                found.append(f"{at} added")
            else:
                found.extend(json_changes(old[key], new[key], at))
        return found
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [
            change
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for change in json_changes(a, b, f"{path}/{i}")
        ]
    if old == new and type(old) is type(new):
        return []
    return [f"{path or '(the whole schema)'} changed"]


def definition_changes(pinned: PinnedDefinition, served: PinnedDefinition) -> list[str]:
    """What differs between the reviewed definition and the served one, one line each:
    "description", "input_schema /properties/tz/description changed", ..."""
    changes: list[str] = []
    if pinned.description != served.description:
        changes.append("description")
    for field in ("input_schema", "output_schema"):
        old, new = getattr(pinned, field), getattr(served, field)
        if old is None and new is not None:
            changes.append(f"{field} added")
        elif old is not None and new is None:
            changes.append(f"{field} removed")
        else:
            changes.extend(f"{field} {change}" for change in json_changes(old, new))
    return changes


def describe_changes(changes: list[str]) -> str:
    shown = changes[:MAX_CHANGES_SHOWN]
    more = len(changes) - len(shown)
    return "; ".join(shown) + (f"; and {more} more" if more > 0 else "")


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
    definition is the one pinned; ToolRefused otherwise, saying what changed."""
    twice = duplicate_tool_names(tools)
    if twice:
        raise ToolRefused(
            f"{upstream.server} lists the tool {twice[0]!r} more than once"
            + (f" (and {', '.join(repr(n) for n in twice[1:])})" if twice[1:] else "")
            + "; refused until the upstream lists each tool once",
            code=ErrorCode.UPSTREAM_DUPLICATE_TOOL,
        )
    tool = next((t for t in tools if t.name == upstream.tool), None)
    if tool is None:
        raise ToolRefused(
            f"{upstream.server} no longer lists the tool {upstream.tool!r}; re-import "
            "and review it (toolgate tools import-mcp)",
            code=ErrorCode.UPSTREAM_CHANGED,
        )
    if definition_hash(tool) != upstream.definition_sha256:
        if upstream.definition is not None:
            what = describe_changes(definition_changes(upstream.definition, definition_of(tool)))
        else:
            what = "its name, description or schemas (this entry keeps no pinned definition)"
        raise ToolRefused(
            f"{upstream.server} now serves another definition of {upstream.tool!r} than the "
            f"one reviewed; changed: {what}. Refused until an operator reviews it "
            "(toolgate tools diff NAME, then toolgate tools accept NAME)",
            code=ErrorCode.UPSTREAM_CHANGED,
        )
    return tool


# ---------------------------------------------------------------- results


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


def error_result(result: Any, upstream: McpUpstream) -> Exception:
    """What an `isError` answer becomes: the tool's own failure on these arguments,
    not retryable unless the entry says `error_results_retryable: true`."""
    message = (
        f"upstream tool {upstream.tool!r} at {upstream.server} reported an error: "
        f"{error_text(result.content)}"
    )
    if upstream.error_results_retryable:
        return ToolUnavailable(message, code=ErrorCode.UPSTREAM_TOOL_ERROR)
    return ToolRefused(message, code=ErrorCode.UPSTREAM_TOOL_ERROR)


def leaf_of(exc: BaseException) -> BaseException:
    """The first real error inside the task groups' exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def reason_of(exc: BaseException) -> str:
    cause = leaf_of(exc)
    return f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__


# ---------------------------------------------------------------- the SDK


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


def upstream_auth(upstream: McpUpstream) -> Any:
    """The entry's `auth` (services/executor/http_auth.py) as an auth flow of the kept
    session's HTTP client: asked on every request, so a client-credentials token is
    renewed inside one long session (the token cache answers until it nearly expires)."""
    if upstream.auth is None:
        return None
    import httpx2

    from toolgate.services.executor.http_auth import Authenticator

    authenticator = Authenticator(upstream.auth)

    class SessionAuth(httpx2.Auth):
        async def async_auth_flow(self, request: Any) -> Any:
            request.headers.update(await authenticator.header(None))
            yield request

    return SessionAuth()


def open_client(url: str, headers: dict[str, str]) -> Any:
    """An SDK client (an async context manager) for one HTTP upstream, with these headers."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30.0, read=300.0))
    return Client(streamable_http_client(url, http_client=http), cache=None), http


def stdio_transport(upstream: McpUpstream, environ: Mapping[str, str] | None = None) -> Any:
    """The SDK's stdio transport for a stdio upstream, started as `stdio_command` says."""
    from mcp.client.stdio import StdioServerParameters, stdio_client

    command, args = stdio_command(upstream, environ)
    return stdio_client(StdioServerParameters(command=command, args=args, cwd=upstream.cwd))


@contextlib.asynccontextmanager
async def watched(transport: Any, lost: asyncio.Event) -> AsyncIterator[Any]:
    """The transport's streams, and `lost` set once its read side ends (a stdio server's
    stdout closed: it exited)."""
    import anyio

    async with transport as (read, write):
        send, receive = anyio.create_memory_object_stream[Any](0)

        async def forward() -> None:
            try:
                async with send:
                    async for item in read:
                        await send.send(item)
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
            finally:
                lost.set()

        async with anyio.create_task_group() as group:
            group.start_soon(forward)
            try:
                yield receive, write
            finally:
                group.cancel_scope.cancel()


def is_list_changed(message: Any) -> bool:
    import mcp_types as types

    return isinstance(message, types.ToolListChangedNotification)


def session_gone(exc: BaseException) -> bool:
    """Whether a failed request shows the session itself is gone (closed connection, an
    HTTP upstream that forgot the session): the request never ran on a live session."""
    from mcp.shared.exceptions import MCPError
    from mcp_types import CONNECTION_CLOSED, INVALID_REQUEST

    cause = leaf_of(exc)
    if isinstance(cause, MCPError):
        code = cause.error.code
        return code == CONNECTION_CLOSED or (
            code == INVALID_REQUEST and "Session terminated" in cause.error.message
        )
    return False


class UpstreamSession:
    """One kept session to one upstream server, shared by the entries that name it.

    A supervisor task opens it (and, for stdio, starts the process), lists the tools,
    listens for list changes, and opens it again with backoff once it ends. Calls take
    the open session and its current listing (`acquire`); while it is being opened (or
    listed again after a change) they wait; while it is down they fail at once with the
    reason (an HTTP one is tried once more first: a call costs it a connection attempt,
    where a stdio server is not restarted faster than its backoff)."""

    def __init__(self, upstream: McpUpstream, environ: Mapping[str, str] | None = None) -> None:
        self.upstream = upstream
        self.server = upstream.server
        self.environ = environ
        self.client: Any = None
        self.tools: list[Any] | None = None
        self.failure: str | None = None
        self.retry_at = 0.0
        self.opened = 0  # sessions opened so far (a restart is the second one)
        self._changed = asyncio.Event()
        self._lost = asyncio.Event()
        self._relist = asyncio.Event()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # -- what calls see

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def start(self) -> None:
        """Open the session in the background (and keep it open), if not done yet."""
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._supervise(), name=f"upstream {self.server}")

    async def acquire(self) -> tuple[Any, list[Any]]:
        """The open session and the listing it last read."""
        self.start()
        kicked = False
        while True:
            if self.client is not None and self.tools is not None and not self._relist.is_set():
                return self.client, self.tools
            waiting = self._changed
            if self.client is None and self.failure is not None:
                left = self.retry_at - time.monotonic()
                if left > 0 and self.upstream.url is not None and not kicked:
                    # HTTP: no process to spare, so a call tries the server now (once).
                    kicked = True
                    self._wake.set()
                elif left > 0:
                    raise ToolUnavailable(
                        f"the upstream MCP server {self.server} is down ({self.failure}); "
                        f"the next attempt in {left:.1f}s",
                        code=ErrorCode.UPSTREAM_UNAVAILABLE,
                    )
            await waiting.wait()

    def lost(self, client: Any) -> None:
        """A call found the session `client` broken: end it (the supervisor opens another)."""
        if client is self.client:
            self.client = None
            self._lost.set()

    # -- the supervisor

    async def _supervise(self) -> None:
        backoff = FIRST_BACKOFF_S
        while not self._closing:
            started = time.monotonic()
            try:
                reason = await self._run_session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                reason = reason_of(exc)
            self.client, self.tools = None, None
            if self._closing:
                break
            if time.monotonic() - started >= STABLE_S:
                backoff = FIRST_BACKOFF_S
            self.failure, self.retry_at = reason, time.monotonic() + backoff
            log.warning(
                "upstream MCP server %s: %s; opening it again in %.2fs",
                self.server,
                reason,
                backoff,
            )
            self._notify()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _transport(self) -> tuple[Any, Any]:
        """(the SDK transport, an HTTP client to close with it or None)."""
        if self.upstream.url is not None:
            import httpx2
            from mcp.client.streamable_http import streamable_http_client

            http = httpx2.AsyncClient(
                headers=upstream_headers(self.upstream, self.environ),
                timeout=httpx2.Timeout(30.0, read=300.0),
                auth=upstream_auth(self.upstream),
            )
            return streamable_http_client(self.upstream.url, http_client=http), http
        return stdio_transport(self.upstream, self.environ), None

    async def _on_message(self, message: Any) -> None:
        if is_list_changed(message):
            self._relist.set()

    async def _run_session(self) -> str:
        """One session, from opening to its end; returns why it ended."""
        from mcp import Client

        self._lost = asyncio.Event()
        self._relist = asyncio.Event()
        transport, http = self._transport()
        client = Client(
            watched(transport, self._lost), cache=None, message_handler=self._on_message
        )
        async with contextlib.AsyncExitStack() as stack:
            if http is not None:
                await stack.enter_async_context(http)
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                await stack.enter_async_context(client)
                tools = await list_upstream_tools(client)
            listening = asyncio.create_task(self._listen(client))
            stack.callback(listening.cancel)
            self.opened += 1
            self.client, self.tools, self.failure = client, tools, None
            self._notify()
            log.info("upstream MCP server %s: session open, %d tool(s)", self.server, len(tools))
            while True:
                lost = asyncio.create_task(self._lost.wait())
                relist = asyncio.create_task(self._relist.wait())
                try:
                    await asyncio.wait({lost, relist}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    lost.cancel()
                    relist.cancel()
                if self._lost.is_set() or self._closing:
                    break
                # The upstream says its tools changed: read them again before any call
                # uses the listing (calls wait while _relist is set).
                self.tools = await list_upstream_tools(client)
                self._relist.clear()
                self._notify()
                log.info("upstream MCP server %s: tools listed again (list_changed)", self.server)
            self.client = None
            self._notify()
        return "the server exited" if self.upstream.command else "the session ended"

    async def _listen(self, client: Any) -> None:
        """On a 2026-07-28 connection, list changes come as `subscriptions/listen` events
        (older ones send notifications/tools/list_changed to the message handler)."""
        from mcp.client.subscriptions import ListenNotSupportedError

        capability = client.server_capabilities.tools
        if capability is None or not capability.list_changed:
            return
        try:
            async with client.listen(tools_list_changed=True) as events:
                async for _ in events:
                    self._relist.set()
        except ListenNotSupportedError:
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the stream dropped: what we know may be stale
            log.warning("upstream MCP server %s: listen ended: %s", self.server, reason_of(exc))
        if not self._closing:
            self._lost.set()  # open a new session: listing again, with the pin checked

    async def close(self) -> None:
        self._closing = True
        self._lost.set()
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            self._task.cancel()


_sessions: dict[tuple[Any, ...], tuple[asyncio.AbstractEventLoop, UpstreamSession]] = {}


def session_for(upstream: McpUpstream) -> UpstreamSession:
    """The kept session of this entry's server (one per server and event loop)."""
    loop = asyncio.get_running_loop()
    key = server_key(upstream)
    found = _sessions.get(key)
    if found is None or found[0] is not loop:
        found = (loop, UpstreamSession(upstream))
        _sessions[key] = found
    return found[1]


def open_sessions(upstreams: list[McpUpstream]) -> None:
    """Start opening these entries' sessions now (the executor's start), so a first call
    does not wait for a server to start; a server that cannot be reached yet is tried
    again with backoff."""
    for upstream in upstreams:
        session_for(upstream).start()


async def close_sessions() -> None:
    """End every kept session of this event loop (stdio servers are stopped)."""
    loop = asyncio.get_running_loop()
    mine = [key for key, (owner, _) in _sessions.items() if owner is loop]
    for key in mine:
        _, session = _sessions.pop(key)
        await session.close()


def as_tool_error(exc: BaseException, upstream: McpUpstream) -> BaseException:
    """What the executor reports for a failed upstream call: our own refusals as they
    are, a session that broke under the call as UPSTREAM_LOST, an upstream that answered
    with a protocol error as ToolUnavailable (TOOL_RAISED); a cancellation (the timeout)
    as it is. All but refusals are retryable per the entry."""
    cause = leaf_of(exc)
    if isinstance(cause, ToolRefused | ToolUnavailable | asyncio.CancelledError):
        return cause
    if session_gone(cause):
        return ToolUnavailable(
            f"the upstream MCP server {upstream.server} "
            + ("exited" if upstream.command else "lost its session")
            + f" while {upstream.tool!r} ran; it may or may not have taken effect (the "
            "executor opens a new session)",
            code=ErrorCode.UPSTREAM_LOST,
        )
    from mcp.shared.exceptions import MCPError

    if isinstance(cause, MCPError):
        return ToolUnavailable(
            f"{upstream.server} answered {upstream.tool!r} with an error: {cause}"
        )
    return ToolUnavailable(
        f"cannot use the upstream MCP server {upstream.server}: {reason_of(cause)}"
    )


def upstream_tool(upstream: McpUpstream):
    """The executor's function for one `mcp:` registry entry (built before the executor's
    loop runs: the SDK's modules are imported here, not in the loop at the first session)."""
    import httpx2  # noqa: F401
    import mcp.client.stdio
    import mcp.client.streamable_http
    import mcp.client.subscriptions  # noqa: F401
    import mcp_types as types
    from mcp import Client  # noqa: F401

    async def send(client: Any, arguments: dict[str, Any]) -> Any:
        # Not client.call_tool: the SDK would check the output against the upstream's
        # own schema and raise; the attacher checks it against the registry's, and says
        # invalid_tool_result.
        return await client.session.send_request(
            types.CallToolRequest(
                params=types.CallToolRequestParams(name=upstream.tool, arguments=arguments)
            ),
            types.CallToolResult,
        )

    async def call_upstream(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        session = session_for(upstream)
        for attempt in (1, 2):
            client, tools = await session.acquire()
            pinned_tool(tools, upstream)
            try:
                result = await send(client, arguments)
                break
            except Exception as exc:
                gone = session_gone(exc)
                if gone:
                    session.lost(client)
                # An HTTP upstream that forgot the session (restarted) never saw this
                # request: once, on a new session (its listing checked again).
                if (
                    attempt == 1
                    and upstream.url is not None
                    and gone
                    and "Session terminated" in str(leaf_of(exc))
                ):
                    continue
                raise as_tool_error(exc, upstream) from None
        if result.is_error:
            raise error_result(result, upstream)
        return output_of(result)

    return call_upstream
