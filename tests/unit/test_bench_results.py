"""Dated benchmark results files: their name, their header, and what `--save` captures."""

from __future__ import annotations

import argparse
import datetime as dt
import re
from pathlib import Path

import pytest

from toolgate.bench import results
from toolgate.bench.results import Commit, Machine

WHEN = dt.datetime(2026, 12, 3, 16, 40, tzinfo=dt.UTC)
MACHINE = Machine(
    cores=2,
    memory_gib=7.75,
    cpu_model="Example CPU @ 2.10GHz",
    python="CPython 3.11.2",
    os="Linux-6.1-x86_64",
)
BODY = "| a | b |\n| --- | --- |\n| 1 | 2 |\n"


def rendered(**changes: object) -> str:
    given: dict[str, object] = {
        "when": WHEN,
        "machine": MACHINE,
        "commit": Commit("87066ef" + "0" * 33, False),
        "load_at_start": (0.42, 0.8, 1.25),
    }
    given.update(changes)
    return results.render(
        "soak",
        "toolgate bench soak -n 300 --rate 50 --save",
        BODY,
        **given,  # type: ignore[arg-type]
    )


def header(text: str) -> dict[str, str]:
    rows = re.findall(r"^\| ([^|]+) \| (.*) \|$", text, re.MULTILINE)
    return {name.strip(): value for name, value in rows}


def test_the_header_says_command_commit_machine_and_load_then_the_figures() -> None:
    text = rendered()
    assert text.startswith("# soak: 2026-12-03\n")
    rows = header(text.split("## Figures")[0])
    assert rows["command"] == "`toolgate bench soak -n 300 --rate 50 --save`"
    assert rows["commit"] == "`87066ef" + "0" * 33 + "`"
    assert rows["cores"] == "2"
    assert rows["memory"] == "7.8 GiB"
    assert rows["CPU"] == "Example CPU @ 2.10GHz"
    assert rows["Python"] == "CPython 3.11.2"
    assert rows["OS"] == "Linux-6.1-x86_64"
    assert rows["load average at start"] == "0.42 (1 min), 0.80 (5 min), 1.25 (15 min)"
    assert rows["written"] == "2026-12-03 16:40 UTC"
    assert text.split("## Figures\n\n", 1)[1] == BODY


def test_a_dirty_tree_and_unknowns_are_said() -> None:
    text = rendered(commit=Commit("abc", True), load_at_start=None)
    rows = header(text)
    assert rows["commit"] == "`abc` (dirty: uncommitted changes)"
    assert rows["load average at start"] == "unknown"
    unknown = header(rendered(commit=Commit("unknown", None)))
    assert unknown["commit"] == "`unknown` (dirty: unknown)"


def test_a_pipe_in_a_value_does_not_break_the_table() -> None:
    text = rendered(machine=Machine(2, None, "a|b", "CPython 3.11.2", "Linux"))
    assert "| CPU | a\\|b |" in text
    assert header(text)["memory"] == "unknown"


def test_the_file_is_dated_and_never_overwrites_an_earlier_one(tmp_path: Path) -> None:
    first = results.save_results("Bench MCP", "toolgate bench mcp", BODY, tmp_path, when=WHEN)
    second = results.save_results("Bench MCP", "toolgate bench mcp", BODY, tmp_path, when=WHEN)
    assert first == tmp_path / "2026-12-03-bench-mcp.md"
    assert second == tmp_path / "2026-12-03-bench-mcp-2.md"
    assert first.read_text().startswith("# Bench MCP: 2026-12-03")
    # The commit is this checkout's, the machine this one.
    rows = header(first.read_text())
    assert re.fullmatch(r"`[0-9a-f]{40}`( \(dirty: uncommitted changes\))?", rows["commit"])
    assert rows["cores"] != "unknown"


def test_the_default_place_is_docs_benchmarks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = results.save_results("audit-queries", "toolgate bench audit-queries", BODY, when=WHEN)
    assert path == Path("docs/benchmarks/2026-12-03-audit-queries.md")
    assert (tmp_path / path).exists()


def bench_args(**given: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("target", nargs="?", default="pipeline")
    parser.add_argument("--rate", type=float, default=None)
    parser.add_argument("--curve", action="store_true")
    parser.add_argument("--soak", type=int, default=None)
    results.add_save_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(given)
    return args


def test_the_file_is_named_after_the_bench() -> None:
    assert results.slug_of(bench_args()) == "pipeline"
    assert results.slug_of(bench_args(curve=True)) == "pipeline-curve"
    assert results.slug_of(bench_args(rate=20.0)) == "pipeline-open-loop"
    assert results.slug_of(bench_args(soak=300)) == "soak"
    for target in ("mcp", "audit-queries", "fairness", "soak"):
        assert results.slug_of(bench_args(target=target)) == target


def test_the_command_is_the_one_typed() -> None:
    argv = ["bench", "soak", "-n", "300", "--note", "a b"]
    assert results.command_line(argv, bench_args()) == "toolgate bench soak -n 300 --note 'a b'"


def test_save_keeps_what_a_bench_prints_and_the_load_before_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    loads = iter([(0.5, 0.5, 0.5), (9.0, 9.0, 9.0)])
    monkeypatch.setattr(results, "load_average", lambda: next(loads))
    monkeypatch.setattr("sys.argv", ["toolgate", "bench", "fairness", "--save"])

    def bench(args: argparse.Namespace) -> int:
        results.load_average()  # the run loads the machine: the file keeps the load before
        print("alone        1.00  2.00")
        return 0

    args = bench_args(target="fairness", save=True, save_dir=tmp_path)
    assert results.saving(bench)(args) == 0
    assert "alone        1.00  2.00" in capsys.readouterr().out  # still printed
    (path,) = tmp_path.iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-fairness\.md", path.name)
    text = path.read_text()
    assert header(text)["command"] == "`toolgate bench fairness --save`"
    assert header(text)["load average at start"].startswith("0.50 (1 min)")
    assert text.endswith("## Figures\n\n```\nalone        1.00  2.00\n```\n")


def test_save_takes_a_bench_s_own_markdown_and_nothing_of_a_failed_run(tmp_path: Path) -> None:
    def soak(args: argparse.Namespace) -> int:
        print("| check | result |")
        args.results_markdown = "| check | result |\n"
        return 0

    results.saving(soak)(bench_args(target="soak", save=True, save_dir=tmp_path))
    (path,) = tmp_path.iterdir()
    assert path.read_text().endswith("## Figures\n\n| check | result |\n")

    failed = tmp_path / "failed"
    assert results.saving(lambda args: 2)(bench_args(save=True, save_dir=failed)) == 2
    assert not failed.exists()


def test_without_save_nothing_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert results.saving(lambda args: 0)(bench_args()) == 0
    assert list(tmp_path.iterdir()) == []
