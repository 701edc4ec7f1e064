"""The docs site (mkdocs.yml, pages under docs/) builds with --strict, offline; its
dated benchmark results and its decision records keep their shape."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.harness import REPO_ROOT

DOCS = REPO_ROOT / "docs"
RESULT_NAME = re.compile(r"^\d{4}-\d{2}-\d{2}-[a-z0-9][a-z0-9-]*\.md$")
DECISION_NAME = re.compile(r"^\d{4}-[a-z0-9][a-z0-9-]*\.md$")


def build(site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # the theme's banner, not a warning
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict"]
        + ["--config-file", str(REPO_ROOT / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strict(tmp_path: Path) -> None:
    """A broken link, an anchor that is not there, or a page left out of the nav fails."""
    done = build(tmp_path / "site")
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    for page in ("index.html", "reference/cli/index.html", "benchmarks/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_the_site_fetches_nothing_at_build_or_read_time() -> None:
    """No plugin that needs the internet; the theme loads no web fonts."""
    config = yaml.load((REPO_ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert config["theme"]["font"] == "false"
    plugins = [p if isinstance(p, str) else next(iter(p)) for p in config.get("plugins", [])]
    assert set(plugins) <= {"search"}, plugins


def test_the_cli_reference_is_in_the_nav() -> None:
    assert "reference/cli.md" in (REPO_ROOT / "mkdocs.yml").read_text()
    assert (DOCS / "reference" / "cli.md").is_file()


def test_every_benchmark_result_is_a_dated_file_the_index_links() -> None:
    folder = DOCS / "benchmarks"
    index = (folder / "index.md").read_text()
    results = [p for p in folder.glob("*.md") if p.name != "index.md"]
    assert len(results) >= 10
    for path in results:
        assert RESULT_NAME.match(path.name), f"{path.name}: not YYYY-MM-DD-<slug>.md"
        head = path.read_text().lower()[:2000]
        for field in ("command", "commit", "load average"):
            assert field in head, f"{path.name}: no {field} in its header"
        # The machine: a line of its own, or the rows `--save` writes (bench/results.py).
        assert "machine" in head or "| cores |" in head, f"{path.name}: no machine in its header"
        assert f"]({path.name})" in index, f"benchmarks/index.md does not link {path.name}"


def test_every_decision_record_says_context_decision_consequences() -> None:
    folder = DOCS / "decisions"
    records = sorted(p for p in folder.glob("*.md") if p.name != "index.md")
    assert 8 <= len(records) <= 20
    numbers = [int(p.name[:4]) for p in records]
    assert numbers == list(range(1, len(records) + 1)), "numbered 0001, 0002, ... without gaps"
    index = (folder / "index.md").read_text()
    for path in records:
        assert DECISION_NAME.match(path.name), path.name
        text = path.read_text()
        for heading in ("## Context", "## Decision", "## Consequences"):
            assert heading in text, f"{path.name}: no {heading!r}"
        assert f"]({path.name})" in index, f"decisions/index.md does not link {path.name}"


def test_the_readme_is_a_guide() -> None:
    """At most 400 lines, and the sections a newcomer needs, in order."""
    text = (REPO_ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 400
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    wanted = [
        "## Requirements",
        "## Two commands",
        "## A first call",
        "## Adding a tool",
        "## Writing a policy",
        "## Approvals",
    ]
    assert [h for h in headings if h in wanted] == wanted
    assert "pip install toolgate" in text and ". .venv/bin/activate" in text


def test_the_readme_test_command_is_what_ci_runs() -> None:
    ci = (REPO_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (REPO_ROOT / "README.md").read_text()
    assert f"```sh\n{ci}\n```" in readme, ci
