"""Which waiter an answer on a call_id's subject is for (GatewayClient's `_Waiter`).

A call_id names one call of its agent. Several submits may wait on one call_id's
subject: the first call's, its retries', and a second call's that reused the
call_id by mistake. The answer's headers name the call it answers (its tool and the
hash the gateway gave its arguments, after making integral floats in integer fields
ints); a refusal's name the refused call. Pure logic: the system tests
(tests/system/test_retries.py) show the same against the real gateway.
"""

from __future__ import annotations

import asyncio
from typing import Any

from toolgate.client.gateway_client import _Waiter
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import (
    REFUSED_HEADER,
    answer_headers,
    answered_call,
    call_id_reused,
    success,
)

TOOL = "count_runs"


def waiter(arguments: Any, chosen: bool = True, tool: str = TOOL) -> _Waiter:
    future = asyncio.get_running_loop().create_future()
    return _Waiter("c-1", future, None, tool, arguments, chosen)


def named(arguments: Any, tool: str = TOOL) -> tuple[str, str] | None:
    return answered_call(answer_headers(tool, arguments_sha256(arguments)))


def code(w: _Waiter) -> str | None:
    result = w.future.result()
    return result.error.code if result.error else None


async def test_an_answer_reaches_its_own_call_and_surely_refuses_another() -> None:
    first, retry, second = waiter({"n": 1}), waiter({"n": 1}), waiter({"n": 2})
    fresh = waiter({"n": 3}, chosen=False)
    other_tool = waiter({"n": 1}, tool="echo")
    result = success("c-1", {"ok": 1})
    for w in (first, retry, second, fresh, other_tool):
        w.answer(result, named({"n": 1}), refusal=False)

    assert first.future.result() == result and retry.future.result() == result
    assert fresh.future.result() == result  # a minted call_id: no other call can own it
    assert code(second) == "CALL_ID_REUSED" and code(other_tool) == "CALL_ID_REUSED"


async def test_the_gateway_s_integer_normalisation_is_still_the_same_call() -> None:
    """The model wrote 7.0 in an integer field; the gateway hashed 7 (and approvers
    voted on that): the retry that sends 7.0 again is the same call."""
    retry = waiter({"amount": 7.0})
    result = success("c-1", None)
    retry.answer(result, named({"amount": 7}), refusal=False)
    assert retry.future.result() == result


async def test_when_it_cannot_tell_the_gateway_s_refusal_decides() -> None:
    """An integral float the gateway may have kept (a "number" field) or made an int:
    an answer naming neither hash is not surely another call's, so the waiter waits for
    the gateway's verdict, in whichever order the two arrive."""
    refusal = call_id_reused("c-1", TOOL)
    refused_headers = {**answer_headers(TOOL, "gateway-hash"), REFUSED_HEADER: "CALL_ID_REUSED"}
    stored = success("c-1", {"first": True})

    answer_first = waiter({"price": 7.0, "n": 2})
    answer_first.answer(stored, named({"n": 1}), refusal=False)
    assert not answer_first.future.done()  # not given the first call's result
    answer_first.answer(refusal, answered_call(refused_headers), refusal=True)
    assert answer_first.future.result() == refusal

    refusal_first = waiter({"price": 7.0, "n": 2})
    refusal_first.answer(refusal, answered_call(refused_headers), refusal=True)
    assert not refusal_first.future.done()
    refusal_first.answer(stored, named({"n": 1}), refusal=False)
    assert refusal_first.future.result() == refusal


async def test_a_refusal_reaches_only_the_call_it_names() -> None:
    first, second, fresh = waiter({"n": 1}), waiter({"n": 2}), waiter({"n": 2}, chosen=False)
    refusal = call_id_reused("c-1", TOOL)
    headers = {**answer_headers(TOOL, arguments_sha256({"n": 2})), REFUSED_HEADER: "x"}
    for w in (first, second, fresh):
        w.answer(refusal, answered_call(headers), refusal=True)

    assert second.future.result() == refusal
    assert not first.future.done()  # the first call's caller still waits for its result
    assert not fresh.future.done()


async def test_an_answer_that_names_no_call_is_everyones() -> None:
    """Results stored before answers named their call, or of unreadable arguments."""
    first, second = waiter({"n": 1}), waiter({"n": 2})
    result = success("c-1", None)
    for w in (first, second):
        w.answer(result, answered_call(None), refusal=False)
    assert first.future.result() == result and second.future.result() == result


def test_answer_headers_name_nothing_without_arguments() -> None:
    assert answer_headers("echo", None) == {} and answered_call({}) is None
    sha = arguments_sha256({"n": 1})
    assert answered_call(answer_headers(TOOL, sha)) == (TOOL, sha)


def test_the_audit_trace_tells_another_call_under_the_call_id_from_a_retry() -> None:
    from toolgate.services.audit.trace import called, describe

    def row(kind: str, sha: str) -> dict[str, Any]:
        return {
            "event_type": kind,
            "service": "validator",
            "payload": "{}",
            "policy_version": "",
            "note": "",
            "tool": TOOL,
            "arguments_sha256": sha,
        }

    first, other = arguments_sha256({"n": 1}), arguments_sha256({"n": 2})
    rows = [row("ArgumentsValidated", first), row("CallRetried", first)]
    rows.append(row("CallRetried", other))
    call = called(rows)
    assert call == (TOOL, first)
    (retry,) = describe(rows[1], call)
    (another,) = describe(rows[2], call)
    assert retry.endswith("its answer sent again")
    assert "another call" in another and other[:16] in another and "nothing run" in another
    (unknown,) = describe(rows[2], None)  # no hash recorded for the call: as before
    assert unknown == retry
