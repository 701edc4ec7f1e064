"""CPU time of the processes a bench run involves, read from /proc (Linux only).

A process's CPU is utime + stime of /proc/<pid>/stat (all its threads) plus
that of its live descendants; a bench reads it before and after a measured
window and divides the difference by the calls of that window. Elsewhere
than Linux every reading is 0.0 and the figures say so.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

_PROC = Path("/proc")
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def available() -> bool:
    return (_PROC / "self" / "stat").exists()


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces)."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _own_cpu_s(pid: int) -> float:
    fields = _stat_fields(pid)
    if fields is None:
        return 0.0
    # After the name: state(0) ppid(1) ... utime(11) stime(12), in clock ticks.
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _tree_of(pid: int, tree: Mapping[int, list[int]]) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(tree.get(current, ()))
    return found


def cmdline(pid: int) -> list[str]:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    parts = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    # A service forked by the fork server (stack/forkserver.py) names itself with
    # setproctitle: its command as one string, words apart by spaces.
    return parts[0].split() if len(parts) == 1 else parts


@dataclass
class Processes:
    """Named processes whose CPU a bench accounts for, in the order they are printed."""

    pids: dict[str, int] = field(default_factory=dict)
    # Names counted without their descendants (this client: its children are the gateway).
    alone: set[str] = field(default_factory=set)

    def add(self, name: str, pid: int | None, *, with_children: bool = True) -> None:
        if pid is not None:
            self.pids[name] = pid
            if not with_children:
                self.alone.add(name)

    def remove(self, name: str) -> None:
        self.pids.pop(name, None)
        self.alone.discard(name)

    def snapshot(self) -> dict[str, float]:
        """CPU seconds used so far by each named process and its live descendants."""
        if not self.pids or not available():
            return {name: 0.0 for name in self.pids}
        tree = _children()
        return {
            name: sum(_own_cpu_s(p) for p in ([pid] if name in self.alone else _tree_of(pid, tree)))
            for name, pid in self.pids.items()
        }

    def rss_mb(self) -> dict[str, float]:
        """Resident memory (VmRSS) of each named process and its live descendants, in MiB."""
        if not self.pids or not available():
            return {name: 0.0 for name in self.pids}
        tree = _children()
        return {
            name: sum(map(_own_rss_kb, [pid] if name in self.alone else _tree_of(pid, tree))) / 1024
            for name, pid in self.pids.items()
        }


def _own_rss_kb(pid: int) -> int:
    try:
        lines = (_PROC / str(pid) / "status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """CPU seconds each process used between two snapshots (a process absent from one: 0)."""
    return {name: max(0.0, after[name] - before.get(name, after[name])) for name in after}


def of_stack(stack: object) -> Processes:
    """The processes of a private `toolgate.stack.supervisor.Stack`, plus this client."""
    found = Processes()
    for service in getattr(stack, "services", []):
        found.add(service.name, service.process.pid if service.process else None)
    nats = getattr(stack, "nats", None)
    if nats is not None and nats.process is not None:
        found.add("nats-server", nats.process.pid)
    clickhouse = getattr(stack, "clickhouse", None)
    if clickhouse is not None:
        found.add("clickhouse", clickhouse.pid)
    found.add("client", os.getpid(), with_children=False)
    return found


def of_running_gateway(nats_url: str, service_names: Iterable[str]) -> Processes:
    """The processes of a gateway already running on this machine (`toolgate up`).

    Services are found by their command line (`... serve NAME --nats-url URL`);
    nats-server and ClickHouse as children of the same parent (or of the fork
    server's parent), if they are.
    """
    found = Processes()
    if not available():
        return found
    names = set(service_names)
    parents: set[int] = set()
    tree = _children()
    for pid in sorted(p for children in tree.values() for p in children):
        argv = cmdline(pid)
        if "serve" not in argv or "--nats-url" not in argv:
            continue
        at = argv.index("serve")
        if at + 1 >= len(argv) or argv[at + 1] not in names:
            continue
        if argv[argv.index("--nats-url") + 1 :][:1] != [nats_url]:
            continue
        found.add(argv[at + 1], pid)
        fields = _stat_fields(pid)
        if fields is not None:  # its parent: `toolgate up`, or the fork server under it
            parents.add(int(fields[1]))
            above = _stat_fields(int(fields[1]))
            if above is not None:
                parents.add(int(above[1]))
    port = str(urlsplit(nats_url).port or "")
    for parent in parents:
        for pid in tree.get(parent, ()):
            text = shlex.join(cmdline(pid))
            if "nats-server" in text and f"-p {port}" in text:
                found.add("nats-server", pid)
            elif "clickhouse_server" in text:
                found.add("clickhouse", pid)
    found.add("client", os.getpid(), with_children=False)
    return found
