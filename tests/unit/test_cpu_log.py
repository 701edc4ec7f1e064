"""tests/cpu_log.py: the CPU each test file costs, its processes' included."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import cpu_log
from tests.harness import REPO_ROOT


def test_a_block_logs_its_own_cpu_and_its_reaped_childrens(tmp_path: Path) -> None:
    log = tmp_path / "cpu.tsv"
    with cpu_log.logged("spin", str(log)):
        busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass"
        subprocess.run([sys.executable, "-c", busy], check=True)
    name, cpu, wall = log.read_text().split("\t")
    assert name == "spin" and float(cpu) >= 0.3 and float(wall) >= 0.3


def test_nothing_is_logged_without_a_log(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv(cpu_log.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    with cpu_log.logged("quiet"):
        pass
    assert list(tmp_path.iterdir()) == []


def test_a_run_logs_a_line_per_test_file(tmp_path: Path) -> None:
    log = tmp_path / "cpu.tsv"
    env = {**os.environ, cpu_log.ENV: str(log)}
    files = ["tests/unit/test_timespec.py", "tests/unit/test_outside_text.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *files],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert sorted(name for name, _, _ in lines) == sorted(files)
    assert all(float(cpu) > 0 for _, cpu, _ in lines)
