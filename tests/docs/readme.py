"""The code blocks of README.md and of every page under docs/, read as a reader
would run them (each page on its own, top to bottom, in a fresh folder).

A block is a fenced code block with its language and the heading it is under.
An HTML comment on the line just before the fence (invisible on the rendered
page) says how a test treats it:

    <!-- not-run: REASON -->                     not run (keep these rare)
    <!-- test: background, ready at "TEXT" -->   each command is a long-running
                                                 process of its own, as in a shell
                                                 of its own; the page goes on once
                                                 TEXT appears in its output
    <!-- test: output of the block above -->     this JSON is what the block above
    <!-- test: output of the background block --> (or the last background command)
                                                 printed ("..." matches anything)
    <!-- test: webhook payload -->               this JSON is an approval notification's
                                                 body: tests/docs/test_readme_notifications.py
                                                 checks it against the notifier's own
    <!-- test: file PATH -->                     this block is the content of the file
                                                 PATH (relative to the reader's folder),
                                                 which the reader saves before going on

Inside a shell block, a command's trailing comment may say what it does:
`# prints TEXT` (TEXT is in its stdout), or, for `toolgate call`, a status
first (`# ok: ...`, `# denied: ...`): the result has that status and the
command exits 0 for ok, 1 for any other. Any other command must exit 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from toolgate.contracts.calls import Status

FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*(not-run|test):\s*(.*?)\s*-->\s*$")
READY = re.compile(r'^background, ready at "([^"]+)"$')
OUTPUT = re.compile(r"^output of the (block above|background block)$")
FILE = re.compile(r"^file ([\w./-]+)$")
WEBHOOK_PAYLOAD = "webhook payload"
RUNNABLE = {"sh": "sh", "bash": "sh", "shell": "sh", "python": "python"}
CHECKED = {"json", "cedar", "yaml"}
# Results a `toolgate call` may end in, as a page's comment names them.
STATUSES = set(get_args(Status))


@dataclass
class Block:
    language: str
    text: str
    line: int  # of the opening fence, 1-based
    heading: str
    page: str = "README.md"  # the page's path in the repository
    not_run: str | None = None
    ready_at: str | None = None  # a background block
    output_of: str | None = None  # "block above" | "background block"
    webhook_payload: bool = False  # an approval notification's body (services/notifier)
    file: str | None = None  # the reader saves it as this file (relative path)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.heading})"


# Written by a program and checked against it (tests/docs/test_cli_reference.py): its
# blocks are usage lines, not examples.
GENERATED = ("reference/cli.md",)


def pages(root: Path) -> list[Path]:
    """README.md, then every page of the docs site, in path order (not generated ones)."""
    docs = root / "docs"
    written = [
        p for p in sorted(docs.rglob("*.md")) if p.relative_to(docs).as_posix() not in GENERATED
    ]
    return [root / "README.md", *written]


def page_name(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def all_blocks(root: Path) -> list[Block]:
    """Every page's blocks, README.md's first."""
    return [block for path in pages(root) for block in read_blocks(path, page_name(path, root))]


def read_blocks(path: Path, page: str | None = None) -> list[Block]:
    page = page or path.name
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    heading = ""
    index = 0
    while index < len(lines):
        line = lines[index]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        opening = FENCE.match(line)
        if not opening:
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise ValueError(f"{page}:{index + 1}: a code block is never closed")
        block = Block(
            opening.group(1), "\n".join(lines[index + 1 : end]) + "\n", index + 1, heading, page
        )
        directive = DIRECTIVE.match(lines[index - 1]) if index else None
        if directive:
            kind, value = directive.groups()
            if kind == "not-run":
                block.not_run = value or "(no reason given)"
            elif (ready := READY.match(value)) is not None:
                block.ready_at = ready.group(1)
            elif (output := OUTPUT.match(value)) is not None:
                block.output_of = output.group(1)
            elif value == WEBHOOK_PAYLOAD:
                block.webhook_payload = True
            elif (
                (file := FILE.match(value)) and ".." not in value and not value.startswith("file /")
            ):
                block.file = file.group(1)
            else:
                raise ValueError(f"{block.where}: unknown directive {lines[index - 1]!r}")
        blocks.append(block)
        index = end + 1
    return blocks


# ---------------------------------------------------------------- shell commands


@dataclass
class Command:
    text: str  # as it runs (continuations kept)
    comment: str = ""
    expect_status: str | None = None  # toolgate call: the result's status
    prints: str | None = None

    @property
    def expected_exit(self) -> int:
        if self.expect_status is not None:
            return 0 if self.expect_status == "ok" else 1
        return 0


def split_comment(line: str) -> tuple[str, str]:
    """(code, comment) of one shell line: a `#` outside quotes after a blank starts it."""
    quote = ""
    for position, char in enumerate(line):
        if quote:
            if char == quote:
                quote = ""
        elif char in "'\"":
            quote = char
        elif char == "#" and (position == 0 or line[position - 1].isspace()):
            return line[:position].rstrip(), line[position + 1 :].strip()
    return line.rstrip(), ""


def shell_commands(text: str) -> list[Command]:
    """The commands of a shell block, continuation lines joined, comment lines dropped."""
    commands: list[Command] = []
    pending: list[str] = []
    comments: list[str] = []
    for raw in text.splitlines():
        code, comment = split_comment(raw)
        if not code.strip() and not pending:
            continue  # a blank line or a comment of its own
        if comment:
            comments.append(comment)
        if code.endswith("\\"):
            pending.append(code)
            continue
        pending.append(code)
        commands.append(_command("\n".join(pending), " ".join(comments)))
        pending, comments = [], []
    if pending:
        raise ValueError(f"a continuation line ends the block: {pending[-1]!r}")
    return commands


def _command(text: str, comment: str) -> Command:
    command = Command(text=text, comment=comment)
    if comment.startswith("prints "):
        command.prints = comment.removeprefix("prints ").strip()
    word = re.split(r"[\s:]", comment, maxsplit=1)[0] if comment else ""
    if re.search(r"(^|\s|/)toolgate call\s", text) and word in STATUSES:
        command.expect_status = word
    return command


def python_prints(text: str) -> list[str]:
    """What a Python block says it prints: `# prints TEXT` at a line's end or alone."""
    return [
        line.split("# prints ", 1)[1].strip() for line in text.splitlines() if "# prints " in line
    ]


# ---------------------------------------------------------------- documented output


def matches(documented: Any, actual: Any) -> bool:
    """Whether `actual` is what the page shows: every key it shows, equal values;
    "..." stands for any value; a list ending in "..." may go on."""
    if documented == "...":
        return True
    if isinstance(documented, dict):
        return isinstance(actual, dict) and all(
            key in actual and matches(value, actual[key]) for key, value in documented.items()
        )
    if isinstance(documented, list):
        if not isinstance(actual, list):
            return False
        open_ended = bool(documented) and documented[-1] == "..."
        shown = documented[:-1] if open_ended else documented
        if len(actual) < len(shown) or (not open_ended and len(actual) != len(shown)):
            return False
        return all(matches(d, a) for d, a in zip(shown, actual, strict=False))
    return bool(documented == actual)


def json_documents(text: str) -> list[Any]:
    """Every JSON value in `text`, one after another (whitespace between them)."""
    decoder = json.JSONDecoder()
    found, position = [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return found
        value, position = decoder.raw_decode(text, position)
        found.append(value)
