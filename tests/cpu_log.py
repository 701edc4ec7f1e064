"""CPU per test file, for cutting the suite where its CPU is (issue #22).

With TOOLGATE_TEST_CPU_LOG=PATH, each test module appends one line to PATH when it
ends: its path, the CPU-seconds its worker and the worker's children (service
processes, nats-servers, CLI runs: all reaped by then) spent on it, and its wall
seconds. With addopts' `--dist loadfile` a worker runs one file at a time, so the
lines of a whole run add up to the run's CPU (less the workers' start):

    TOOLGATE_TEST_CPU_LOG=/tmp/cpu.tsv pytest -q
    sort -t$'\\t' -k2 -rn /tmp/cpu.tsv | head -20
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ENV = "TOOLGATE_TEST_CPU_LOG"


def cpu_seconds() -> float:
    """User + system CPU of this process and of its children reaped so far."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@contextmanager
def logged(name: str, log: str | None = None) -> Iterator[None]:
    """Append `name`, its CPU-s and wall-s to the log (ENV's, if not given) when done."""
    path = log if log is not None else os.environ.get(ENV)
    if not path:
        yield
        return
    cpu, wall = cpu_seconds(), time.monotonic()
    try:
        yield
    finally:
        line = f"{name}\t{cpu_seconds() - cpu:.2f}\t{time.monotonic() - wall:.1f}\n"
        with Path(path).open("a") as out:  # one short write per line: workers share it
            out.write(line)
