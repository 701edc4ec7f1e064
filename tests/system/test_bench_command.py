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

pytestmark = pytest.mark.system

NUMBER = r"\s+(?:\d+(?:\.\d+)?|-)"
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
    done = bench(tmp_path, "--rate", "20", "--duration", "1")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^open loop\s+20 calls/s for 1 s \(20 calls", out, re.MULTILINE), out
    assert re.search(
        r"^latency ms\s+p50" + NUMBER + r"\s+p90" + NUMBER + r"\s+p99" + NUMBER, out, re.MULTILINE
    ), out
    assert re.search(r"^throughput\s+\d+ calls/s done; 0 lost", out, re.MULTILINE), out
    assert_cpu_table(out, 1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RSS and CPU are read from /proc")
def test_bench_soak_prints_slices_backlog_and_memory_of_every_process(tmp_path: Path) -> None:
    done = bench(tmp_path, "--soak", "40", "--rate", "20")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert re.search(r"^soak\s+40 calls open loop at 20 calls/s", out, re.MULTILINE), out
    for label in ("first 4", "last 4", "all"):
        assert_line(out, label, 5)  # p50 p90 p99 max, and how many were lost
    assert re.search(r"^backlog\s+messages not yet acked", out, re.MULTILINE), out
    assert re.search(r"^rss MiB", out, re.MULTILINE), out
    for name in (*SERVICES, "nats-server", "clickhouse", "client"):
        assert re.search(rf"^\s+{name}(\s+\d+\.\d+){{3}}\s+[+-]\d+\.\d+$", out, re.MULTILINE), out
    assert_cpu_table(out, 1)


def test_bench_refuses_nonsense_before_starting_anything(tmp_path: Path) -> None:
    for flags in (
        ["--rate", "0"],
        ["--rate", "10", "--curve"],
        ["--rounds", "0"],
        ["--soak", "0"],
        ["--soak", "10", "--curve"],
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
