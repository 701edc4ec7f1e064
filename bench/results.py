"""A bench's figures as a dated results file: `docs/benchmarks/YYYY-MM-DD-<slug>.md`.

Figures belong in dated files that say how they were made, not in prose that
goes stale. Each file starts with a header: the command as run, the commit
of the code measured (and whether its tree had uncommitted changes), the
machine (cores, memory, CPU model, Python, OS) and the load average when
the run started (measured before it, by the caller: a run loads the
machine itself); then the figures, as markdown.

`toolgate bench ... --save` writes one (`--save-dir` elsewhere than
docs/benchmarks/ under the current directory): `saving(command)` wraps a
bench command, measures the load before it, copies what it prints to
stdout, and saves that as the figures (in a text block, as printed) unless
the bench left markdown of its own in `args.results_markdown` (the soak).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

DEFAULT_DIR = Path("docs/benchmarks")
_SLUG = re.compile(r"[^a-z0-9]+")
_HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Machine:
    cores: int | None
    memory_gib: float | None
    cpu_model: str
    python: str
    os: str


@dataclass(frozen=True)
class Commit:
    sha: str  # "unknown" outside a git checkout (an installed wheel)
    dirty: bool | None  # None: unknown


LoadAverage = tuple[float, float, float]


def load_average() -> LoadAverage | None:
    """The 1, 5 and 15 minute load averages, or None where the OS has none."""
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def machine() -> Machine:
    memory = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = int(line.split()[1]) / 1024 / 1024
                break
    except OSError:
        pass
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return Machine(
        cores=os.cpu_count(),
        memory_gib=memory,
        cpu_model=model or "unknown",
        python=f"{platform.python_implementation()} {platform.python_version()}",
        os=platform.platform(),
    )


def commit(where: Path = _HERE) -> Commit:
    """The commit of the code measured: the checkout this module is in."""

    def git(*argv: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(where), *argv],
                capture_output=True,
                text=True,
                timeout=10,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    if sha is None:
        return Commit("unknown", None)
    status = git("status", "--porcelain", "--untracked-files=no")
    return Commit(sha.strip(), None if status is None else bool(status.strip()))


def results_path(slug: str, out_dir: Path, day: dt.date) -> Path:
    """`out_dir/YYYY-MM-DD-<slug>.md`; a second run the same day: `...-<slug>-2.md`."""
    clean = _SLUG.sub("-", slug.lower()).strip("-") or "bench"
    path = out_dir / f"{day.isoformat()}-{clean}.md"
    number = 2
    while path.exists():
        path = out_dir / f"{day.isoformat()}-{clean}-{number}.md"
        number += 1
    return path


def _load_text(load: LoadAverage | None) -> str:
    if load is None:
        return "unknown"
    one, five, fifteen = load
    return f"{one:.2f} (1 min), {five:.2f} (5 min), {fifteen:.2f} (15 min)"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(
    slug: str,
    command: str,
    body_markdown: str,
    *,
    when: dt.datetime,
    machine: Machine,
    commit: Commit,
    load_at_start: LoadAverage | None,
) -> str:
    """The file's text: a title, the header table, then the figures as given."""
    dirty = {True: " (dirty: uncommitted changes)", False: "", None: " (dirty: unknown)"}
    memory = f"{machine.memory_gib:.1f} GiB" if machine.memory_gib is not None else "unknown"
    rows = [
        ("command", f"`{command}`"),
        ("commit", f"`{commit.sha}`{dirty[commit.dirty]}"),
        ("cores", str(machine.cores) if machine.cores is not None else "unknown"),
        ("memory", memory),
        ("CPU", machine.cpu_model),
        ("Python", machine.python),
        ("OS", machine.os),
        ("load average at start", _load_text(load_at_start)),
        ("written", when.strftime("%Y-%m-%d %H:%M UTC")),
    ]
    lines = [f"# {slug}: {when.date().isoformat()}", "", "| | |", "| --- | --- |"]
    lines += [f"| {name} | {_cell(value)} |" for name, value in rows]
    lines += ["", "## Figures", "", body_markdown.strip("\n"), ""]
    return "\n".join(lines)


def save_results(
    slug: str,
    command: str,
    body_markdown: str,
    out_dir: Path = DEFAULT_DIR,
    *,
    load_at_start: LoadAverage | None = None,
    when: dt.datetime | None = None,
) -> Path:
    """Write `out_dir/YYYY-MM-DD-<slug>.md` (never over an earlier file); return its path.

    `load_at_start`: the load average measured before the run (None: unknown).
    """
    when = when or dt.datetime.now(dt.UTC)
    text = render(
        slug,
        command,
        body_markdown,
        when=when,
        machine=machine(),
        commit=commit(),
        load_at_start=load_at_start,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = results_path(slug, out_dir, when.date())
    path.write_text(text)
    return path


def text_block(printed: str) -> str:
    """Figures printed as aligned text, kept as printed (a fenced block)."""
    return "```\n" + printed.strip("\n") + "\n```"


# ---------------------------------------------------------------- `--save`


def add_save_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--save",
        action="store_true",
        help="also write the figures to a dated results file, "
        "DIR/YYYY-MM-DD-<bench>.md, with the command, commit, machine and load",
    )
    parser.add_argument(
        "--save-dir",
        type=Path,
        default=DEFAULT_DIR,
        metavar="DIR",
        help="where --save writes (default: %(default)s under the current directory)",
    )


def command_line(argv: Sequence[str], args: argparse.Namespace) -> str:
    """The command as run: `toolgate bench ...` from the process's argv."""
    words = list(argv)
    if "bench" in words:
        return shlex.join(["toolgate", *words[words.index("bench") :]])
    # Called in-process with an argv of its own: what was parsed, not what was typed.
    given = {k: v for k, v in sorted(vars(args).items()) if k not in ("func", "command")}
    return f"toolgate bench (in-process: {given})"


def slug_of(args: argparse.Namespace) -> str:
    target = getattr(args, "target", None) or "pipeline"
    if target == "pipeline":
        if getattr(args, "soak", None):
            return "soak"
        if getattr(args, "curve", False):
            return "pipeline-curve"
        if getattr(args, "rate", None):
            return "pipeline-open-loop"
    return str(target)


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, out: TextIO) -> None:
        self.out, self.copy = out, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()


def saving(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`command`, and with `--save` its figures in a dated results file (when it succeeds)."""

    def run(args: argparse.Namespace) -> int:
        if not getattr(args, "save", False):
            return command(args)
        load = load_average()
        tee = _Tee(sys.stdout)
        with contextlib.redirect_stdout(tee):
            code = command(args)
        if code != 0:
            return code
        body = getattr(args, "results_markdown", None) or text_block(tee.copy.getvalue())
        path = save_results(
            slug_of(args),
            command_line(sys.argv[1:], args),
            body,
            args.save_dir,
            load_at_start=load,
        )
        print(f"saved: {path}", file=sys.stderr)
        return code

    return run
