"""docs/architecture.md's handler table says what the code runs."""

from __future__ import annotations

from tests.harness import REPO_ROOT
from toolgate.runtime.topology import handlers


def test_the_handler_table_in_the_docs_matches_the_code() -> None:
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    rows = [
        line
        for line in text.splitlines()
        if line.startswith("| ") and line.count("|") == 6 and "`" in line
    ]
    documented = [
        tuple(cell.strip().strip("`") for cell in row.strip("|").split("|"))[:4]
        for row in rows
        if not row.startswith("| `")
    ]
    expected = [
        (h.service, h.stream, h.durable, h.filter_subject)
        for h in handlers(["<tool>"], with_audit=True)
    ]
    assert documented == expected
