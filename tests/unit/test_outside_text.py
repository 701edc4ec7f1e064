"""The one way toolgate shows outside text to a person: controls and bidi as escapes."""

from __future__ import annotations

import io
import json
import logging

import pytest

from toolgate.runtime.outside_text import VisibleLogFormatter, visible, visible_json
from toolgate.services.audit.sql_console import render

# What the red team set as a call's `user`: a title, a cleared screen, a red forged line.
PAYLOAD = "u\x1b]0;PWNED\x07\x1b[2J\x1b[31mapproved by security team\x1b[0m"
HIDDEN = ["\x1b", "\x07", "\x00", "\x7f", "\x85", "\x9b", "\u061c", "\u200e", "\u200f"] + [
    chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A))
]


def hidden_in(text: str) -> list[str]:
    return [ch for ch in HIDDEN if ch in text]


@pytest.mark.parametrize("ch", HIDDEN)
def test_controls_del_and_bidi_become_escapes(ch: str) -> None:
    assert visible(f"a{ch}b") == f"a\\u{ord(ch):04x}b"


def test_the_terminal_payload_is_shown_not_obeyed() -> None:
    shown = visible(PAYLOAD)
    assert hidden_in(shown) == []
    assert shown == (
        "u\\u001b]0;PWNED\\u0007\\u001b[2J\\u001b[31mapproved by security team\\u001b[0m"
    )


def test_a_typed_escape_cannot_pass_for_one_visible_wrote() -> None:
    # An agent writes the six characters `\u001b` itself: shown, they must not read
    # like the escape `visible` writes for a real ESC. Each backslash is doubled.
    typed = visible("\\u001b[31m")
    real = visible("\x1b[31m")
    assert typed == "\\\\u001b[31m" and real == "\\u001b[31m" and typed != real
    assert visible("C:\\tmp\\x") == "C:\\\\tmp\\\\x"
    # Unambiguous: the shown text decodes back to exactly one original.
    for original in ("\\u001b", "\x1b", "\\\x1b", "a\\\\b", "\\"):
        assert visible(original).encode().decode("unicode_escape") == original


def test_ordinary_text_is_left_alone() -> None:
    for text in ("u-alice", "证据 über café", "a b", "emoji 🙂"):
        assert visible(text) == text
    assert visible("one\ntwo") == "one\\u000atwo"
    assert visible("one\ntwo", keep_newlines=True) == "one\ntwo"


def test_json_stays_the_same_json_value() -> None:
    value = {"user": PAYLOAD, "bidi": "abc\u202edcba", "c1": "\x9b31m", "tag": "\U000e0041"}
    text = visible_json(value, indent=2)
    assert hidden_in(text) == [] and "\U000e0041" not in text
    assert json.loads(text) == value


def test_sql_output_in_every_format_hides_nothing_and_json_still_parses() -> None:
    rows = [(PAYLOAD, "x\u2066y\u2069")]
    for fmt in ("table", "csv", "json"):
        out = render(["user", "note"], rows, fmt)
        assert hidden_in(out) == [], fmt
        assert "\\u001b[31m" in out, fmt
    assert json.loads(render(["user", "note"], rows, "json")) == {
        "user": PAYLOAD,
        "note": "x\u2066y\u2069",
    }


def test_log_lines_escape_their_message_and_keep_their_format() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(VisibleLogFormatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("toolgate.test_outside_text")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("call by %s\nFAKE forged line", PAYLOAD)
    finally:
        logger.removeHandler(handler)
    line = stream.getvalue()
    assert line.count("\n") == 1 and line.startswith("WARNING call by u\\u001b]0;PWNED")
    assert hidden_in(line) == []
