"""Naming the call on log lines never fails a message, however it is built."""

from __future__ import annotations

from toolgate.runtime.call_context import call_of_message


def test_a_nesting_bomb_names_no_call_instead_of_raising() -> None:
    bomb = b"[" * 1000 + b"]" * 1000
    data = b'{"call_id": "c1", "tool": "echo", "arguments": {"payload": ' + bomb + b"}}"
    assert call_of_message("toolgate.calls.acme.bot", data) is None


def test_a_call_on_its_subject_is_named_by_the_subject() -> None:
    data = b'{"call_id": "c1", "principal": {"tenant": "other", "agent": "x"}}'
    mark = call_of_message("toolgate.calls.acme.bot", data)
    assert mark is not None and (mark.call_id, mark.tenant, mark.agent) == ("c1", "acme", "bot")
