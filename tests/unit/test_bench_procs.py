"""The bench's CPU accounting: /proc readings of named processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from toolgate.bench import procs

pytestmark = pytest.mark.skipif(not procs.available(), reason="reads /proc")


def burn(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_a_process_cpu_grows_by_what_it_burns() -> None:
    watched = procs.Processes()
    watched.add("me", os.getpid(), with_children=False)
    before = watched.snapshot()
    burn(0.2)
    used = procs.delta(before, watched.snapshot())["me"]
    assert 0.15 <= used <= 1.0


def test_children_count_unless_told_not_to() -> None:
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time\nend = time.process_time() + 0.3\n"
            "while time.process_time() < end: pass\n"
            "time.sleep(30)",
        ]
    )
    try:
        watched = procs.Processes()
        watched.add("tree", os.getpid())
        watched.add("alone", os.getpid(), with_children=False)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            now = watched.snapshot()
            if now["tree"] - now["alone"] >= 0.25:
                break
            time.sleep(0.05)
        assert now["tree"] - now["alone"] >= 0.25
    finally:
        child.kill()
        child.wait()


def test_a_delta_never_goes_negative_and_names_what_it_was_given() -> None:
    assert procs.delta({"a": 2.0}, {"a": 1.0, "b": 3.0}) == {"a": 0.0, "b": 0.0}
