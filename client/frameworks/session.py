"""GatewaySession: one agent's connection to the gateway, as the framework integrations use it.

It holds a `GatewayClient` (the agent's identity is its creds file), the
agent's tool listing (by default asked of the gateway over NATS, so an agent on
another machine sees the registry the gateway serves, pushed or not; local files
only when told: `local_registry=True`), and the end user and session the calls
are made for. Frameworks call tools from sync and async code, on
event loops of their own; a NATS connection lives on one loop. So a session
knows its loop and runs every gateway step there: awaited directly from that
loop, handed over from another loop or from a plain thread
(`connect_in_background` gives a session a loop thread of its own, for
frameworks driven synchronously).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

from toolgate.client.gateway_client import GatewayClient, ResultTimeout
from toolgate.contracts.calls import (
    ErrorCode,
    PendingNotice,
    ToolCall,
    ToolError,
    ToolResult,
    failure,
)
from toolgate.contracts.registry import Registry, ToolSpec, load_registry, tool_dirs
from toolgate.contracts.registry_bundle import registry_of_listing
from toolgate.runtime import settings as env

from .core import (
    ApprovalRequest,
    Observation,
    approval_request,
    derive_call_id,
    not_run,
    observe,
)

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 30.0


class SessionError(RuntimeError):
    """The session cannot do what was asked (no identity, no loop to run on, ...)."""


def recorded_registry(data_dir: Path | None = None) -> Registry:
    """The registry `toolgate up` recorded in DATA_DIR/context.json (the built-in tools,
    unless it ran with --no-builtin-tools, and its --registry directories), else the
    built-in tools and $TOOLGATE_REGISTRY's."""
    context = env.read_context(data_dir)
    dirs = [Path(p) for p in context.get("registry_dirs") or [] if p]
    builtin_tools = context.get("builtin_tools") is not False
    dirs = dirs or env.env_registry_dirs()
    return load_registry(*tool_dirs(dirs, builtin_tools))


