"""Lint, types and import rules are part of the test command, so `.ci/run` checks them too."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.harness import REPO_ROOT

# The whole package, as one tree (src/toolgate links each top-level folder): mypy reads
# `[tool.mypy]` in pyproject.toml, which points it at src/ and checks `toolgate`.
MYPY = [sys.executable, "-m", "mypy"]


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
    found = subprocess.run(MYPY, cwd=REPO_ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout + found.stderr


def test_mypy_sees_a_wrong_call_from_a_service_into_contracts(tmp_path: Path) -> None:
    """The same command, with one service module read as if it called into `contracts`
    with a wrong argument type (mypy's --shadow-file: the tree is not touched). Were
    `toolgate.*` imports unresolved (Any), this would pass unnoticed."""
    module = Path("services/validator/call_ids.py")
    shadow = tmp_path / "call_ids.py"
    shadow.write_text(
        (REPO_ROOT / module).read_text()
        + "\n\nfrom toolgate.contracts import subjects as _subjects  # noqa: E402\n\n\n"
        + "def _wrong() -> str:\n"
        + '    return _subjects.results_subject("acme", "bot", 3)\n'
    )
    linked = Path("src/toolgate") / module  # how mypy names it: through the package's tree
    found = subprocess.run(
        [*MYPY, "--shadow-file", str(linked), str(shadow)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 1, found.stdout + found.stderr
    assert (
        'Argument 3 to "results_subject" has incompatible type "int"; expected "str"'
        in found.stdout
    ), found.stdout + found.stderr


def test_import_rules_hold() -> None:
    """[tool.importlinter] in pyproject.toml: services never import each other; contracts
    import nothing else of toolgate."""
    found = subprocess.run(
        [str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert found.returncode == 0, found.stdout + found.stderr
