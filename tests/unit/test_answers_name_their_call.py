"""Which waiter an answer on a call_id's subject is for (GatewayClient's `_Waiter`).

A call_id names one call of its agent. Several submits may wait on one call_id's
subject: the first call's, its retries', and a second call's that reused the
call_id by mistake. The answer's headers name the call it answers; a refusal's name
the refused call. Pure logic: the system tests (tests/system/test_retries.py) show
the same against the real gateway.
"""

from __future__ import annotations

import asyncio

from toolgate.client.gateway_client import _Waiter
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import (
    REFUSED_HEADER,
    answer_headers,
    answered_call,
    call_id_reused,
    success,
)

FIRST = ("count_runs", arguments_sha256({"n": 1}))
SECOND = ("count_runs", arguments_sha256({"n": 2}))


def waiter(answers: tuple[str, str] | None) -> _Waiter:
    return _Waiter("c-1", asyncio.get_running_loop().create_future(), None, answers)


async def test_an_answer_reaches_the_waiters_of_its_own_call_and_refuses_the_others() -> None:
    first, retry, second, fresh = waiter(FIRST), waiter(FIRST), waiter(SECOND), waiter(None)
    result = success("c-1", {"ok": 1})
    headers = answer_headers(*FIRST)
    for w in (first, retry, second, fresh):
        w.answer(result, answered_call(headers), refusal=False)

    assert first.future.result() == result and retry.future.result() == result
    assert fresh.future.result() == result  # a minted call_id: no other call can own it
    refused = second.future.result()
    assert refused.error is not None and refused.error.code == "CALL_ID_REUSED"


async def test_a_refusal_reaches_only_the_call_it_names() -> None:
    first, second, fresh = waiter(FIRST), waiter(SECOND), waiter(None)
    refusal = call_id_reused("c-1", "count_runs")
    headers = {**answer_headers(*SECOND), REFUSED_HEADER: "CALL_ID_REUSED"}
    for w in (first, second, fresh):
        w.answer(refusal, answered_call(headers), refusal=True)

    assert second.future.result() == refusal
    assert not first.future.done()  # the first call's caller still waits for its result
    assert not fresh.future.done()


async def test_an_answer_that_names_no_call_is_everyones() -> None:
    """Results stored before answers named their call, or of unreadable arguments."""
    first, second = waiter(FIRST), waiter(SECOND)
    result = success("c-1", None)
    for w in (first, second):
        w.answer(result, answered_call(None), refusal=False)
    assert first.future.result() == result and second.future.result() == result


def test_answer_headers_name_nothing_without_arguments() -> None:
    assert answer_headers("echo", None) == {} and answered_call({}) is None
    assert answered_call(answer_headers(*FIRST)) == FIRST
