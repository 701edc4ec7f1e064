"""Docs pages run as written, group 2 of tests/docs/test_readme.py's PAGE_GROUPS (its
page_group says which pages; test_readme.py's Reader runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs.test_readme import page_group, run_page


@pytest.mark.system
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", page_group(2))
def test_page_runs_as_written(page: str, tmp_path: Path) -> None:
    run_page(page, tmp_path)
