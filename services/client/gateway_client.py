"""GatewayClient: what an agent platform uses to publish calls and get results.

Only the public wire contract is used: publish to `toolgate.calls` with
`Nats-Msg-Id: <call_id>`, read `toolgate.results.<call_id>`. Results are kept
in a stream, so `result(call_id)` fetches one again after a reconnect, and a
second `call()` with the same call_id returns the recorded result.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import nats
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.services.stack.nats_auth import connect_options

_result_decoder = msgspec.json.Decoder(ToolResult)
_encoder = msgspec.json.Encoder()


class ResultTimeout(TimeoutError):
    """No result arrived in time. The call may still finish: fetch it later by call_id."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


class GatewayClient:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._js = nc.jetstream()

    @classmethod
    async def connect(cls, nats_url: str, creds: Path | str | None = None,
                      **options: Any) -> GatewayClient:
        """Connect; on a locked bus pass the agent's `creds` file (DATA_DIR/creds/agent.creds)."""
        options = {"max_reconnect_attempts": -1, **connect_options(creds), **options}
        return cls(await nats.connect(nats_url, **options))

    async def close(self) -> None:
        await self._nc.drain()

    async def __aenter__(self) -> GatewayClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def publish(self, call: ToolCall) -> None:
        """Publish a call (stored with a publish ack); JetStream drops a duplicate call_id."""
        await self._js.publish(subjects.CALLS, _encoder.encode(call),
                               stream=subjects.CALLS_STREAM,
                               headers={"Nats-Msg-Id": call.call_id})

    async def submit(self, call: ToolCall, timeout: float = 30.0) -> ToolResult:
        """Publish `call` and wait for its one ToolResult."""
        waiting: asyncio.Future[ToolResult] = asyncio.get_running_loop().create_future()

        async def on_result(msg: Any) -> None:
            if not waiting.done():
                waiting.set_result(_result_decoder.decode(msg.data))

        # Subscribe before publishing, so a fast result is not missed.
        sub = await self._nc.subscribe(subjects.results_subject(call.call_id), cb=on_result)
        try:
            await self.publish(call)
            # A call_id seen before already has its result stored (the publish
            # itself was dropped as a duplicate): take it from the stream.
            stored = await self.result(call.call_id)
            if stored is not None and not waiting.done():
                waiting.set_result(stored)
            try:
                return await asyncio.wait_for(asyncio.shield(waiting), timeout)
            except TimeoutError:
                raise ResultTimeout(
                    f"no result for {call.call_id} within {timeout}s; "
                    "fetch it later with result(call_id)") from None
        finally:
            await sub.unsubscribe()

    async def call(self, tool: str, arguments: dict[str, Any], *, principal: Principal,
                   task_id: str | None = None, context: dict[str, Any] | None = None,
                   call_id: str | None = None, timeout: float = 30.0) -> ToolResult:
        return await self.submit(ToolCall(
            call_id=call_id or new_call_id(), tool=tool, arguments=arguments,
            principal=principal, task_id=task_id, context=context or {}), timeout=timeout)

    async def call_many(self, calls: Sequence[ToolCall],
                        timeout: float = 30.0) -> list[ToolResult]:
        """Several tool calls of one model response, concurrently; results in call order."""
        return list(await asyncio.gather(*(self.submit(c, timeout) for c in calls)))

    async def result(self, call_id: str) -> ToolResult | None:
        """The stored result of `call_id`, or None if it has none (yet)."""
        try:
            msg = await self._js.get_last_msg(subjects.RESULTS_STREAM,
                                              subjects.results_subject(call_id))
        except NotFoundError:
            return None
        return _result_decoder.decode(msg.data or b"")
