"""Naming the call on log lines never fails a message, however it is built."""

from __future__ import annotations

import asyncio
import logging

from toolgate.runtime import call_context
from toolgate.runtime.call_context import call_of_message


def test_a_nesting_bomb_names_no_call_instead_of_raising() -> None:
    bomb = b"[" * 1000 + b"]" * 1000
    data = b'{"call_id": "c1", "tool": "echo", "arguments": {"payload": ' + bomb + b"}}"
    assert call_of_message("toolgate.calls.acme.bot", data) is None


def test_a_call_on_its_subject_is_named_by_the_subject() -> None:
    data = b'{"call_id": "c1", "principal": {"tenant": "other", "agent": "x"}}'
    mark = call_of_message("toolgate.calls.acme.bot", data)
    assert mark is not None and (mark.call_id, mark.tenant, mark.agent) == ("c1", "acme", "bot")


def test_a_handled_message_is_read_only_when_a_line_is_logged(monkeypatch) -> None:
    """The call a message names is decoded at the first line logged about it, once, not
    for every message handled (most log nothing)."""
    reads: list[bytes] = []
    real = call_context.call_of_message

    def counted(subject: str, data: bytes) -> call_context.CallMark | None:
        reads.append(data)
        return real(subject, data)

    monkeypatch.setattr(call_context, "call_of_message", counted)
    data = b'{"call_id": "c1", "principal": {"tenant": "acme", "agent": "bot"}}'

    async def handle() -> tuple[int, logging.LogRecord]:
        call_context.handling_message("toolgate.evt.CallAuthorized.echo", data)
        unread = len(reads)
        record = logging.LogRecord("t", logging.INFO, __file__, 1, "hello", None, None)
        call_context.CallLogFilter().filter(record)
        call_context.CallLogFilter().filter(record)
        return unread, record

    unread, record = asyncio.run(handle())
    assert unread == 0 and len(reads) == 1
    assert record.__dict__["call"] == "tenant=acme agent=bot call_id=c1 "
