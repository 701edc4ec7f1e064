"""The handler table's `emits` column says what the stages publish.

Statically: what each service's code makes and publishes is what its rows list,
no more and no less. At run time: a stage that publishes a message its row does
not list fails the message's work under TOOLGATE_STRICT_EMITS=1 (the system
tests' gateways run so: tests/harness.py), and only logs otherwise.
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from tests.harness import REPO_ROOT
from toolgate.contracts.calls import ErrorCode, Principal, ToolError
from toolgate.contracts.events import (
    CallAbandoned,
    CallDenied,
    Event,
    MessageDeadLettered,
    utc_now,
)
from toolgate.runtime import emits, publishing
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner
from toolgate.runtime.topology import GIVE_UP_EMITS, handlers

# What a service's code publishes that is not an event it constructs: the method it
# calls, and the message that goes out.
PUBLISHING_CALLS = {
    "publish_result": {"ToolResult"},
    "publish_pending": {"PendingNotice"},
    "answer_again": {"ToolResult", "PendingNotice"},
    "encode_job": {"Job"},
}
EVENT_NAMES = {kind.__name__ for kind in Event.__subclasses__()}


def published_by(package: Path) -> set[str]:
    """The messages a service's code makes: events it constructs, and what it publishes
    through the calls above."""
    found: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            if name in EVENT_NAMES:
                found.add(name)
            found |= PUBLISHING_CALLS.get(name, set())
    return found


def listed_by(service: str) -> set[str]:
    table = handlers(["<tool>"], with_audit=True)
    return {kind for h in table if h.service == service for kind in h.emits}


# The audit sink's rows too: a batch stage of the runner, it publishes nothing.
SERVICES = sorted({h.service for h in handlers(["<tool>"], with_audit=True)})


@pytest.mark.parametrize("service", SERVICES)
def test_a_service_publishes_what_its_rows_list(service: str) -> None:
    made = published_by(REPO_ROOT / "services" / service)
    listed = listed_by(service)
    assert made - listed - set(GIVE_UP_EMITS) == set(), "published, not in the table"
    assert listed - made == set(), "in the table, published by nobody"


def test_the_table_names_messages_that_exist() -> None:
    known = EVENT_NAMES | {"ToolResult", "PendingNotice", "Job"}
    for h in handlers(["<tool>"], with_audit=True):
        assert set(h.emits) <= known, h.durable


def denied() -> CallDenied:
    return CallDenied(
        event_id="e1",
        occurred_at=utc_now(),
        service="policy",
        call_id="c1",
        principal=Principal(tenant="acme", user="u", agent="a", session="s"),
        tool="search",
        status="denied",
        error=ToolError(code=ErrorCode.POLICY_DENIED, message="no"),
    )


def row(durable: str) -> object:
    return next(h for h in handlers(["<tool>"]) if h.durable == durable)


async def test_an_undeclared_emit_fails_the_work_when_strict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(emits.STRICT_ENV, "1")
    publisher = publishing.Publisher(None)  # type: ignore[arg-type]  # refused before any I/O
    emits.handling(row("executor-<tool>"))  # type: ignore[arg-type]
    try:
        with pytest.raises(emits.UndeclaredEmit, match="executor-<tool> published CallDenied"):
            await publisher.emit(denied())
        with pytest.raises(emits.UndeclaredEmit, match="ToolResult"):
            await publisher.publish_result(None, None, "m")  # type: ignore[arg-type]
        # Giving up is every stage's: allowed on every row.
        emits.check(MessageDeadLettered.__name__)
        emits.check(CallAbandoned.__name__)
    finally:
        emits.handling(None)


async def test_an_undeclared_emit_is_only_logged_when_not_strict(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(emits.STRICT_ENV, raising=False)
    emits.handling(row("attacher-CallDenied"))  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.ERROR, logger="toolgate"):
            emits.check("ExecutionStarted")
        assert "attacher-CallDenied published ExecutionStarted" in caplog.text
    finally:
        emits.handling(None)


async def nothing(msg: object, delivery: object) -> None:
    pass


def test_the_runner_takes_its_durables_from_the_table(tmp_path: Path) -> None:
    settings = GatewaySettings(nats_url="nats://127.0.0.1:1", data_dir=tmp_path)
    runner = StageRunner("policy", settings)
    assert runner.unstaged() == ["policy", "policy-approvals"]
    with pytest.raises(ValueError, match="no durable 'policy-granted'"):
        runner.add(Stage("policy-granted", nothing))
    runner.add(Stage("policy", nothing))
    with pytest.raises(ValueError, match="declared twice"):
        runner.add(Stage("policy", nothing))
    with pytest.raises(ValueError, match="no stage: policy-approvals"):
        runner.run_consumers(runner.app())
