"""Slow clients against a door: what N connections trickling a request head cost it.

    python -m toolgate.bench.slow_clients front [--clients 800] [--seconds 45]
    python -m toolgate.bench.slow_clients inbox [--clients 800] [--seconds 45]
    python -m toolgate.bench.slow_clients attach --pid PID --port PORT   # any server

`front` runs the front door's uvicorn configuration (front_door_config) around a
trivial ASGI app in a child process (the slow-client guard is below ASGI, so the
app does not matter); `inbox` runs the inbox itself in a child, against an embedded
nats-server. Then N clients on loopback each open a connection, send the start of a
request head and one more byte of it every second, never its end, for the given
time. Every second it reads the server process's open file handles, threads and RSS
from /proc, and prints the baseline, the peak and the end, and how many of the
clients the server cut. Loopback only, bounded: at most 2000 clients, 120 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
HEAD_START = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
MAX_CLIENTS = 2000
MAX_SECONDS = 120.0
# The peak counts sockets accepted and not yet closed over the cap during the flood;
# a couple of seconds later what is left is what the server holds.
HELD_AFTER_S = 3.0

FRONT_CHILD = """
import sys, uvicorn
from toolgate.services.mcp_front.app import FrontDoorOptions, front_door_config

async def app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})

config = front_door_config(app, FrontDoorOptions(host="127.0.0.1", port=int(sys.argv[1])))
config.lifespan = "off"
uvicorn.Server(config).run()
"""

INBOX_CHILD = """
import sys, threading
from toolgate.services.approvals.inbox import Inbox
inbox = Inbox(sys.argv[2], port=int(sys.argv[1])).start()
print("ready", flush=True)
threading.Event().wait()
"""


@dataclass
class Sample:
    fds: int
    threads: int
    rss_kib: int


def sample(pid: int) -> Sample:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    values = {k: v.split()[0] for k, _, v in (line.partition(":") for line in status) if v.strip()}
    return Sample(fds, int(values["Threads"]), int(values["VmRSS"]))


def closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024, socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:
        return True


def wait_for_port(port: int, give_up_s: float = 30.0) -> None:
    deadline = time.monotonic() + give_up_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=1):
            return
        time.sleep(0.1)
    raise SystemExit(f"nothing listens on {HOST}:{port}")


def attack(pid: int, port: int, clients: int, seconds: float) -> None:
    before = sample(pid)
    socks: list[socket.socket] = []
    refused = 0
    for _ in range(clients):
        try:
            sock = socket.create_connection((HOST, port), timeout=5)
            sock.settimeout(None)  # blocking: MSG_DONTWAIT alone decides
            sock.sendall(HEAD_START)
            socks.append(sock)
        except OSError:
            refused += 1
    started = time.monotonic()
    peak = sample(pid)
    held: Sample | None = None
    held_open = len(socks)
    open_ = list(socks)
    while time.monotonic() - started < seconds:
        if held is None and time.monotonic() - started >= HELD_AFTER_S:
            held, held_open = sample(pid), len(open_)
        for sock in list(open_):
            if closed(sock):
                open_.remove(sock)
                continue
            with contextlib.suppress(OSError):
                sock.send(b"a", socket.MSG_DONTWAIT)
        now = sample(pid)
        peak = Sample(
            max(peak.fds, now.fds), max(peak.threads, now.threads), max(peak.rss_kib, now.rss_kib)
        )
        time.sleep(1.0)
    end = sample(pid)
    for sock in socks:
        sock.close()
    print(f"{clients} slow clients for {seconds:g} s on {HOST}:{port} (server pid {pid})")
    print(f"  refused at connect: {refused}; cut by the server: {len(socks) - len(open_)}")
    print(f"  still connected at {HELD_AFTER_S:g} s: {held_open}; at the end: {len(open_)}")
    rows = [("before", before), ("peak", peak), (f"at {HELD_AFTER_S:g} s", held), ("end", end)]
    for name, s in rows:
        if s is None:
            continue
        print(f"  {name:7} fds {s.fds:5}  threads {s.threads:4}  rss {s.rss_kib / 1024:7.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m toolgate.bench.slow_clients")
    parser.add_argument("door", choices=("front", "inbox", "attach"))
    parser.add_argument("--clients", type=int, default=800)
    parser.add_argument("--seconds", type=float, default=45.0)
    parser.add_argument("--pid", type=int, help="attach: the server's process id")
    parser.add_argument("--port", type=int, help="attach: its port on 127.0.0.1")
    args = parser.parse_args(argv)
    if not 0 < args.clients <= MAX_CLIENTS or not 0 < args.seconds <= MAX_SECONDS:
        parser.error(f"at most {MAX_CLIENTS} clients and {MAX_SECONDS:g} s")
    if args.door == "attach":
        if args.pid is None or args.port is None:
            parser.error("attach needs --pid and --port")
        attack(args.pid, args.port, args.clients, args.seconds)
        return 0

    from toolgate.stack.nats_server import EmbeddedNats
    from toolgate.stack.supervisor import free_port

    port = free_port(HOST)
    with tempfile.TemporaryDirectory() as tmp:
        nats = None
        if args.door == "front":
            child = subprocess.Popen([sys.executable, "-c", FRONT_CHILD, str(port)])
        else:
            nats = EmbeddedNats(Path(tmp)).start()
            child = subprocess.Popen([sys.executable, "-c", INBOX_CHILD, str(port), nats.url])
        try:
            wait_for_port(port)
            time.sleep(1.0)  # the probe's connection gone
            attack(child.pid, port, args.clients, args.seconds)
        finally:
            child.terminate()
            child.wait(10)
            if nats is not None:
                nats.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
