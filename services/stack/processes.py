"""Stopping child processes the same way everywhere: SIGTERM, wait, SIGKILL last."""

from __future__ import annotations

import signal
import subprocess


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
