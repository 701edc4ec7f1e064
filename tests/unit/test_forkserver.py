"""Services forked from the fork server behave as the command started cold would:
its arguments, environment, working directory, log, exit code, signals, and name."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolgate.stack import forkserver
from toolgate.stack.forkserver import ForkedProcess
from toolgate.stack.supervisor import ServiceProcess

pytestmark = [
    pytest.mark.slow,  # each environment starts a fork server (its imports: a few CPU-s)
    pytest.mark.skipif(not forkserver.enabled(), reason="the fork server is Linux only"),
]


def toolgate(*args: str) -> list[str]:
    return [sys.executable, "-m", "toolgate.cli", *args]


def test_a_command_is_forked_and_its_exit_code_and_output_are_its_own(tmp_path: Path) -> None:
    ok = ServiceProcess("help", toolgate("--help"), tmp_path / "help.log")
    ok.start()
    assert isinstance(ok.process, ForkedProcess)
    assert ok.process.wait(60) == 0
    assert "usage: toolgate" in (tmp_path / "help.log").read_text()

    wrong = ServiceProcess("wrong", toolgate("no-such-command"), tmp_path / "wrong.log")
    wrong.start()
    assert isinstance(wrong.process, ForkedProcess)
    assert wrong.process.wait(60) == 2
    assert "invalid choice: 'no-such-command'" in (tmp_path / "wrong.log").read_text()
    assert ok.process.pid != wrong.process.pid


def test_a_forked_command_has_the_environment_and_folder_it_was_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `toolgate status` says where it looked: the data dir from $TOOLGATE_DATA_DIR, and
    # (without it) the NATS URL recorded in .toolgate/context.json of its working folder.
    here = tmp_path / "here"
    (here / ".toolgate").mkdir(parents=True)
    (here / ".toolgate" / "context.json").write_text(json.dumps({"nats_url": "nats://127.0.0.1:9"}))
    monkeypatch.chdir(here)
    monkeypatch.delenv("TOOLGATE_DATA_DIR", raising=False)
    monkeypatch.delenv("TOOLGATE_NATS_URL", raising=False)
    in_folder = ServiceProcess("status", toolgate("status"), tmp_path / "folder.log")
    in_folder.start()
    assert in_folder.process is not None and in_folder.process.wait(60) == 3
    assert "no NATS at nats://127.0.0.1:9 " in (tmp_path / "folder.log").read_text()

    monkeypatch.setenv("TOOLGATE_DATA_DIR", str(tmp_path / "elsewhere"))
    by_env = ServiceProcess("status", toolgate("status"), tmp_path / "env.log")
    by_env.start()
    assert isinstance(by_env.process, ForkedProcess)
    assert by_env.process.wait(60) == 3
    said = (tmp_path / "env.log").read_text()
    assert f"{tmp_path / 'elsewhere' / 'context.json'}" in said
    # A restart runs it again as first started, whatever the parent's environment now is.
    monkeypatch.setenv("TOOLGATE_DATA_DIR", str(tmp_path / "changed"))
    by_env.start()
    assert by_env.process is not None and by_env.process.wait(60) == 3
    assert "changed" not in (tmp_path / "env.log").read_text()


def test_a_forked_service_is_named_by_its_command_and_stops_on_sigterm(tmp_path: Path) -> None:
    # A service with no NATS to reach waits for it: a long-running child to stop.
    command = toolgate("serve", "validator", "--nats-url", "nats://127.0.0.1:9")
    service = ServiceProcess("validator", command, tmp_path / "validator.log")
    service.start()
    assert isinstance(service.process, ForkedProcess)
    cmdline = Path(f"/proc/{service.process.pid}/cmdline")
    deadline = time.monotonic() + 60  # the child names itself as it begins
    while cmdline.read_bytes().split(b"\0")[0].decode() != " ".join(command):
        assert time.monotonic() < deadline, cmdline.read_bytes()
        time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        service.process.wait(0.5)
    assert service.alive()
    service.stop(timeout=30)
    assert service.process.returncode in (0, -signal.SIGTERM)
    assert not service.alive()


def test_another_command_and_a_switched_off_fork_server_start_plainly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    other = ServiceProcess("py", [sys.executable, "-c", "print('plain')"], tmp_path / "py.log")
    other.start()
    assert isinstance(other.process, subprocess.Popen)
    assert other.process.wait(30) == 0
    monkeypatch.setenv(forkserver.ENV_SWITCH, "0")
    cold = ServiceProcess("help", toolgate("--help"), tmp_path / "help.log")
    cold.start()
    assert isinstance(cold.process, subprocess.Popen)
    assert cold.process.wait(60) == 0
