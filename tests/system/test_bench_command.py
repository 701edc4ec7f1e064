"""`toolgate bench` runs end to end and prints its figure lines.

Only that the command works is asserted: the lines and their shape, never a
time, a rate or a ratio (CI machines are shared; the figures are for people).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from toolgate.stack.processes import free_port

pytestmark = pytest.mark.system

# A figure, or "-" for none; an "adds" figure is a difference, which noise can make negative.
NUMBER = r"\s+(?:-?\d+(?:\.\d+)?|-)"
SERVICES = ("validator", "policy", "executor", "attacher", "approvals", "audit")


def bench(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # A folder of its own, and no TOOLGATE_* variables: the bench starts a private gateway.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli.main", "bench", *flags],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def assert_line(out: str, label: str, numbers: int) -> None:
    pattern = rf"^\s*{re.escape(label)}" + NUMBER * numbers + r"x?"
    assert re.search(pattern, out, re.MULTILINE), (
        f"no `{label}` line with {numbers} figures:\n{out}"
    )


def assert_cpu_table(out: str, columns: int, extra: tuple[str, ...] = ()) -> None:
    for name in (*SERVICES, "nats-server", "clickhouse", "client", *extra, "total", "cores busy"):
        assert_line(out, name, columns)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU is read from /proc")
def test_bench_prints_clients_floor_ratios_and_cpu(tmp_path: Path) -> None:
    done = bench(tmp_path, "-n", "20", "--burst", "50")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("toolgate bench: 20 sequential calls, burst of 50")
    for label in ("client (nats-py)", "GatewayClient", "floor (raw, 4 hops)"):
        assert_line(out, label, 3)
    for label in ("client / floor", "GatewayClient / floor", "GatewayClient / client"):
        assert re.search(rf"^{re.escape(label)}(\s+\d+\.\d+x){{3}}$", out, re.MULTILINE), out
    assert_cpu_table(out, 6, extra=("floor hops",))
    assert "warning" not in out  # every call ended ok
    assert ".. " in done.stderr  # progress while it runs


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU is read from /proc")
def test_bench_curve_holds_open_loop_rates(tmp_path: Path) -> None:
    done = bench(tmp_path, "--curve", "--burst", "50", "--duration", "1")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^curve\s+max burst \d+ calls/s", out, re.MULTILINE), out
    for load in ("25%", "50%", "75%", "90%"):
        assert_line(out, load, 9)
    assert_cpu_table(out, 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU is read from /proc")
def test_bench_rate_holds_one_open_loop_rate(tmp_path: Path) -> None:
    done = bench(tmp_path, "--rate", "20", "--duration", "1", "--save", "--save-dir", "out")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^open loop\s+20 calls/s for 1 s \(20 calls", out, re.MULTILINE), out
    # --save: what it printed, as printed, in a dated file under the command as run.
    (saved,) = (tmp_path / "out").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-pipeline-open-loop\.md", saved.name)
    text = saved.read_text()
    assert "| command | `toolgate bench --rate 20 --duration 1 --save --save-dir out` |" in text
    assert text.endswith("## Figures\n\n```\n" + out.strip("\n") + "\n```\n")
    assert f"saved: out/{saved.name}" in done.stderr
    assert re.search(
        r"^latency ms\s+p50" + NUMBER + r"\s+p90" + NUMBER + r"\s+p99" + NUMBER, out, re.MULTILINE
    ), out
    assert re.search(r"^throughput\s+\d+ calls/s done; 0 lost", out, re.MULTILINE), out
    assert_cpu_table(out, 1)


def checks(markdown: str) -> dict[str, str]:
    """The soak's verdict table: check -> result."""
    table = markdown.split("| check | result |\n| --- | --- |\n", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip("| ").split(" | ", 1) for line in table.splitlines()]
    return {name: result for name, result in rows}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS and CPU are read from /proc")
