"""The command line's entry points: `python -m toolgate.cli.main` (how many tests and
scripts run it) fails in one line with the command's exit code, like `toolgate`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize("module", ["toolgate.cli.main", "toolgate.cli"])
def test_a_command_groups_failure_keeps_its_exit_code_run_as_a_module(
    module: str, tmp_path: Path
) -> None:
    """A failure raised in a command group's own module (here `tools import-openapi`) is
    the same Failed that main() catches, also when main.py runs as __main__ (before the
    split it was another class there: `unexpected Failed`, exit 1)."""
    missing = tmp_path / "missing.yaml"
    done = subprocess.run(
        [sys.executable, "-m", module, "tools", "import-openapi", str(missing)]
        + ["--prefix", "shop", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"toolgate tools import-openapi: cannot read {missing}: [Errno 2] No such file or "
        f"directory: '{missing}'"
    ]
