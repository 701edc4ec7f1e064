"""Ctrl-C on `toolgate up` asks every service to stop at once: stopping takes as long as
the slowest service, not the sum of them all (each one finishes what it holds on its own).

The services here are small processes that, on SIGTERM, wait until every one of them has
been asked before they exit: stopped one after another, the first would wait for the
others until the supervisor's patience ran out and it was killed."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from toolgate.stack.processes import stop_processes
from toolgate.stack.supervisor import ServiceProcess, Stack

WAITS_FOR_THE_OTHERS = """
import pathlib, signal, sys, time
asked, name, count = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])

def on_sigterm(*_):
    (asked / name).touch()
    while len(list(asked.iterdir())) < count:
        time.sleep(0.02)
    sys.exit(0)

signal.signal(signal.SIGTERM, on_sigterm)
(asked.parent / ("listening-" + name)).touch()
while True:
    time.sleep(1)
"""


def services(tmp_path: Path, count: int) -> list[ServiceProcess]:
    asked = tmp_path / "asked"
    asked.mkdir()
    started = [
        ServiceProcess(
            f"s{number}",
            [sys.executable, "-c", WAITS_FOR_THE_OTHERS, str(asked), f"s{number}", str(count)],
            tmp_path / "logs" / f"s{number}.log",
        )
        for number in range(count)
    ]
    for service in started:
        service.start()
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("listening-*"))) < count:  # their SIGTERM handlers are set
        assert time.monotonic() < deadline, "the test services never started"
        time.sleep(0.05)
    return started


def exit_codes(started: list[ServiceProcess]) -> list[int | None]:
    return [s.process.returncode if s.process else None for s in started]


def test_a_stack_asks_every_service_to_stop_before_waiting_for_any(tmp_path: Path) -> None:
    stack = Stack(data_dir=tmp_path / "data")
    stack.services = services(tmp_path, 4)
    stack.stop()
    assert exit_codes(stack.services) == [0, 0, 0, 0]  # each exited by itself, none killed


def test_stop_processes_kills_one_that_will_not_stop(tmp_path: Path) -> None:
    started = services(tmp_path, 3)  # the third is never asked: the other two wait for it
    stop_processes([s.process for s in started[:2]], timeout=0.5)
    assert exit_codes(started[:2]) == [-9, -9]
    stop_processes([started[2].process], timeout=30)  # asked last, it finds all asked
    assert exit_codes(started) == [-9, -9, 0]
