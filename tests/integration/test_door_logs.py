"""The doors' uvicorn log lines show an outsider's request path and client address
escaped (runtime/http_server.py: every door's uvicorn.Config comes from
`uvicorn_config`), not as bytes a terminal or log viewer obeys.

A real uvicorn on a loopback port, configured as a door is, with its access log on;
a client sends raw C1 control bytes (CSI, NEL) in X-Forwarded-For (which uvicorn
believes from loopback and logs as the client; its parser refuses them in a path)
and a typed escape in the query.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from toolgate.runtime.http_server import uvicorn_config
from toolgate.services.mcp_front.app import FRONT_DOOR_LIMITS
from toolgate.stack.supervisor import free_port

WAIT_S = 30.0
HIDDEN = ("\x1b", "\x9b", "\x85", "\x07")


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


async def ok(scope, receive, send):  # type: ignore[no-untyped-def]
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def door() -> Iterator[tuple[int, Capture]]:
    port = free_port("127.0.0.1")
    config = uvicorn_config(ok, "127.0.0.1", port, FRONT_DOOR_LIMITS, log_level="info")
    config.lifespan = "off"
    capture = Capture()
    loggers = [logging.getLogger(n) for n in ("uvicorn.access", "uvicorn.error")]
    for logger in loggers:
        logger.addHandler(capture)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + WAIT_S
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    try:
        yield port, capture
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        for logger in loggers:
            logger.removeHandler(capture)


def send_raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(request)
        return sock.recv(4096)


def test_the_access_log_escapes_the_path_and_the_forwarded_client(
    door: tuple[int, Capture],
) -> None:
    port, capture = door
    answer = send_raw(
        port,
        b"GET /calls/x?q=\\u001b HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"X-Forwarded-For: \x9b2J\x9b31mapproved\x85forged\r\nConnection: close\r\n\r\n",
    )
    assert answer.startswith(b"HTTP/1.1 200"), answer
    deadline = time.monotonic() + WAIT_S
    while not any("approved" in line for line in capture.lines):
        assert time.monotonic() < deadline, capture.lines
        time.sleep(0.05)
    line = next(line for line in capture.lines if "approved" in line)
    assert not [ch for ch in HIDDEN if ch in line], line
    assert "\\u009b31mapproved\\u0085forged" in line, line
    # The path's typed `\u001b` (the parser takes no control byte in a path) is shown
    # with its backslash doubled: it cannot pass for an escape the log wrote.
    assert "q=\\\\u001b" in line, line
