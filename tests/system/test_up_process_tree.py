"""`toolgate up` as an operator runs it: a SIGKILL of it leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.system


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.update(int(child) for child in text)
    return found


def descendants_of(pid: int) -> set[int]:
    """Its children, theirs, and so on (the services are the fork server's children)."""
    found, todo = set(), [pid]
    while todo:
        for child in children_of(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:  # it has ended meanwhile
        return ""


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc")
def test_sigkill_of_up_takes_every_child_with_it(tmp_path: Path) -> None:
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "toolgate.cli.main",
            "up",
            "--nats-port",
            "0",
            "--data-dir",
            str(tmp_path / "data"),
        ],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        for line in up.stdout:  # bounded by the test timeout
            if line.startswith("Press Ctrl-C"):
                break
        # nats-server, ClickHouse, and eight services (five pipeline services, the
        # notifier, the audit sink and the MCP front door), each named by its own
        # command: forked by the fork server (one more process; a forked child names
        # itself as it begins, so a moment after its start), or started plainly.
        wanted = {"validator", "policy", "executor", "attacher", "approvals", "audit"}
        deadline = time.monotonic() + 60
        while True:
            children = descendants_of(up.pid)
            commands = [command_of(pid) for pid in children]
            served = {c.split(" serve ", 1)[1].split()[0] for c in commands if " serve " in c}
            if len(children) >= 10 and served >= wanted or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert len(children) >= 10, commands
        assert served >= wanted, commands
        assert all(alive(pid) for pid in children), [
            c for p, c in zip(children, commands, strict=True) if not alive(p)
        ]
    finally:
        os.kill(up.pid, signal.SIGKILL)
        up.wait()
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [command_of(pid) for pid in children if alive(pid)] == []
