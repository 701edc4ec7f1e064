"""Lint and types are part of the test command, so `.ci/run` checks them too."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO_ROOT


def test_ruff_finds_nothing() -> None:
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout + found.stderr


def test_ruff_format_changes_nothing() -> None:
    found = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stdout + found.stderr


def test_mypy_finds_nothing_in_the_package() -> None:
    packages = ["contracts", "services", "runtime", "stack", "client", "bench", "cli"]
    found = subprocess.run(
        [sys.executable, "-m", "mypy", *packages], cwd=REPO_ROOT, capture_output=True, text=True
    )
    assert found.returncode == 0, found.stdout + found.stderr
