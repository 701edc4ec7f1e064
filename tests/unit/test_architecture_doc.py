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


def test_the_stage_example_is_the_policy_services_code() -> None:
    """The "Writing a stage" example is an excerpt of services/policy/app.py: every line
    of it (but the `...` of what is left out) is a line of the code."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Writing a stage", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = {
        line.strip() for line in (REPO_ROOT / "services/policy/app.py").read_text().splitlines()
    }
    lines = [line.strip() for line in block.splitlines()]
    excerpt = [line for line in lines if line and not line.startswith("...")]
    assert len(excerpt) > 10
    assert [line for line in excerpt if line not in code] == []


def test_the_batch_stage_example_is_the_audit_sinks_code() -> None:
    """The `BatchStage` example is an excerpt of services/audit/app.py, line by line."""
    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    section = text.split("A stage whose unit of work is a batch", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = {line.strip() for line in (REPO_ROOT / "services/audit/app.py").read_text().splitlines()}
    excerpt = [line.strip() for line in block.splitlines() if line.strip()]
    assert len(excerpt) > 10
    assert [line for line in excerpt if line not in code] == []