def test_bench_soak_reports_calls_memory_of_every_process_and_consumers_and_saves_it(
    tmp_path: Path,
) -> None:
    done = bench(tmp_path, "soak", "-n", "100", "--rate", "100", "--save")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("## Soak: 100 calls at 100 calls/s\n"), out
    verdicts = checks(out)
    assert verdicts["every call answered"] == (
        "yes: 100 of 100 (100 ok, 0 not ok, 0 lost, 0 errors)"
    ), out
    assert verdicts["no consumer behind at the end"].startswith("yes: all caught up"), out
    for name in (
        "memory flat after warm-up (each gateway process)",
        "first and last 10 calls within 20%",
        "nats-server's memory levels off",
    ):
        assert re.fullmatch(r"(yes|no)\b.*", verdicts[name]), (name, out)
    # Latency slices of the run's calls: first and last tenth, and all.
    for label, calls in (("first 10", 10), ("last 10", 10), ("all", 100)):
        assert re.search(
            rf"^\| {label} \| {calls} \| {calls} \|" + r"( \d+\.\d\d \|){3}$", out, re.MULTILINE
        ), (label, out)
    # A memory row for every process of the gateway: warm-up end, end, slope, growth, CPU.
    for name in (*SERVICES, "nats-server", "clickhouse", "client \\(this bench\\)"):
        assert re.search(
            rf"^\| {name} \| \d+\.\d \| \d+\.\d \| [+-]\d+\.\d\d \| [+-]\d+\.\d "
            r"\| (yes|no) \| \d+\.\d\d \|$",
            out,
            re.MULTILINE,
        ), (name, out)
    # nats-server over time; its last sample is when the calls have ended.
    over_time = re.findall(r"^\| \d+\.\d \| (\d+) \| \d+\.\d \| \d+ \| \d+ \|$", out, re.MULTILINE)
    assert len(over_time) >= 2 and over_time[-1] == "100", out
    # Every consumer of the pipeline, at the end and caught up.
    for stream, consumer in (
        ("TOOLGATE_CALLS", "validator"),
        ("TOOLGATE_EVENTS", "policy"),
        ("TOOLGATE_EVENTS", "executor-echo"),
        ("TOOLGATE_EVENTS", "audit"),
    ):
        assert re.search(
            rf"^\| {stream} \| {consumer} \| \d+ \| \d+ \| 0 \| 0 \|$", out, re.MULTILINE
        ), (consumer, out)
    assert "### Errors\n\nNone." in out
    # --save: the same figures in a dated file, under the command as run.
    (saved,) = (tmp_path / "docs" / "benchmarks").iterdir()
    assert re.fullmatch(r"\d{4}-\d\d-\d\d-soak\.md", saved.name)
    text = saved.read_text()
    assert "| command | `toolgate bench soak -n 100 --rate 100 --save` |" in text
    assert re.search(r"^\| commit \| `[0-9a-f]{40}`", text, re.MULTILINE), text
    assert re.search(r"^\| load average at start \| \d+\.\d\d \(1 min\)", text, re.MULTILINE)
    assert text.endswith("## Figures\n\n" + out)


def test_bench_soak_says_in_one_line_when_the_gateway_is_not_there(tmp_path: Path) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    done = bench(tmp_path, "soak", "-n", "10", "--nats-url", url)
    assert done.returncode == 3, (done.stdout, done.stderr)
    assert f"no NATS at {url}" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""


def test_bench_refuses_nonsense_before_starting_anything(tmp_path: Path) -> None:
    for flags in (
        ["--rate", "0"],
        ["--rate", "10", "--curve"],
        ["--rounds", "0"],
        ["--soak", "0"],
        ["--soak", "10", "--curve"],
        ["soak", "-n", "0"],
        ["soak", "--rate", "0"],
        ["soak", "--curve"],
    ):
        done = bench(tmp_path, *flags)
        assert done.returncode == 2, (flags, done.stdout, done.stderr)
        assert not (tmp_path / ".toolgate").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU is read from /proc")
def test_bench_mcp_prints_every_way_what_it_adds_and_cpu(tmp_path: Path) -> None:
    done = bench(tmp_path, "mcp", "-n", "10")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for label in ("SDK client 2026-07-28", "SDK client 2025-11-25", "plain POST 2026-07-28"):
        assert_line(out, label, 8)  # calls, p50, p99, adds p50, adds p99, three CPU figures
    assert_line(out, "NATS (GatewayClient)", 6)
    for transport in ("stdio", "HTTP"):  # an upstream MCP server: direct, and via the gateway
        assert_line(out, f"upstream {transport}, direct", 6)
        assert_line(out, f"upstream {transport}, gateway", 6)
        assert f"upstream {transport.lower()}: the gateway adds " in out
    assert re.search(r"^\S.*\s10\s", out.splitlines()[2]), out  # ten calls each way
    assert ".. 10/10 calls each way" in done.stderr


def test_bench_fairness_prints_the_other_agents_latency_alone_and_during_a_burst(
    tmp_path: Path,
) -> None:
    done = bench(tmp_path, "fairness", "-n", "5", "--burst", "40")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("toolgate bench fairness: agent bench-b.steady, 5 calls alone")
    assert_line(out, "alone", 4)
    assert_line(out, "during A's burst", 4)
    assert re.search(r"^agent A's burst alone\s+40 calls in [\d.]+ s", out, re.MULTILINE), out
    assert re.search(r"^agent A's burst with B 40 calls in [\d.]+ s", out, re.MULTILINE), out
    assert "warning" not in out
