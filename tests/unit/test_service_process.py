"""A service the supervisor restarts is the service it started: same command, same
environment (its OTLP endpoint, its TOOLGATE_* settings), whatever the parent's
environment has become since."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from toolgate.stack.supervisor import ServiceProcess

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
