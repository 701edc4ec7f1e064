"""Child processes, the same way everywhere: they die with their parent; stop = SIGTERM,
wait, SIGKILL last."""

from __future__ import annotations

import ctypes
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from typing import Protocol

_PR_SET_PDEATHSIG = 1
# Ports handed to children are drawn from here, below the kernel's ephemeral range.
_LISTEN_PORTS_FROM = 10_000


class ChildProcess(Protocol):
    """What toolgate asks of a child process: a `subprocess.Popen`, or a service forked
    by the fork server (stack/forkserver.py: ForkedProcess)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...


def die_with_parent() -> None:
    """`preexec_fn` of every child toolgate starts: the kernel sends it SIGTERM when the
    process that started it dies, even by SIGKILL, so `toolgate up` leaves no orphans.

    Linux only (prctl); elsewhere a no-op. Runs in the child between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return
    # The process's own symbols (libc's among them): `ctypes.util.find_library` would run
    # `ldconfig -p` in a subprocess, in every child, on every start.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_process(process: ChildProcess | None, timeout: float) -> None:
    """Ask politely, wait up to `timeout` seconds, then kill. A dead process is left alone."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_processes(processes: Iterable[ChildProcess | None], timeout: float) -> None:
    """`stop_process` for several at once: every one asked first, then each waited for
    within the one `timeout`, so stopping takes as long as the slowest, not the sum."""
    running = [p for p in processes if p is not None and p.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in running:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def kill_process(process: ChildProcess | None) -> None:
    """SIGKILL: what the crash tests use."""
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a child that binds it a moment later.

    Drawn at random from below the kernel's ephemeral range
    (`ip_local_port_range`). `bind(0)` would hand out a port from inside that
    range, the one every outgoing connection on the machine takes its source
    port from: between this check and the child's bind, any client socket
    could take it (seen in tests: a service's /metrics port "address already
    in use"). Below the range only another listener can collide, and it
    would have to draw the same port in the same moment.
    """
    low = _ephemeral_low()
    if low - _LISTEN_PORTS_FROM >= 1_000:
        for _ in range(100):
            port = random.randrange(_LISTEN_PORTS_FROM, low)
            if port_is_free(port, host):
                return port
    with socket.socket() as sock:  # no room below the range: the kernel's choice
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; elsewhere a fair guess


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nothing listens on `port` now (checked as servers bind: SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
