"""Line numbers for Cedar errors.

cedarpy's parse and validation errors name no location ("'=' is not a valid
operator in Cedar", "for policy `policy3`, ..."), so a bad bundle file would
be reported without a line. Cedar statements (policies, schema declarations)
end with `;`, so splitting a file at each `;` outside strings and comments
gives each statement's first line, and the Nth policy of a file is its Nth
statement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Statement:
    end: int  # offset just past its `;` (or the end of the text)
    line: int  # 1-based line of its first token


def split_statements(text: str) -> list[Statement]:
    statements: list[Statement] = []
    line, start_line = 1, 0
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
            start_line = start_line or line
            if char == '"':
                in_string = True
            elif char == ";":
                statements.append(Statement(end=index + 1, line=start_line))
                start_line = 0
        index += 1
    if start_line:
        statements.append(Statement(end=len(text), line=start_line))
    return statements


def line_of_error(text: str, parse: Callable[[str], object], message: str) -> int:
    """The first line of the first statement whose prefix of `text` fails with `message`.

    A truncated statement fails with another message ("unexpected end of
    input"), so the prefix that first reproduces the whole text's error ends
    with the statement that causes it.
    """
    statements = split_statements(text)
    for statement in statements:
        try:
            parse(text[: statement.end])
        except ValueError as exc:
            if str(exc) == message:
                return statement.line
    return statements[-1].line if statements else 1
