"""One gateway per data dir: the claim `toolgate up` holds, and what a second one sees."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from toolgate.cli.main import data_dir_given
from toolgate.stack.gateway_lock import GatewayRunning, claim_data_dir, release, running_gateway


def test_a_claimed_data_dir_names_its_holder_until_released(tmp_path: Path) -> None:
    assert running_gateway(tmp_path) is None
    held = claim_data_dir(tmp_path)
    assert running_gateway(tmp_path) == os.getpid()
    with pytest.raises(GatewayRunning, match=rf"already runs in {tmp_path} \(pid {os.getpid()}\)"):
        claim_data_dir(tmp_path)
    release(held)
    assert running_gateway(tmp_path) is None


def test_a_gateway_killed_with_sigkill_leaves_no_claim(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, pathlib; from toolgate.stack.gateway_lock import claim_data_dir; "
            f"claim_data_dir(pathlib.Path({str(tmp_path)!r})); print('held', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    assert running_gateway(tmp_path) == holder.pid
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    assert running_gateway(tmp_path) is None  # the pid file is still there; the lock is not
    release(claim_data_dir(tmp_path))


@pytest.mark.parametrize(
    ("argv", "found"),
    [
        (["call", "echo", "{}"], None),
        (["call", "echo", "{}", "--data-dir", "d1"], Path("d1")),
        (["agents", "add", "t", "a", "--data-dir=d2"], Path("d2")),
        (["status", "--data-dir", "d1", "--data-dir", "d3"], Path("d3")),  # the last, as argparse
        (["call", "echo", "--", "--data-dir", "d4"], None),
    ],
)
def test_the_data_dir_of_a_command_line_is_read_before_its_defaults(
    argv: list[str], found: Path | None
) -> None:
    assert data_dir_given(argv) == found
