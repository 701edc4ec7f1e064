"""Text that came from outside, shown to a person as data and never as orders.

User names, tool arguments, results and error messages come from agents, models and
upstream servers. Printed as they are, their control characters drive the reader's
terminal (ANSI/OSC escapes set the title, clear the screen, colour a forged line) and
bidi overrides make a line read differently than it is. Every human-facing output
(CLI tables, `audit trace`, `audit sql`, `approvals`, the inbox, log lines) passes such
text through `visible` (or `visible_json` for JSON), the one way toolgate shows it:
C0 and C1 controls, DEL, format characters (bidi embeddings, overrides, isolates and
marks, zero-width characters), line and paragraph separators and private-use or lone
surrogate code points become `\\uXXXX` escapes, and a backslash itself becomes `\\\\`,
so every single backslash in what `visible` shows starts an escape it wrote: an agent
cannot type text (`\\u001b`) that reads like one.
"""

from __future__ import annotations

import json
import logging
import unicodedata
from typing import Any

# Cc: C0, DEL, C1. Cf: bidi controls (U+202A-202E, U+2066-2069, U+200E/F, U+061C) and
# the other invisible formatters. Zl/Zp: line breaks a terminal or log reader honours.
HIDDEN_CATEGORIES = frozenset(("Cc", "Cf", "Zl", "Zp", "Co", "Cs"))


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def _json_escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    code -= 0x10000  # JSON spells a code point beyond the BMP as a surrogate pair
    return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"


def _is_hidden(ch: str) -> bool:
    return unicodedata.category(ch) in HIDDEN_CATEGORIES


def visible(text: str, keep_newlines: bool = False) -> str:
    """`text` with every control, format and separator character as a `\\uXXXX` escape
    and each backslash doubled (newlines kept when `keep_newlines`, for multi-line
    blocks made by toolgate)."""
    # The common case: nothing hidden (isprintable is stricter) and nothing to double.
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(
        "\\\\"
        if ch == "\\"
        else _escape(ch)
        if _is_hidden(ch) and not (keep_newlines and ch == "\n")
        else ch
        for ch in text
    )


def visible_json(value: Any, indent: int | None = None, **options: Any) -> str:
    """`json.dumps(value, ensure_ascii=False)` with hidden characters written as JSON
    escapes: the same JSON value, readable, nothing in it that a terminal obeys."""
    text = json.dumps(value, ensure_ascii=False, indent=indent, **options)
    if text.isprintable():
        return text
    return "".join(_json_escape(ch) if ch != "\n" and _is_hidden(ch) else ch for ch in text)


class VisibleLogFormatter(logging.Formatter):
    """A log formatter that escapes each message (its arguments carry outside text): a
    message cannot forge a second line, move the cursor or reverse a line. Tracebacks,
    which toolgate's own code makes, keep their lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # logging's name
        shown = logging.makeLogRecord(record.__dict__)
        shown.message = visible(record.message)
        return super().formatMessage(shown)


class VisibleArgs(logging.Filter):
    """A filter that escapes a record's message and each of its string arguments in place,
    keeping their number and order: for loggers whose own formatters read the arguments
    (uvicorn's access log unpacks client, method, path, version and status), so whatever
    handler and formatter they have, the request path and a forwarded client address an
    outsider wrote are shown escaped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.args:  # a message with no arguments: it may quote anything
            if isinstance(record.msg, str):
                record.msg = visible(record.msg)
        elif isinstance(record.args, tuple):  # the format is the code's; the arguments not
            record.args = tuple(visible(a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.args, dict):
            record.args = {
                k: visible(v) if isinstance(v, str) else v for k, v in record.args.items()
            }
        return True


def escape_logger(name: str) -> None:
    """Escape outside text in every record logged on logger `name` (once per logger)."""
    logger = logging.getLogger(name)
    if not any(isinstance(f, VisibleArgs) for f in logger.filters):
        logger.addFilter(VisibleArgs())


def log_visibly(logger: logging.Logger | None = None) -> None:
    """Make every handler of `logger` (the root logger by default) escape its messages,
    keeping each handler's format."""
    for handler in (logger or logging.getLogger()).handlers:
        current = handler.formatter
        handler.setFormatter(
            VisibleLogFormatter(
                current._fmt if current else None,  # no public getter
                current.datefmt if current else None,
            )
        )