class GatewaySession:
    """One agent (its creds), one end user and session, one registry listing."""

    def __init__(
        self,
        client: GatewayClient,
        registry: Registry,
        *,
        user: str,
        session: str,
        task_id: str | None = None,
        context: dict[str, Any] | None = None,
        namespace: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if client.identity is None:
            raise SessionError("connect with an agent's creds file: a session must know its agent")
        self.client = client
        self.registry = registry
        self.user = user
        self.session = session
        self.task_id = task_id
        self.context = dict(context or {})
        # What call_ids are derived within when the framework names no conversation
        # (LangGraph's thread_id does): a fresh one per session unless given.
        self.namespace = namespace or f"session-{uuid.uuid4().hex}"
        self.timeout = timeout
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                raise SessionError(
                    "make a session on the event loop its client was connected on, or pass "
                    "loop= (GatewaySession.connect does this for you)"
                ) from None
        self.loop = loop  # the client's loop: every gateway step runs there
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ making one

    @classmethod
    async def connect(
        cls,
        nats_url: str | None = None,
        creds: Path | str | None = None,
        *,
        user: str,
        session: str,
        registry: Registry | None = None,
        local_registry: bool = False,
        **options: Any,
    ) -> GatewaySession:
        """Connect on the running loop. `nats_url`/`creds` default to what `toolgate up`
        recorded in this folder ($TOOLGATE_NATS_URL / $TOOLGATE_NATS_CREDS say otherwise).

        The tools shown are the agent's own listing as the gateway serves it now (asked
        over NATS: `GatewayClient.tool_listing`), unless `registry` is given, or
        `local_registry` is true (then the registry `toolgate up` recorded here is read
        from local files, `recorded_registry`)."""
        url = nats_url or env.env_nats_url()
        creds = creds or env.env_nats_creds("agent")
        if creds is None:
            raise SessionError("no agent creds: give creds= (toolgate agents add TENANT AGENT)")
        client = await GatewayClient.connect(url, creds)
        try:
            if registry is None:
                registry = (
                    recorded_registry()
                    if local_registry
                    else registry_of_listing(await client.tool_listing())
                )
            return cls(
                client,
                registry,
                user=user,
                session=session,
                loop=asyncio.get_running_loop(),
                **options,
            )
        except BaseException:
            await client.close()
            raise

    @classmethod
    def connect_in_background(
        cls,
        nats_url: str | None = None,
        creds: Path | str | None = None,
        *,
        user: str,
        session: str,
        registry: Registry | None = None,
        local_registry: bool = False,
        **options: Any,
    ) -> GatewaySession:
        """Connect on a loop thread of the session's own: for frameworks driven synchronously
        (`agent.invoke`, `graph.invoke`). `close()` stops the thread. The tools: as
        `connect` says."""
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="toolgate-session", daemon=True)
        thread.start()
        try:
            made = asyncio.run_coroutine_threadsafe(
                cls.connect(
                    nats_url,
                    creds,
                    user=user,
                    session=session,
                    registry=registry,
                    local_registry=local_registry,
                    **options,
                ),
                loop,
            ).result()
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()
            raise
        made._thread = thread
        return made

    def for_user(self, user: str, session: str, **options: Any) -> GatewaySession:
        """The same agent and connection, acting for another end user and session (a
        platform serves many users through one agent). Close only the first session."""
        return GatewaySession(
            self.client,
            self.registry,
            user=user,
            session=session,
            loop=self.loop,
            **{"timeout": self.timeout, **options},
        )

    def close(self) -> None:
        """Close from outside the session's loop (a background session, or after asyncio.run)."""
        if self.loop.is_running():
            self.run_sync(self.client.close())
        elif not self.loop.is_closed():
            self.loop.run_until_complete(self.client.close())
        if self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join()
            self.loop.close()
            self._thread = None

    async def refresh_tools(self) -> list[ToolSpec]:
        """Ask the gateway for this agent's listing again (a registry pushed since); the
        session shows those tools from now on."""
        self.registry = registry_of_listing(await self.run(self.client.tool_listing()))
        return self.tools()

    async def aclose(self) -> None:
        await self.run(self.client.close())

    async def __aenter__(self) -> GatewaySession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> GatewaySession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ who and what

    @property
    def tenant(self) -> str:
        assert self.client.identity is not None
        return self.client.identity[0]

    @property
    def agent(self) -> str:
        assert self.client.identity is not None
        return self.client.identity[1]

    def tools(self) -> list[ToolSpec]:
        """The tools this agent may call (the registry's `allowed_agents`); policy still decides."""
        return self.registry.visible_to(self.agent)

    def call_id_for(
        self,
        tool_call_id: str | None,
        tool: str,
        arguments: dict[str, Any],
        namespace: str | None = None,
    ) -> str:
        """The call_id of a model's tool call (see core.derive_call_id); a fresh one when the
        framework gave the call no id."""
        return derive_call_id(
            namespace or self.namespace,
            tool_call_id or uuid.uuid4().hex,
            tool,
            arguments,
            self.user,
        )

    def tool_call(self, call_id: str, tool: str, arguments: dict[str, Any]) -> ToolCall:
        return ToolCall(
            call_id=call_id,
            tool=tool,
            arguments=arguments,
            principal=self.client.principal(self.user, self.session),
            task_id=self.task_id,
            context=self.context,
        )

    # ------------------------------------------------------------------ running on the loop

    async def run(self, step: Coroutine[Any, Any, T]) -> T:
        """Await `step` on the session's loop, from whichever loop this is."""
        if asyncio.get_running_loop() is self.loop:
            return await step
        if not self.loop.is_running():
            step.close()
            raise SessionError(
                "the session's event loop is not running: connect it on this loop "
                "(GatewaySession.connect) or use GatewaySession.connect_in_background"
            )
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(step, self.loop))

    def run_sync(self, step: Coroutine[Any, Any, T]) -> T:
        """Run `step` on the session's loop from synchronous code in another thread."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop or not self.loop.is_running():
            step.close()
            raise SessionError(
                "a synchronous tool call cannot wait on the session's own event loop: use "
                "the async API (ainvoke), or GatewaySession.connect_in_background"
            )
        future: Future[T] = asyncio.run_coroutine_threadsafe(step, self.loop)
        return future.result()

    # ------------------------------------------------------------------ gateway steps

    async def decide(
        self, call_id: str, tool: str, arguments: dict[str, Any]
    ) -> ToolResult | PendingNotice:
        """Publish the call (again: the gateway answers a repeat from its record) and wait
        for its result, or for word that it waits for a human, whichever comes first."""
        return await self.run(self._decide(self.tool_call(call_id, tool, arguments)))

    async def final(
        self, call_id: str, tool: str, arguments: dict[str, Any], wait: float
    ) -> ToolResult | None:
        """The call's final result, waiting up to `wait` seconds; None if it still waits."""
        call = self.tool_call(call_id, tool, arguments)
        try:
            return await self.run(self.client.submit(call, timeout=wait))
        except ResultTimeout:
            return None

    async def _decide(self, call: ToolCall) -> ToolResult | PendingNotice:
        told: asyncio.Future[PendingNotice] = asyncio.get_running_loop().create_future()

        def on_pending(notice: PendingNotice) -> None:
            if not told.done():
                told.set_result(notice)

        submitted = asyncio.ensure_future(
            self.client.submit(call, timeout=self.timeout, on_pending=on_pending)
        )
        either: set[asyncio.Future[Any]] = {submitted, told}
        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        if submitted.done():  # a result wins over a notice that came with it
            told.cancel()
            return submitted.result()  # ResultTimeout if neither came in time
        submitted.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await submitted
        return told.result()

    async def observe(
        self,
        tool: str,
        arguments: dict[str, Any],
        tool_call_id: str | None,
        namespace: str | None = None,
    ) -> tuple[Observation, ToolResult | ApprovalRequest]:
        """One model tool call through the gateway, as the model should see it: a call
        that waits for a human is an error here (`not_run`), as this does not pause."""
        call_id = self.call_id_for(tool_call_id, tool, arguments, namespace)
        try:
            outcome = await self.decide(call_id, tool, arguments)
        except ResultTimeout:
            outcome = timed_out(call_id, self.timeout)
        if isinstance(outcome, PendingNotice):
            request = approval_request(outcome, tool, arguments)
            return not_run(request), request
        return observe(outcome, tool), outcome


def timed_out(call_id: str, timeout: float) -> ToolResult:
    """No result in time: a retryable timeout the model can read (the call may still end)."""
    return failure(
        call_id,
        "timeout",
        ToolError(
            code=ErrorCode.TOOL_TIMEOUT,
            message=f"the gateway gave no result within {timeout:g}s; the call may still "
            f"finish: its result stays available under call_id {call_id}",
            retryable=True,
        ),
    )
