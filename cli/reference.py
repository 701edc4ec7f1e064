"""The CLI reference page, written from the parser itself: every command and subcommand
of `toolgate`, its usage, and each argument with its help and default.

    python -m toolgate.cli.reference            write docs/reference/cli.md
    python -m toolgate.cli.reference --check    exit 1 if that file is not what the
                                                parser says now (tests/docs does this)

The page shows the defaults of a neutral machine: no TOOLGATE_* variables and no
`toolgate up` in the current folder (where one ran, several defaults are what it
recorded: `toolgate COMMAND --help` there says them).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from toolgate.runtime import settings as env

DEFAULT_OUT = Path("docs/reference/cli.md")
REGENERATE = "python -m toolgate.cli.reference"
# Written as-is outside code spans, these would turn into markup (Python-Markdown).
MARKUP = str.maketrans({**{c: "\\" + c for c in "\\*_[]#"}, "<": "&lt;", ">": "&gt;"})


def render() -> str:
    """The page, for the parser as it is now."""
    with _neutral():
        from toolgate.cli.main import full_parser

        parser = full_parser()
    lines = [
        "# CLI reference",
        "",
        f"<!-- Generated from the parser by `{REGENERATE}`: do not edit by hand. -->",
        "",
        "Every command of `toolgate`, with what `toolgate COMMAND --help` says. This page "
        f"is generated from the parser (`{REGENERATE}`) and a test fails when it is out "
        "of date.",
        "",
        "Defaults are shown as on a machine with no `TOOLGATE_*` variables and no "
        "`toolgate up` run in the current folder: where one ran, several defaults are "
        "what it recorded (NATS URL, creds, ClickHouse URL, registry), and "
        "`toolgate COMMAND --help` there shows them. Every command also takes `-h`, "
        "`--help`.",
        "",
        "```text",
        _usage(parser, "toolgate"),
        "```",
        "",
        *_description(parser, parser.description),
        "## Commands",
        "",
    ]
    for name, _sub, text in _subcommands(parser):
        lines.append(f"- `toolgate {name}`: {_prose(text)}")
    lines.append("")
    for name, sub, text in _subcommands(parser):
        lines += _command(sub, f"toolgate {name}", text, level=2)
    return "\n".join(lines).rstrip("\n") + "\n"


@contextlib.contextmanager
def _neutral() -> Iterator[None]:
    """No TOOLGATE_* variables and an empty current folder while the parser is built:
    its defaults are then the same on every machine."""
    saved = {name: value for name, value in os.environ.items() if name.startswith("TOOLGATE_")}
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as empty:
        for name in saved:
            del os.environ[name]
        os.chdir(empty)
        env.use_data_dir(None)
        try:
            yield
        finally:
            os.chdir(here)
            os.environ.update(saved)


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, Any, str]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, sub, helps.get(name, "")))
    return found


def _command(parser: argparse.ArgumentParser, path: str, text: str, level: int) -> list[str]:
    lines = [f"{'#' * min(level, 6)} {path}", ""]
    if text:
        lines += [_sentence(_prose(text)), ""]
    lines += _description(parser, parser.description)
    lines += ["```text", _usage(parser, path), "```", ""]
    arguments = [a for a in parser._actions if _shown(a)]
    arguments = [a for a in arguments if not isinstance(a, argparse._SubParsersAction)]
    positionals = [a for a in arguments if not a.option_strings]
    options = [a for a in arguments if a.option_strings]
    for title, group in (("Arguments", positionals), ("Options", options)):
        if group:
            lines += [f"{title}:", ""]
            lines += [_argument(a, parser.prog) for a in group]
            lines.append("")
    lines += _description(parser, parser.epilog)
    for name, sub, subtext in _subcommands(parser):
        lines += _command(sub, f"{path} {name}", subtext, level + 1)
    return lines


def _description(parser: argparse.ArgumentParser, text: str | None) -> list[str]:
    """A parser's description or epilog: as written when its formatter keeps the lines."""
    if not text or not text.strip():
        return []
    formatter = parser.formatter_class
    if isinstance(formatter, type) and issubclass(formatter, argparse.RawDescriptionHelpFormatter):
        return ["```text", textwrap.dedent(text).strip("\n"), "```", ""]
    return [_prose(text), ""]


