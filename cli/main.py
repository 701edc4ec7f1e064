"""The `toolgate` command: parse, build a contract, call the library.

    toolgate up [--example NAME]       the whole gateway on the embedded default
    toolgate serve NAME                one service (validator|policy|executor|attacher|
                                       approvals|notifier|audit)
    toolgate agents add|list|revoke    one NATS identity per agent of each tenant
    toolgate call TOOL 'JSON-ARGS'     publish one call, print its ToolResult
    toolgate result CALL_ID            fetch a stored result again
    toolgate approvals list|show|approve|deny|add-approver|inbox   humans decide
    toolgate policy check|push|rollback|test   Cedar policy bundles
    toolgate audit trace|sql|replay|verify   the audit trail in ClickHouse
    toolgate schema                    JSON Schema of the wire contract
    toolgate bench [pipeline|policy|audit|audit-queries|fairness]   figures, printed

After `toolgate up` in a folder, every command there finds the gateway through
.toolgate/context.json; from elsewhere, --data-dir DIR (or $TOOLGATE_DATA_DIR)
names the folder whose context.json every command uses; flags and TOOLGATE_*
variables win over it.
Exit codes: 0 done (for `call`: result ok), 1 a clear failure (for `call`: the
result is an error), 2 bad input or configuration (a bad flag, port, call_id
or URL, a missing data dir, registry or creds file, a gateway already running
on the data dir), 3 could not reach, tell or wait for the gateway (no NATS or
ClickHouse there, creds refused, a running server not told: --offline writes
files alone, no result in time). A failure is one
line on stderr: what was tried and what to do. Services (`serve`, `up`) keep
reconnecting to NATS for as long as they run.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from pathlib import Path

from toolgate.cli import (
    agents,
    approvals,
    audit,
    bench,
    calls,
    mcp,
    policy,
    schema,
    serve,
    status,
    up,
)

# What every command shares (cli/common.py), importable from here as before the split.
from toolgate.cli.common import CONNECT_TIMEOUT_S as CONNECT_TIMEOUT_S
from toolgate.cli.common import Failed
from toolgate.cli.common import check_call_id as check_call_id
from toolgate.cli.common import check_creds as check_creds
from toolgate.cli.common import check_nats_url as check_nats_url
from toolgate.cli.common import check_port as check_port
from toolgate.cli.common import connect_failure as connect_failure
from toolgate.cli.common import connect_nats as connect_nats
from toolgate.contracts.registry import RegistryError
from toolgate.runtime import settings as env
from toolgate.runtime.creds import CredentialsError
from toolgate.runtime.outside_text import visible


def build_parser() -> argparse.ArgumentParser:
    """The whole command line: each command group adds its parsers and handlers
    (`register(commands)` in its module), in the order `toolgate --help` lists them."""
    parser = argparse.ArgumentParser(
        prog="toolgate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up.register(commands)
    serve.register(commands)
    audit.register(commands)
    status.register(commands)
    approvals.register(commands)
    policy.register(commands)
    agents.register(commands)
    mcp.register(commands)
    calls.register(commands)
    schema.register(commands)
    bench.register(commands)
    return parser


def full_parser() -> argparse.ArgumentParser:
    """The parser `toolgate` runs: every command group, each command with --data-dir."""
    parser = build_parser()
    _add_data_dir_everywhere(parser)
    return parser


def data_dir_given(argv: list[str]) -> Path | None:
    """The `--data-dir` of a command line (the last one, as argparse takes it), or None.

    Read before the parser is built: its defaults (NATS URL, creds, ClickHouse URL,
    registry) come from that folder's context.json, whichever command it is."""
    given: str | None = None
    for i, word in enumerate(argv):
        if word == "--":
            break
        if word == "--data-dir" and i + 1 < len(argv):
            given = argv[i + 1]
        elif word.startswith("--data-dir="):
            given = word.partition("=")[2]
    return Path(given) if given else None


def _add_data_dir_everywhere(parser: argparse.ArgumentParser) -> None:
    """Every command takes --data-dir: the folder whose context.json it reads (main()
    reads it before the defaults); commands that keep state there declare it themselves."""
    subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if subcommands:
        for command in subcommands[0].choices.values():
            _add_data_dir_everywhere(command)
    elif "--data-dir" not in parser._option_string_actions:
        parser.add_argument(
            "--data-dir",
            type=Path,
            default=env.env_data_dir(),
            help="the folder where `toolgate up` ran, whose context.json (NATS URL, "
            "creds) this command uses (default: $TOOLGATE_DATA_DIR, else %(default)s)",
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env.use_data_dir(data_dir_given(argv))  # before any default is read from the context
    try:
        return _run(argv)
    finally:
        # A command's --data-dir ends with it (main() is also called in-process, by
        # tests and by embedding programs: the next caller starts from the default).
        env.use_data_dir(None)


def _run(argv: list[str]) -> int:
    args = full_parser().parse_args(argv)
    if args.command not in ("serve", "up"):
        # One-shot commands say what went wrong in one line: no nats-py tracebacks.
        logging.getLogger("nats").addHandler(logging.NullHandler())
        logging.getLogger("nats").propagate = False
    try:
        return int(args.func(args))
    except Failed as exc:
        print(visible(str(exc), keep_newlines=True), file=sys.stderr)
        return exc.code
    except RegistryError as exc:
        print(f"toolgate: registry error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except CredentialsError as exc:
        print(f"toolgate: {exc} (--creds)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `toolgate ... | head`: the reader had enough
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # no flush error at exit
        return 141
    except Exception as exc:  # a bug, or a failure nobody foresaw: still one line
        if os.environ.get("TOOLGATE_DEBUG"):
            raise
        print(
            f"toolgate {args.command}: unexpected {type(exc).__name__}: {_one_line(exc)} "
            "(TOOLGATE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _one_line(exc: BaseException) -> str:
    return visible(" ".join(str(exc).split())) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
