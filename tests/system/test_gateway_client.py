"""GatewayClient against a real gateway: one results subscription per client, futures by
call_id, a retry's stored result read back, pending notices told once before the result."""

from __future__ import annotations

import asyncio
from urllib.parse import urlsplit

import pytest

from tests.harness import Gateway, events_of
from tests.system.test_approval_flow import (
    action,
    approvals_as,
    approver,
    key,
    stored_on,
    waiting,
)
from toolgate.client.gateway_client import GatewayClient, new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import PendingNotice, Principal, ToolCall
from toolgate.contracts.events import ExecutionStarted

pytestmark = pytest.mark.system

ANN = Principal(tenant="acme", user="u-ann", agent="researcher", session="s-9")
BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-1")


def echo(payload: object, call_id: str | None = None) -> ToolCall:
    return ToolCall(
        call_id=call_id or new_call_id(),
        tool="echo",
        arguments={"payload": payload},
        principal=ANN,
    )


async def test_many_concurrent_calls_on_one_client_each_get_their_own_result(
    shared_gateway: Gateway,
) -> None:
    async with await shared_gateway.client() as client:
        minted = [client.call("echo", {"payload": i}, principal=ANN) for i in range(100)]
        given = [echo(1000 + i) for i in range(100)]
        results = await asyncio.gather(*minted, client.call_many(given))
    by_minted, by_given = results[:100], results[100]
    assert all(r.ok for r in by_minted) and all(r.ok for r in by_given)
    assert [r.data["payload"] for r in by_minted] == list(range(100))  # type: ignore[index]
    assert [r.call_id for r in by_given] == [c.call_id for c in given]
    assert [r.data["payload"] for r in by_given] == [1000 + i for i in range(100)]  # type: ignore[index]
    assert len({r.call_id for r in by_minted}) == 100


async def test_a_result_stored_before_the_call_is_the_answer_to_a_retry(
    shared_gateway: Gateway,
) -> None:
    call = echo("first")
    async with await shared_gateway.client() as client:
        first = await client.submit(call)
    assert first.ok
    # A new connection, whose subscription did not exist when the result was published:
    # the retry (same call_id) is answered from the store, the tool does not run again.
    async with await shared_gateway.client() as client:
        again = await client.submit(call, timeout=30)
        by_call = await client.call(
            "echo", {"payload": "first"}, principal=ANN, call_id=call.call_id, timeout=30
        )
        twice = await asyncio.gather(client.submit(call), client.submit(call))
    assert again == first == by_call == twice[0] == twice[1]
    started = [e for e in events_of(await shared_gateway.events(), call.call_id)]
    assert sum(isinstance(e, ExecutionStarted) for e in started) == 1


async def test_two_submits_of_one_call_id_on_one_client_both_get_the_result(
    shared_gateway: Gateway,
) -> None:
    call = echo("shared")
    async with await shared_gateway.client() as client:
        results = await asyncio.gather(client.submit(call), client.submit(call))
    assert results[0] == results[1] and results[0].ok
    assert results[0].data == {"payload": "shared"}


async def test_a_pending_notice_then_the_result(shared_gateway: Gateway) -> None:
    """The notice is told once, before the result; a retry on another connection is told
    the stored notice, and both get the one result."""
    erin = approver(shared_gateway, "erin", "acme")
    call = action(BOB, 7)
    told: list[tuple[str, PendingNotice]] = []
    async with (
        await shared_gateway.client() as client,
        await shared_gateway.client() as retrying,
        await approvals_as(shared_gateway, erin) as approvals,
    ):
        first = asyncio.create_task(
            client.submit(call, timeout=120, on_pending=lambda n: told.append(("first", n)))
        )
        state = await waiting(approvals, key(BOB, call.call_id))
        for _ in range(300):  # the notice is published next to the approval request
            if told:
                break
            await asyncio.sleep(0.05)
        assert [who for who, _ in told] == ["first"] and not first.done()
        retry = asyncio.create_task(
            retrying.submit(call, timeout=120, on_pending=lambda n: told.append(("retry", n)))
        )
        for _ in range(300):  # the stored notice, read back by the retry
            if len(told) == 2:
                break
            await asyncio.sleep(0.05)
        assert [who for who, _ in told] == ["first", "retry"]
        assert all(notice.call_id == call.call_id for _, notice in told)
        granted = await approvals.vote(
            state.key, "approve", arguments_sha256=state.arguments_sha256, reason="fine"
        )
        assert granted.accepted
        results = await asyncio.gather(first, retry)
    assert results[0] == results[1] and results[0].ok
    assert len(told) == 2  # once each, never again once the result is in


