"""When a stage gives up on a message: which errors it never gives up on, and how the
call it names still ends in a result (runtime/settling.py `settle`,
runtime/giving_up.py `abandoned`).

`settle` decides from what JetStream says of the delivery and what `work`
raised; the message here is a recorder of the ack it gets (the same calls on a
real server are covered by tests/system/test_faults.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.js.errors import APIError, ServiceUnavailableError

from toolgate.contracts.calls import ErrorCode, Principal, ToolCall, ToolError
from toolgate.contracts.events import (
    ApprovalRequested,
    ArgumentsValidated,
    CallAbandoned,
    CallDenied,
    MessageDeadLettered,
    call_fields,
    decode_event,
    encode_event,
    utc_now,
)
from toolgate.contracts.registry import load_registry
from toolgate.runtime import giving_up, settling
from toolgate.services.attacher.logic import ResultBuilder
from toolgate.services.audit.trace import STAGE, describe

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
CALL = ToolCall(call_id="c-give-up", tool="echo", arguments={"payload": 1}, principal=BOB)


class AckRecorder:
    """What `settle` did with the message: ack, nak (with its delay) or term."""

    def __init__(self) -> None:
        self.acks: list[tuple[str, float | None]] = []

    async def ack(self) -> None:
        self.acks.append(("ack", None))

    async def nak(self, delay: float | None = None) -> None:
        self.acks.append(("nak", delay))

    async def term(self) -> None:
        self.acks.append(("term", None))


_sequences = iter(range(1000, 10**9))


def delivery(attempt: int, sequence: int | None = None) -> settling.Delivery:
    """A delivery of a stored message (a new one unless `sequence` names it)."""
    return settling.Delivery(
        stream_sequence=next(_sequences) if sequence is None else sequence,
        attempt=attempt,
        subject="toolgate.evt.ArgumentsValidated.echo",
    )


async def settle_failing(
    exc: Exception, at: settling.Delivery, give_up: Any = None
) -> tuple[AckRecorder, list[Exception]]:
    msg, given_up = AckRecorder(), []

    async def work() -> None:
        raise exc

    async def record(reason: Exception) -> None:
        given_up.append(reason)
        if give_up is not None:
            await give_up(reason)

    await settling.settle(msg, at, work, record)  # type: ignore[arg-type]
    return msg, given_up


def validated() -> ArgumentsValidated:
    return ArgumentsValidated(
        event_id="e-validated",
        occurred_at=utc_now(),
        service="validator",
        call=CALL,
        arguments_sha256="0" * 64,
        **call_fields(CALL),
    )


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionClosedError(),
        ServiceUnavailableError(code=503, description="JetStream system temporarily unavailable"),
    ],
)
async def test_an_unanswering_bus_is_retried_past_the_last_attempt(exc: Exception) -> None:
    assert settling.is_transient(exc)
    at = delivery(settling.MAX_ATTEMPTS + 3)
    for _ in range(settling.MAX_ATTEMPTS + 3):
        msg, given_up = await settle_failing(exc, at)
        assert given_up == []
        assert msg.acks == [("nak", settling.retry_delay(settling.MAX_ATTEMPTS + 3))]


@pytest.mark.parametrize(
    "exc", [ValueError("bad"), TypeError("expected X"), APIError(code=400, err_code=10999)]
)
async def test_other_errors_are_given_up_on_at_the_last_attempt(exc: Exception) -> None:
    assert not settling.is_transient(exc)
    sequence = next(_sequences)
    for attempt in range(1, settling.MAX_ATTEMPTS):
        msg, given_up = await settle_failing(exc, delivery(attempt, sequence))
        assert given_up == [] and msg.acks == [("nak", settling.retry_delay(attempt))]
    msg, given_up = await settle_failing(exc, delivery(settling.MAX_ATTEMPTS, sequence))
    assert given_up == [exc] and msg.acks == [("term", None)]


async def test_deliveries_an_outage_cost_do_not_count_towards_giving_up() -> None:
    """After a long outage every message in flight has been delivered many times; its
    first real error is its first failed attempt, not its last."""
    sequence = next(_sequences)
    for attempt in range(1, 21):
        await settle_failing(nats.errors.TimeoutError(), delivery(attempt, sequence))
    msg, given_up = await settle_failing(ValueError("a race"), delivery(21, sequence))
    assert given_up == [] and msg.acks == [("nak", settling.retry_delay(1))]
    # And a success forgets the message's failures.
    done = AckRecorder()

    async def works() -> None:
        return None

    await settling.settle(done, delivery(22, sequence), works, None)  # type: ignore[arg-type]
    assert done.acks == [("ack", None)]
    assert settling.FAILURES.of(delivery(23, sequence)) == 0


async def test_a_give_up_that_fails_keeps_the_message() -> None:
    sequence = next(_sequences)

    async def cannot(reason: Exception) -> None:
        raise nats.errors.TimeoutError()

    for attempt in range(1, settling.MAX_ATTEMPTS + 2):
        msg, _ = await settle_failing(ValueError("bad"), delivery(attempt, sequence), cannot)
        assert [kind for kind, _ in msg.acks] == ["nak"]


def test_failure_counts_are_bounded() -> None:
    counts = settling.FailureCounts(limit=3)
    first, *others = (delivery(1) for _ in range(4))
    counts.failed(first)
    counts.failed(first)
    for other in others:
        counts.failed(other)
    assert counts.of(first) == 0  # the oldest was forgotten: it starts again from 0
    assert [counts.of(other) for other in others] == [1, 1, 1]


def test_the_back_off_is_capped() -> None:
    assert settling.retry_delay(1) == 0.5
    assert settling.retry_delay(50) == 15.0


@pytest.mark.parametrize(
    ("service", "retryable", "words"),
    [
        ("policy", True, "the tool did not run"),
        ("executor", False, "whether the tool ran is not known"),
        ("attacher", False, "no result could be formed"),
    ],
)
def test_a_given_up_event_ends_its_call(service: str, retryable: bool, words: str) -> None:
    raw = encode_event(validated())
    sequence = next(_sequences)
    end = giving_up.abandoned(service, delivery(settling.MAX_ATTEMPTS, sequence), raw)
    assert isinstance(end, CallAbandoned)
    assert (end.call_id, end.principal, end.tool) == (CALL.call_id, BOB, "echo")
    assert end.status == "execution_error"
    assert end.error.code == ErrorCode.GATEWAY_GAVE_UP
    assert end.error.retryable is retryable and words in end.error.message
    # A redelivery of the same stored message gives the same event: deduplicated.
    again = giving_up.abandoned(service, delivery(settling.MAX_ATTEMPTS + 1, sequence), raw)
    assert again is not None and again.event_id == end.event_id
    # And it decodes as what the attacher consumes.
    assert decode_event(encode_event(end)) == end


def test_nothing_ends_a_call_the_message_does_not_name() -> None:
    at = delivery(settling.MAX_ATTEMPTS)
    assert giving_up.abandoned("policy", at, b"not json at all") is None
    no_principal = CallDenied(
        event_id="e-denied",
        call_id="c-1",
        occurred_at=utc_now(),
        service="policy",
        status="denied",
        error=ToolError(code="POLICY_DENIED", message="no"),
    )
    assert giving_up.abandoned("attacher", at, encode_event(no_principal)) is None
    assert giving_up.abandoned("validator", at, b"{}", call={}) is None
    named = giving_up.abandoned("validator", at, b"{}", call={"call_id": "c-2", "principal": BOB})
    assert named is not None and named.call_id == "c-2" and named.error.retryable


def test_giving_up_on_an_abandoned_call_does_not_abandon_it_again() -> None:
    end = giving_up.abandoned("policy", delivery(settling.MAX_ATTEMPTS), encode_event(validated()))
    assert end is not None
    assert (
        giving_up.abandoned("attacher", delivery(settling.MAX_ATTEMPTS), encode_event(end)) is None
    )


class EmitRecorder:
    def __init__(self) -> None:
        self.emitted: list[Any] = []

    async def emit(self, event: Any) -> None:
        self.emitted.append(event)


async def test_give_up_records_the_dead_letter_under_the_call_then_ends_it() -> None:
    publisher = EmitRecorder()
    raw = encode_event(validated())
    sequence = next(_sequences)

    async def give_up(exc: Exception) -> None:
        await giving_up.give_up_on(publisher, "policy", at, raw, exc)  # type: ignore[arg-type]

    for attempt in range(1, settling.MAX_ATTEMPTS + 1):
        at = delivery(attempt + 7, sequence)  # 7 deliveries lost to an outage before
        await settle_failing(TypeError("boom"), at, give_up)
    letter, end = publisher.emitted
    assert isinstance(letter, MessageDeadLettered) and isinstance(end, CallAbandoned)
    assert letter.reason == "policy gave up after 5 failed attempt(s) (delivery 12): " + repr(
        TypeError("boom")
    )
    assert (letter.call_id, letter.principal, letter.tool) == (CALL.call_id, BOB, "echo")
    assert "after 5 failed attempt(s)" in end.error.message
    # The agent reads the end of its call, not the internals of the failure.
    assert "boom" not in end.error.message


async def test_a_call_something_else_will_end_gets_only_the_dead_letter() -> None:
    publisher = EmitRecorder()
    raw = encode_event(validated())
    at = delivery(settling.MAX_ATTEMPTS)
    await giving_up.give_up_on(publisher, "approvals", at, raw, ValueError("x"), end_call=False)  # type: ignore[arg-type]
    (letter,) = publisher.emitted
    assert isinstance(letter, MessageDeadLettered) and letter.call_id == CALL.call_id


def test_the_attacher_answers_an_abandoned_call_with_its_error() -> None:
    end = giving_up.abandoned(
        "executor", delivery(settling.MAX_ATTEMPTS), encode_event(validated())
    )
    assert end is not None
    result = ResultBuilder(load_registry()).result_for(end)
    assert (result.call_id, result.ok, result.status) == (CALL.call_id, False, "execution_error")
    assert result.error == end.error


def test_the_audit_trace_tells_who_gave_up_and_what_the_agent_was_told() -> None:
    end = giving_up.abandoned(
        "executor", delivery(settling.MAX_ATTEMPTS), encode_event(validated())
    )
    assert end is not None
    row = {
        "event_type": "CallAbandoned",
        "service": "executor",
        "payload": encode_event(end).decode(),
        "policy_version": "",
        "note": "",
    }
    (line,) = describe(row)
    assert line.startswith("executor gave up on the call: ")
    assert end.error.message in line
    assert STAGE["CallAbandoned"] == STAGE["ExecutionFailed"]


# ------------------------------------------------------------ stage-specific: whose call it is

CALLS_SUBJECT = "toolgate.calls.acme.researcher"


def calls_delivery() -> settling.Delivery:
    return settling.Delivery(stream_sequence=next(_sequences), attempt=5, subject=CALLS_SUBJECT)


def test_the_validator_names_the_call_of_a_call_message() -> None:
    from toolgate.services.validator.app import call_named
    from toolgate.services.validator.logic import CallChecker

    checker = CallChecker(load_registry(), 1024 * 1024)
    named = call_named(checker, msgspec.json.encode(CALL), calls_delivery())
    assert (named["call_id"], named["principal"].tenant, named["principal"].agent) == (
        CALL.call_id,
        "acme",
        "researcher",
    )
    assert call_named(checker, b"not json", calls_delivery()) == {}
    elsewhere = settling.Delivery(stream_sequence=1, attempt=5, subject="toolgate.evt.Other.echo")
    assert call_named(checker, msgspec.json.encode(CALL), elsewhere) == {}


class Claims:
    """The validator's claims store as owns_call sees it: who owns which key."""

    def __init__(self, owner: str | None, fails: bool = False) -> None:
        self.owner, self.fails = owner, fails

    async def claim(self, key: str, message_id: str) -> bool:
        if self.fails:
            raise nats.errors.TimeoutError()
        if self.owner is None:
            self.owner = message_id
        return self.owner == message_id


