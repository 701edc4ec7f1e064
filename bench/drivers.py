"""What sends the bench's calls: each driver's `call(call_id)` returns when the result is in.

- `PlainClient`: a plain nats-py agent, as any platform would write one from
  the wire contract: publish the call on `toolgate.calls.<tenant>.<agent>`
  with a publish ack, and wait on one subscription to
  `toolgate.results.<tenant>.<agent>.*`, matching results by call_id.
- `GatewayDriver`: the same calls through `GatewayClient.call`, as an agent
  makes them: the client mints each call_id (so, like the plain client, it
  knows no earlier try can have stored a result and reads none), one
  results subscription per connection, one publish ack per call. The
  bench's call_id is not sent: a caller's own call_id is a possible retry,
  which costs one more read of the stored result (a direct get) per call.
- `FloorClient`: the plain client's loop against the raw floor
  (`toolgate.bench.floor`): publish to its first hop, wait on its out subject.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

import msgspec
import nats
from nats.aio.client import Client

from toolgate.bench import floor
from toolgate.client.gateway_client import GatewayClient
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.runtime.creds import connect_options

RESULT_TIMEOUT_S = 60.0
TOOL = "echo"
_OK = b'"ok":true'
_encoder = msgspec.json.Encoder()


class Driver(Protocol):
    name: str
    failures: int

    async def call(self, call_id: str) -> None: ...

    async def close(self) -> None: ...


def tool_call(call_id: str, principal: Principal) -> ToolCall:
    return ToolCall(call_id=call_id, tool=TOOL, arguments={}, principal=principal)


class _Waiting:
    """Futures by call_id, completed by one wildcard subscription's messages."""

    def __init__(self) -> None:
        self.futures: dict[str, asyncio.Future[bytes]] = {}

    def expect(self, call_id: str) -> asyncio.Future[bytes]:
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.futures[call_id] = future
        return future

    async def on_message(self, msg: Any) -> None:
        future = self.futures.pop(msg.subject.rsplit(".", 1)[-1], None)
        if future is not None and not future.done():
            future.set_result(msg.data)

    def forget(self, call_id: str) -> None:
        self.futures.pop(call_id, None)


class PlainClient:
    name = "client (nats-py)"

    def __init__(self, nc: Client, principal: Principal) -> None:
        self._nc, self._js = nc, nc.jetstream()
        self._principal = principal
        self._subject = subjects.calls_subject(principal.tenant, principal.agent)
        self._waiting = _Waiting()
        self.failures = 0

    @classmethod
    async def connect(cls, nats_url: str, creds: Path | None, principal: Principal) -> PlainClient:
        client = cls(await nats.connect(nats_url, **connect_options(creds)), principal)
        prefix = subjects.agent_results_prefix(principal.tenant, principal.agent)
        await client._nc.subscribe(f"{prefix}.*", cb=client._waiting.on_message)
        await client._nc.flush()
        return client

    async def call(self, call_id: str) -> None:
        future = self._waiting.expect(call_id)
        try:
            # As an agent publishes: to its own subject, with a publish ack, no Nats-Msg-Id.
            await self._js.publish(
                self._subject,
                _encoder.encode(tool_call(call_id, self._principal)),
                stream=subjects.CALLS_STREAM,
            )
            data = await asyncio.wait_for(future, RESULT_TIMEOUT_S)
        finally:
            self._waiting.forget(call_id)
        if _OK not in data:
            self.failures += 1

    async def close(self) -> None:
        await self._nc.close()


class GatewayDriver:
    name = "GatewayClient"

    def __init__(self, client: GatewayClient, principal: Principal) -> None:
        self._client, self._principal = client, principal
        self.failures = 0

    @classmethod
    async def connect(
        cls, nats_url: str, creds: Path | None, principal: Principal
    ) -> GatewayDriver:
        client = await GatewayClient.connect(
            nats_url, creds, identity=(principal.tenant, principal.agent)
        )
        return cls(client, principal)

    async def call(self, call_id: str) -> None:
        result = await self._client.call(
            TOOL, {}, principal=self._principal, timeout=RESULT_TIMEOUT_S
        )
        if not result.ok:
            self.failures += 1

    async def close(self) -> None:
        await self._client.close()


class FloorClient:
    name = "floor (raw, 4 hops)"

    def __init__(self, nc: Client, principal: Principal) -> None:
        self._nc, self._js = nc, nc.jetstream()
        self._principal = principal
        self._waiting = _Waiting()
        self.failures = 0

    @classmethod
    async def connect(cls, nats_url: str, creds: Path | None, principal: Principal) -> FloorClient:
        client = cls(await nats.connect(nats_url, **connect_options(creds)), principal)
        await client._nc.subscribe(floor.out_subject("*"), cb=client._waiting.on_message)
        await client._nc.flush()
        return client

    async def call(self, call_id: str) -> None:
        future = self._waiting.expect(call_id)
        try:
            # The same body an agent publishes, and like it no Nats-Msg-Id.
            await self._js.publish(
                floor.hop_subject(0),
                _encoder.encode(tool_call(call_id, self._principal)),
                stream=floor.STREAM,
                headers={floor.CALL_HEADER: call_id},
            )
            await asyncio.wait_for(future, RESULT_TIMEOUT_S)
        finally:
            self._waiting.forget(call_id)

    async def close(self) -> None:
        await self._nc.close()
