"""docs/reference/cli.md is what the parser says now: a new command or option, or a changed
help text or default, fails here until the page is written again
(`python -m toolgate.cli.reference`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT
from toolgate.cli import reference
from toolgate.cli.main import full_parser

PAGE = REPO_ROOT / reference.DEFAULT_OUT


def test_the_committed_page_is_what_the_parser_says() -> None:
    assert PAGE.read_text(encoding="utf-8") == reference.render(), (
        f"{reference.DEFAULT_OUT} is out of date: run `{reference.REGENERATE}` and commit it"
    )


def test_the_page_names_every_command_and_option() -> None:
    page = reference.render()

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        assert f"# {path}\n" in page, path
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif action.option_strings and action.help != argparse.SUPPRESS:
                if not isinstance(action, argparse._HelpAction):
                    assert f"`{', '.join(action.option_strings)}" in page, (path, action.dest)

    parser = full_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                walk(sub, f"toolgate {name}")


def test_the_page_is_the_same_wherever_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defaults read from TOOLGATE_* variables and from a `toolgate up`'s context.json do
    not leak into the page: it is the same on every machine."""
    neutral = reference.render()
    data = tmp_path / ".toolgate"
    data.mkdir()
    (data / "context.json").write_text(
        json.dumps({"nats_url": "nats://10.1.2.3:4999", "clickhouse_url": "http://x:1/y"})
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOOLGATE_NATS_URL", "nats://10.9.9.9:4222")
    monkeypatch.setenv("TOOLGATE_REGISTRY", str(tmp_path))
    assert reference.render() == neutral
    assert "10.9.9.9" not in neutral and "10.1.2.3" not in neutral


def test_check_says_when_the_page_is_out_of_date(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "cli.md"
    assert reference.main(["--check", "--out", str(page)]) == 1  # no page yet
    assert "out of date" in capsys.readouterr().err
    assert reference.main(["--out", str(page)]) == 0
    assert reference.main(["--check", "--out", str(page)]) == 0
    page.write_text(page.read_text().replace("--nats-url", "--nats-uri", 1))
    assert reference.main(["--check", "--out", str(page)]) == 1
