"""The plain nats-py example (docs/identities.md) when the result is live before it is stored.

NATS hands a published message to core subscribers and to the stream that
captures it at once; the stream stores it a moment later. So a direct get
made as soon as the live result arrived can answer 404 (no message): the
example printed False once. Here the example runs against a stand-in for
nats-py whose first direct get answers exactly that, deterministically.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.docs.readme import all_blocks
from tests.harness import REPO_ROOT

RESULT = b'{"call_id":"call_02","ok":true,"status":"ok","data":{"items":[]},"error":null}'


class Reply:
    def __init__(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        self.data = data
        self.headers = headers


class Subscription:
    async def next_msg(self, timeout: float = 1.0) -> Reply:
        return Reply(RESULT, {"Nats-Msg-Id": "attacher/call_02"})


class NotStoredYet:
    """A connection whose first direct gets come before the stream stored the result."""

    def __init__(self, misses: int) -> None:
        self.misses = misses
        self.direct_gets = 0

    async def subscribe(self, subject: str) -> Subscription:
        return Subscription()

    async def request(self, subject: str, payload: bytes, timeout: float = 0.5) -> Reply:
        if subject.startswith("toolgate.calls."):
            return Reply(b'{"stream":"TOOLGATE_CALLS","seq":7}')
        assert subject.startswith("$JS.API.DIRECT.GET.TOOLGATE_RESULTS."), subject
        self.direct_gets += 1
        if self.direct_gets <= self.misses:
            return Reply(b"", {"Status": "404", "Description": "Message Not Found"})
        return Reply(RESULT, {"Nats-Stream": "TOOLGATE_RESULTS", "Nats-Sequence": "9"})

    async def close(self) -> None:
        pass


def direct_get_example() -> tuple[str, str]:
    (block,) = [
        b
        for b in all_blocks(REPO_ROOT)
        if "$JS.API.DIRECT.GET" in b.text and b.language == "python"
    ]
    assert block.not_run is None
    return block.text, block.where


@pytest.mark.parametrize("misses", [0, 1, 3])
def test_the_example_prints_true_when_the_direct_get_comes_before_the_store(
    misses: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / ".toolgate").mkdir()
    (tmp_path / ".toolgate" / "context.json").write_text(json.dumps({"nats_url": "nats://x"}))
    monkeypatch.chdir(tmp_path)
    connection = NotStoredYet(misses)

    async def connect(url: str, **options: Any) -> NotStoredYet:
        return connection

    monkeypatch.setitem(sys.modules, "nats", types.SimpleNamespace(connect=connect))
    text, where = direct_get_example()
    exec(compile(text, where, "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == "True", printed
    assert connection.direct_gets == misses + 1