class _Proxy:
    """A TCP proxy in front of NATS that can cut its connections and refuse new ones."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target, self.open, self.port = target, True, 0
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers |= {writer, up_writer}

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def cut(self) -> None:
        self.open = False
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    def close(self) -> None:
        self.cut()
        self._server.close()


async def test_a_result_published_while_the_client_was_disconnected_is_read_after_reconnect(
    shared_gateway: Gateway,
) -> None:
    """The call's id is minted by the client (no stored read at submit): only the read
    after the reconnect can find a result published while the connection was down."""
    erin = approver(shared_gateway, "erin", "acme")
    host, port = urlsplit(shared_gateway.url).hostname, urlsplit(shared_gateway.url).port
    assert host is not None and port is not None
    proxy = _Proxy((host, port))
    await proxy.start()
    creds = await shared_gateway.agent_creds(BOB.tenant, BOB.agent)
    noticed: list[str] = []
    client = await GatewayClient.connect(
        f"nats://127.0.0.1:{proxy.port}", creds, reconnect_time_wait=0.1
    )
    try:
        async with await approvals_as(shared_gateway, erin) as approvals:
            called = asyncio.create_task(
                client.call(
                    "approved_action",
                    {"amount": 11},
                    principal=BOB,
                    timeout=120,
                    on_pending=lambda n: noticed.append(n.call_id),
                )
            )
            for _ in range(300):
                if noticed:
                    break
                await asyncio.sleep(0.05)
            assert noticed, "no pending notice"
            call_id = noticed[0]
            state = await waiting(approvals, key(BOB, call_id))
            proxy.cut()  # the client is down; the result is published now
            granted = await approvals.vote(
                state.key, "approve", arguments_sha256=state.arguments_sha256, reason="ok"
            )
            assert granted.accepted
            subject = subjects.results_subject(BOB.tenant, BOB.agent, call_id)
            for _ in range(300):
                if await stored_on(shared_gateway, BOB, subject):
                    break
                await asyncio.sleep(0.1)
            assert not called.done()
            proxy.open = True  # it reconnects, and reads what it missed
            result = await asyncio.wait_for(called, 60)
        assert result.ok and result.call_id == call_id
    finally:
        await client.close()  # while it can still drain: then the proxy
        proxy.close()


async def test_close_while_the_bus_is_away_ends_the_client(shared_gateway: Gateway) -> None:
    """A client closed while its connection is down (reconnecting) is closed, at once and
    without an error: its reconnect loop does not go on forever behind the caller."""
    host, port = urlsplit(shared_gateway.url).hostname, urlsplit(shared_gateway.url).port
    assert host is not None and port is not None
    proxy = _Proxy((host, port))
    await proxy.start()
    creds = await shared_gateway.agent_creds(BOB.tenant, BOB.agent)
    client = await GatewayClient.connect(
        f"nats://127.0.0.1:{proxy.port}", creds, reconnect_time_wait=0.1
    )
    try:
        proxy.cut()  # down, and new connections refused: the client keeps reconnecting
        for _ in range(300):
            if client._nc.is_reconnecting:
                break
            await asyncio.sleep(0.05)
        assert client._nc.is_reconnecting
        await asyncio.wait_for(client.close(), 30)
        assert client._nc.is_closed
    finally:
        proxy.close()
