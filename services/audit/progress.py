"""Progress of a long operator command, as a line to stderr every couple of seconds.

    toolgate audit verify: 120000/480000 rows checked (25%), 4 s

Nothing is printed for work that ends within the first interval, so quick
commands stay quiet; once a line was printed, `finish` prints the last count.
The clock is injectable, so tests need no waiting.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TextIO, TypeVar

INTERVAL_S = 2.0

T = TypeVar("T")


class Progress:
    def __init__(
        self,
        prefix: str,
        unit: str,
        total: int | None = None,
        *,
        out: TextIO | None = None,
        interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.prefix, self.unit, self.total = prefix, unit, total
        self.out = out
        self.interval_s = INTERVAL_S if interval_s is None else interval_s
        self.clock = clock
        self.started = self.last = clock()
        self.done = 0
        self.lines = 0

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.maybe_report()

    def maybe_report(self) -> None:
        """Print the count if an interval passed since the start or the last line."""
        now = self.clock()
        if now - self.last >= self.interval_s:
            self.last = now
            self._print(now)

    def finish(self) -> None:
        """The final count, only if progress was shown at all."""
        if self.lines:
            self._print(self.clock())

    def line(self, now: float | None = None) -> str:
        elapsed = (self.clock() if now is None else now) - self.started
        if self.total:
            count = f"{self.done}/{self.total} {self.unit} ({100 * self.done // self.total}%)"
        else:
            count = f"{self.done} {self.unit}"
        return f"{self.prefix}: {count}, {elapsed:.0f} s"

    def _print(self, now: float) -> None:
        print(self.line(now), file=self.out or sys.stderr, flush=True)
        self.lines += 1

    def counted(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, advancing by one for each as it is taken."""
        for item in items:
            yield item
            self.advance()
