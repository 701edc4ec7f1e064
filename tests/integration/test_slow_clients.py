"""Slow clients at the front door and the inbox (issue 21, "Slow clients hold the doors").

Real servers on loopback ports: the front door's own uvicorn configuration (with a
trivial ASGI app: the guard is below ASGI) and the inbox itself. A client that
trickles a request head, a byte at a time, is disconnected by the server; a
connection over the cap is closed at once; a well-behaved client is served after the
slow ones are cut. The bounds below are limits on how long a test waits, not
performance assertions.

The doors run with their own limits (cap, guard, protocol) but shorter deadlines
(`sooner`): the head and body timeouts are settings of the same guard, and the
defaults' 10 s and 30 s were waited out in every test (about 90 s of idle wall).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import uvicorn

from toolgate.runtime.http_server import SlowClientLimits
from toolgate.services.approvals.inbox import INBOX_LIMITS, Inbox
from toolgate.services.mcp_front import app as front_door_app
from toolgate.services.mcp_front.app import FRONT_DOOR_LIMITS, FrontDoorOptions, front_door_config
from toolgate.stack.nats_server import EmbeddedNats
from toolgate.stack.supervisor import free_port

pytestmark = pytest.mark.slow  # each test waits out a door's timeout


def sooner(limits: SlowClientLimits) -> SlowClientLimits:
    """A door's limits with deadlines a test can wait out (uvicorn's keep-alive is whole
    seconds); the cap stays the door's."""
    return dataclasses.replace(limits, head_timeout_s=1.5, body_timeout_s=2.5, idle_timeout_s=1)


# How long a test waits for the server to act: far beyond the head and body timeouts.
GIVE_UP_S = sooner(FRONT_DOOR_LIMITS).body_timeout_s * 2 + 20
HEAD_START = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server has closed this connection (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1024) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset: refused or aborted by the server
        return True
    finally:
        sock.setblocking(True)


def trickle_until_cut(socks: list[socket.socket], give_up_s: float) -> int:
    """Send one more byte of the head on each open connection every 0.5 s (never the
    blank line that ends it) until the server has closed them all; how many it did."""
    open_ = list(socks)
    deadline = time.monotonic() + give_up_s
    while open_ and time.monotonic() < deadline:
        for sock in list(open_):
            if closed_by_server(sock):
                open_.remove(sock)
                continue
            with contextlib.suppress(OSError):
                sock.sendall(b"a")
        time.sleep(0.5)
    return len(socks) - len(open_)


def slow_connections(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(HEAD_START)
        socks.append(sock)
    return socks


def one_too_many_is_closed(port: int) -> bool:
    """A connection over the cap: the server closes it (EOF or reset) at once."""
    with socket.create_connection(("127.0.0.1", port)) as extra:
        extra.settimeout(GIVE_UP_S)
        try:
            extra.sendall(HEAD_START)
            return extra.recv(1024) == b""
        except TimeoutError:
            return False
        except OSError:
            return True


def served(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=GIVE_UP_S)
    try:
        conn.request("GET", "/healthz", headers={"Host": "127.0.0.1"})
        return conn.getresponse().status
    finally:
        conn.close()


def check_trickle(port: int, count: int = 5) -> None:
    socks = slow_connections(port, count)
    try:
        cut = trickle_until_cut(socks, GIVE_UP_S)
        assert cut == count, f"{count - cut} of {count} trickling clients still held open"
        assert served(port) == 200
    finally:
        for sock in socks:
            sock.close()


def check_cap(port: int, cap: int) -> None:
    socks = slow_connections(port, cap)
    try:
        time.sleep(0.5)  # every one of them accepted by the server
        assert one_too_many_is_closed(port), "a connection over the cap was kept open"
        cut = trickle_until_cut(socks, GIVE_UP_S)
        assert cut == cap, f"{cap - cut} of {cap} trickling clients still held open"
        assert served(port) == 200
    finally:
        for sock in socks:
            sock.close()


async def healthz(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    message = {"more_body": scope["method"] == "POST"}
    while message.get("more_body"):  # a POST: its whole body first, as the MCP app does
        message = await receive()
        if message["type"] != "http.request":
            return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def front_door_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """uvicorn as the front door configures it (with `sooner` deadlines), around a
    trivial app."""
    monkeypatch.setattr(front_door_app, "FRONT_DOOR_LIMITS", sooner(FRONT_DOOR_LIMITS))
    options = FrontDoorOptions(host="127.0.0.1", port=free_port("127.0.0.1"))
    config = front_door_config(healthz, options)
    config.lifespan = "off"
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + GIVE_UP_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield options.port
    server.should_exit = True
    thread.join(GIVE_UP_S)


@pytest.fixture
async def inbox_port(nats_server: EmbeddedNats) -> AsyncIterator[int]:
    inbox = await asyncio.to_thread(Inbox(nats_server.url, limits=sooner(INBOX_LIMITS)).start)
    yield inbox.port
    await asyncio.to_thread(inbox.stop)


def test_the_front_door_cuts_a_client_trickling_its_head(front_door_port: int) -> None:
    check_trickle(front_door_port)


def test_the_front_door_closes_connections_over_its_cap(front_door_port: int) -> None:
    check_cap(front_door_port, FRONT_DOOR_LIMITS.max_connections)


async def test_the_inbox_cuts_a_client_trickling_its_head(inbox_port: int) -> None:
    await asyncio.to_thread(check_trickle, inbox_port)


async def test_the_inbox_closes_connections_over_its_cap(inbox_port: int) -> None:
    await asyncio.to_thread(check_cap, inbox_port, INBOX_LIMITS.max_connections)


def test_an_idle_connection_that_never_sends_is_cut(front_door_port: int) -> None:
    """Uvicorn arms its keep-alive timer only after a response: a connection that
    never sends a byte was held for ever."""
    with socket.create_connection(("127.0.0.1", front_door_port)) as sock:
        sock.settimeout(GIVE_UP_S)
        try:
            assert sock.recv(1024) == b""
        except TimeoutError:
            pytest.fail("a silent connection was kept open")


def test_a_body_trickled_after_its_head_is_cut(front_door_port: int) -> None:
    """A complete head, then a body a byte at a time: the app waits for the body and
    each byte cancelled uvicorn's only timer."""
    with socket.create_connection(("127.0.0.1", front_door_port)) as sock:
        sock.sendall(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n{")
        assert trickle_until_cut([sock], GIVE_UP_S) == 1, "a trickled body was kept open"
