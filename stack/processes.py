"""Child processes, the same way everywhere: they die with their parent; stop = SIGTERM,
wait, SIGKILL last."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` of every child toolgate starts: the kernel sends it SIGTERM when the
    process that started it dies, even by SIGKILL, so `toolgate up` leaves no orphans.

    Linux only (prctl); elsewhere a no-op. Runs in the child between fork and exec.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """Ask politely, wait up to `timeout` seconds, then kill. A dead process is left alone."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def kill_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL: what the crash tests use."""
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()
