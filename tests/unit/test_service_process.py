"""A service the supervisor restarts is the service it started: same command, same
environment (its OTLP endpoint, its TOOLGATE_* settings), whatever the parent's
environment has become since. A stack stops its services side by side."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from toolgate.stack.supervisor import ServiceProcess, Stack

SAYS_ITS_SETTING = "import os; print(os.environ.get('TOOLGATE_TEST_SETTING'))"


def test_a_restart_keeps_the_first_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "service.log"
    service = ServiceProcess("echo-env", [sys.executable, "-c", SAYS_ITS_SETTING], log)
    monkeypatch.setenv("TOOLGATE_TEST_SETTING", "as-started")
    service.start()
    assert service.process is not None and service.process.wait(30) == 0
    monkeypatch.setenv("TOOLGATE_TEST_SETTING", "changed-later")
    service.start()  # what restart_unhealthy does
    assert service.process is not None and service.process.wait(30) == 0
    assert log.read_text().split() == ["as-started", "as-started"]


# A service that takes a moment to stop: it writes when SIGTERM came and when it left.
STOPS_SLOWLY = (
    "import signal, sys, time\n"
    "def stop(*_):\n"
    "    print('asked', time.monotonic(), flush=True)\n"
    "    time.sleep(0.5)\n"
    "    print('gone', time.monotonic(), flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "print('ready', flush=True)\n"
    "time.sleep(120)\n"
)


def test_a_stack_asks_every_service_to_stop_before_waiting_for_any(tmp_path: Path) -> None:
    """Stopped one after another, each waited for, a gateway's stop was the sum of its
    services' (every test gateway paid it); asked together, each is asked before the
    first has gone."""
    stack = Stack(data_dir=tmp_path / "data")
    for name in ("one", "two", "three"):
        service = ServiceProcess(name, [sys.executable, "-c", STOPS_SLOWLY], tmp_path / name)
        service.start()
        stack.services.append(service)
    deadline = time.monotonic() + 60  # a bound on a busy machine, not a measure
    while not all(s.log_path.read_text().startswith("ready") for s in stack.services):
        assert time.monotonic() < deadline, "the services never started"
        time.sleep(0.05)
    stack.stop()
    said = {s.name: dict(line.split() for line in s.log_path.read_text().splitlines()[1:])
            for s in stack.services}  # fmt: skip
    assert all(s.process is not None and s.process.returncode == 0 for s in stack.services)
    asked = max(float(lines["asked"]) for lines in said.values())
    gone = min(float(lines["gone"]) for lines in said.values())
    assert asked < gone, said
