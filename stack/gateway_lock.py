"""One gateway per data dir: `toolgate up` holds DATA_DIR/gateway.lock while it runs.

A lock (flock) rather than a bare pid file: the kernel drops it when the process
ends, however it ends, so a gateway killed with SIGKILL leaves no stale claim and
a reused pid is never mistaken for it. The file holds the pid, for the message.
Its descriptor is not inherited: the servers and services `toolgate up` starts do
not keep the claim alive after it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

LOCK_FILE = "gateway.lock"


class GatewayRunning(Exception):
    """Another process holds the data dir."""

    def __init__(self, data_dir: Path, pid: int | None) -> None:
        super().__init__(f"a gateway already runs in {data_dir} (pid {pid or 'unknown'})")
        self.pid = pid


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def running_gateway(data_dir: Path) -> int | None:
    """The pid of the gateway that holds `data_dir` now (0 if its pid is unreadable), or
    None when none does."""
    path = data_dir / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _pid_in(path) or 0
    finally:
        os.close(fd)  # also drops the shared lock it may have taken
    return None


def claim_data_dir(data_dir: Path) -> int:
    """Hold `data_dir` for this process: a descriptor to pass to `release` (or to leave
    to the process's end); GatewayRunning if another holds it."""
    path = data_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise GatewayRunning(data_dir, _pid_in(path)) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)