def _shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)


def _usage(parser: argparse.ArgumentParser, path: str) -> str:
    """`toolgate CMD` with its required options, then [options], then its arguments."""
    required, optional, positionals = [], False, []
    for action in parser._actions:
        if not _shown(action):
            continue
        if isinstance(action, argparse._SubParsersAction):
            positionals += ["{" + ",".join(action.choices) + "}", "..."]
        elif not action.option_strings:
            positionals.append(_metavar(action))
        elif action.required:
            required.append(f"{action.option_strings[0]} {_metavar(action)}".strip())
        else:
            optional = True
    return " ".join([path, *required, *(["[options]"] if optional else []), *positionals])


def _metavar(action: argparse.Action) -> str:
    """What follows the option (nothing for a flag), or a positional's name."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        name = str(action.metavar)
    elif action.choices is not None:
        name = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        name = action.dest if not action.option_strings else action.dest.upper()
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs == "*":
        return f"[{name} ...]"
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    if isinstance(action.nargs, int):
        return " ".join([name] * action.nargs)
    return name


def _argument(action: argparse.Action, prog: str) -> str:
    if action.option_strings:
        metavar = _metavar(action)
        name = ", ".join(action.option_strings) + (f" {metavar}" if metavar else "")
    else:
        name = _metavar(action)
    said = [_prose(_expanded_help(action, prog))]
    choices = list(action.choices or []) if action.metavar is not None else []
    extra = bool(choices)  # the metavar hides them
    if said[0] and (extra or _default_worth_saying(action)) and not said[0].endswith("."):
        said[0] += "."
    if action.option_strings and action.required:
        said.insert(0, "(required)")
    if extra:
        said.append(f"One of: {', '.join(f'`{c}`' for c in choices)}.")
    if _default_worth_saying(action):
        said.append(f"Default: `{_default_text(action.default)}`.")
    text = " ".join(part for part in said if part)
    return f"- `{name}`: {text}" if text else f"- `{name}`"


def _expanded_help(action: argparse.Action, prog: str) -> str:
    """The help text as argparse prints it (its %(default)s, %(prog)s ... filled in)."""
    text = action.help or ""
    if "%" not in text:
        return text
    params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    for name, value in list(params.items()):
        if hasattr(value, "__name__"):
            params[name] = value.__name__
    return text % params


def _default_worth_saying(action: argparse.Action) -> bool:
    """A default the help text does not already say, and that says something."""
    if "%(default)" in (action.help or "") or not action.option_strings:
        return False
    if action.nargs == 0:  # a flag: off unless given
        return False
    return action.default not in (None, [], argparse.SUPPRESS, "")


def _default_text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(map(str, value))
    return str(value)


def _prose(text: str) -> str:
    """Help text as markdown: its `code spans` kept, everything else literal."""
    text = " ".join(text.split())
    parts = text.split("`")
    if len(parts) % 2 == 0:  # an unpaired backtick: no code spans at all
        return text.replace("`", "\\`").translate(MARKUP)
    return "`".join(p if i % 2 else p.translate(MARKUP) for i, p in enumerate(parts))


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith((".", "!", "?", ")")) else text + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m toolgate.cli.reference",
        description="Write the CLI reference page (markdown) from the parser.",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="the page to write (default %(default)s)"
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing: exit 1 if the page differs from what the parser says now",
    )
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        try:
            current = args.out.read_text(encoding="utf-8")
        except OSError:
            current = None
        if current != page:
            print(f"{args.out} is out of date: run {REGENERATE}", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(page, encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
