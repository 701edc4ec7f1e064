"""Where in a Cedar file an error is: its line and column.

cedarpy's parse and validation errors name no location ("'=' is not a valid
operator in Cedar", "for policy `policy3`, ..."): no offset, no span. Cedar
statements (policies, schema declarations) end with `;`, so splitting a file
at each `;` outside strings and comments gives each statement (the Nth
policy of a file is its Nth statement), and within the statement at fault
the error is found in two ways:

- a syntax error appears as soon as the parser has read the token at fault:
  the shortest prefix of the text, cut after a token, that fails with the
  same message ends with that token (a shorter one fails otherwise, mostly
  "unexpected end of input");
- an error Cedar finds only in a whole statement (an invalid operator or
  method, a type error against the schema) names what it is about
  (`` `riskk` ``, `'='`, "type: Strin"): the first token of the statement
  that spells it.

Else the statement's first token.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

END_OF_INPUT = "unexpected end of input"
# What an error message quotes: `name`, 'op'; or its last word after ": ".
_QUOTED = re.compile(r"`([^`]+)`|'([^']+)'")
_TRAILING_NAME = re.compile(r":\s*([A-Za-z_@][\w:@]*)\s*$")
_TWO_CHAR_TOKENS = ("::", "==", "!=", "<=", ">=", "&&", "||")


@dataclass(frozen=True)
class Statement:
    end: int  # offset just past its `;` (or the end of the text)
    line: int  # 1-based line of its first token
    start: int = 0  # offset of its first token


@dataclass(frozen=True)
class Location:
    line: int  # 1-based
    column: int  # 1-based, in characters

    def __str__(self) -> str:
        return f"{self.line}:{self.column}"


def split_statements(text: str) -> list[Statement]:
    statements: list[Statement] = []
    line, start_line, start = 1, 0, 0
    in_string = in_comment = escaped = False
    index = 0
    while index < len(text):
        char = text[index]
        if char == "\n":
            line += 1
            in_comment = False
        elif in_comment:
            pass
        elif in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif text.startswith("//", index):
            in_comment = True
        elif not char.isspace():
            if not start_line:
                start_line, start = line, index
            if char == '"':
                in_string = True
            elif char == ";":
                statements.append(Statement(end=index + 1, line=start_line, start=start))
                start_line = 0
        index += 1
    if start_line:
        statements.append(Statement(end=len(text), line=start_line, start=start))
    return statements


def tokens(text: str, start: int = 0, end: int | None = None) -> list[tuple[int, int]]:
    """(start, end) offsets of the tokens of text[start:end], comments left out. An
    unterminated string runs to `end`."""
    end = len(text) if end is None else end
    found: list[tuple[int, int]] = []
    index = start
    while index < end:
        char = text[index]
        if char.isspace():
            index += 1
            continue
        if text.startswith("//", index):
            newline = text.find("\n", index, end)
            index = end if newline < 0 else newline + 1
            continue
        first = index
        if char == '"':
            index += 1
            while index < end and text[index] != '"':
                index += 2 if text[index] == "\\" else 1
            index = min(index + 1, end)
        elif char.isalnum() or char == "_":
            while index < end and (text[index].isalnum() or text[index] == "_"):
                index += 1
        elif text.startswith(_TWO_CHAR_TOKENS, index):
            index += 2
        else:
            index += 1
        found.append((first, index))
    return found


def location_at(text: str, offset: int) -> Location:
    line_start = text.rfind("\n", 0, offset) + 1
    return Location(text.count("\n", 0, offset) + 1, offset - line_start + 1)


def named_in(message: str) -> list[str]:
    """What an error message names, in its order: its quoted parts, else its last word."""
    names = [a or b for a, b in _QUOTED.findall(message)]
    trailing = _TRAILING_NAME.search(message)
    return names or ([trailing.group(1)] if trailing else [])


def find_named(text: str, statement: Statement, message: str) -> Location | None:
    """The first token sequence of `statement` that spells a name the message quotes."""
    spans = tokens(text, statement.start, statement.end)
    words = [text[s:e] for s, e in spans]
    for name in named_in(message):
        wanted = [name[s:e] for s, e in tokens(name)]
        if not wanted:
            continue
        for index in range(len(words) - len(wanted) + 1):
            if words[index : index + len(wanted)] == wanted:
                return location_at(text, spans[index][0])
    return None


def error_location(text: str, parse: Callable[[str], object], message: str) -> Location:
    """Where the error `message` of `parse(text)` is (see the module's docstring)."""
    statements = split_statements(text)
    if not statements:
        return Location(1, 1)
    for statement in statements:
        if _fails_so(parse, text[: statement.end], message):
            return _within(text, statement, parse, message)
    return location_at(text, statements[-1].start)


def statement_error_location(text: str, statement: Statement, message: str) -> Location:
    """Where an error Cedar reports for a whole statement (validation) is within it."""
    return find_named(text, statement, message) or location_at(text, statement.start)


def _within(
    text: str, statement: Statement, parse: Callable[[str], object], message: str
) -> Location:
    spans = tokens(text, statement.start, statement.end)
    if message == END_OF_INPUT and spans:
        return location_at(text, spans[-1][1])  # just after what is there
    for start, end in spans[:-1]:  # the whole statement is known to fail so
        if _fails_so(parse, text[:end], message):
            return location_at(text, start)
    named = find_named(text, statement, message)
    if named is not None:
        return named
    if spans and text[spans[-1][0] : spans[-1][1]] != ";":
        return location_at(text, spans[-1][0])  # e.g. a string that never ends
    return location_at(text, statement.start)


def _fails_so(parse: Callable[[str], object], text: str, message: str) -> bool:
    try:
        parse(text)
    except ValueError as exc:
        return str(exc) == message
    return False
