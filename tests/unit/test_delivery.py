"""What a stage knows of a delivered message, read from its ack subject (runtime/settling.py)."""

from __future__ import annotations

from typing import Any

import pytest
from nats.aio.msg import Msg

from toolgate.runtime.settling import delivery_of


class _ReadByHand(Msg):
    """A delivered message whose nats-py metadata must not be needed (it is the slow way)."""

    @property
    def metadata(self) -> Any:
        raise AssertionError("the ack subject was parsed by nats-py")


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.TOOLGATE_EVENTS.executor-echo.3.42.40.1767322445678901234.7",
        "$JS.ACK.hub.ACCHASH.TOOLGATE_EVENTS.executor-echo.3.42.40.1767322445678901234.7.tok",
    ],
)
def test_the_delivery_is_read_from_the_ack_subject_as_nats_reads_it(reply: str) -> None:
    subject = "toolgate.evt.CallAuthorized.echo"
    delivery = delivery_of(_ReadByHand(None, subject, reply, b"{}"))  # type: ignore[arg-type]
    meta = Msg(None, subject, reply, b"{}").metadata  # type: ignore[arg-type]
    assert (delivery.stream_sequence, delivery.attempt) == (42, 3)
    assert (delivery.stream_sequence, delivery.attempt) == (
        meta.sequence.stream,
        meta.num_delivered,
    )
    assert delivery.subject == subject and delivery.message_id == "seq:42"


def test_a_stages_metrics_name_its_durable_from_the_ack_subject() -> None:
    from toolgate.runtime.telemetry import _durable_of

    reply = "$JS.ACK.TOOLGATE_EVENTS.executor-echo.3.42.40.1767322445678901234.7"
    assert _durable_of(_ReadByHand(None, "s", reply, b"")) == "executor-echo"  # type: ignore[arg-type]
    assert _durable_of(Msg(None, "s", "_INBOX.x", b"")) == ""  # type: ignore[arg-type]