async def test_the_validator_ends_only_a_call_its_message_owns() -> None:
    from toolgate.services.validator.app import owns_call

    call = {"call_id": CALL.call_id, "principal": BOB}
    at = calls_delivery()
    assert await owns_call(Claims(at.message_id), call, at)  # type: ignore[arg-type]
    assert await owns_call(Claims(None), call, at)  # type: ignore[arg-type]
    # A duplicate (a later message with the same call_id) must not end the first's call.
    assert not await owns_call(Claims("seq:1"), call, at)  # type: ignore[arg-type]
    assert not await owns_call(Claims(None, fails=True), call, at)  # type: ignore[arg-type]
    assert not await owns_call(Claims(None), {"call_id": "c", "principal": None}, at)  # type: ignore[arg-type]


class ApprovalStates:
    def __init__(self, held: set[str] | None, fails: bool = False) -> None:
        self.held, self.fails = held or set(), fails

    async def get(self, key: str) -> Any:
        if self.fails:
            raise nats.errors.TimeoutError()
        return (object(), 1) if key in self.held else None


async def test_approvals_leave_a_stored_approval_to_end_its_call(tmp_path: Path) -> None:
    from toolgate.services.approvals.app import ApprovalsService
    from toolgate.services.approvals.approvers import ApproverBook

    requested = ApprovalRequested(
        event_id="req-1",
        occurred_at=utc_now(),
        service="policy",
        call=CALL,
        policy_version="p-7",
        risk="critical",
        required_approvals=1,
        expires_at=utc_now(),
        arguments_sha256="0" * 64,
        **call_fields(CALL),
    )
    raw = encode_event(requested)
    service = ApprovalsService(EmitRecorder(), ApproverBook(tmp_path))  # type: ignore[arg-type]
    key = f"acme.researcher.{CALL.call_id}"
    service.store = ApprovalStates({key})  # type: ignore[assignment]
    assert await service.holds_approval_for(raw)
    service.store = ApprovalStates(None)  # type: ignore[assignment]
    assert not await service.holds_approval_for(raw)  # never stored: end the call
    service.store = ApprovalStates(None, fails=True)  # type: ignore[assignment]
    assert await service.holds_approval_for(raw)  # cannot tell: do not end it
    assert not await service.holds_approval_for(encode_event(validated()))


def test_a_failover_logs_a_line_a_second_not_a_line_a_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    trouble = settling.BusTroubleLog(every_s=1.0, clock=lambda: now[0])
    with caplog.at_level("WARNING", logger="toolgate"):
        for _ in range(500):  # every message in hand fails at once
            trouble.failed(delivery(1), nats.errors.TimeoutError())
        now[0] += 1.5
        trouble.failed(delivery(settling.MAX_ATTEMPTS), nats.errors.TimeoutError())
    lines = [r for r in caplog.records if "the bus did not answer" in r.getMessage()]
    assert len(lines) == 2
    assert lines[0].levelname == "WARNING" and "more since" not in lines[0].getMessage()
    assert "(and 499 more since the last line)" in lines[1].getMessage()
    assert lines[1].levelname == "ERROR"  # it has lasted: louder
