"""`toolgate bench trips` sorts each tapped message by what it costs the bus."""

from __future__ import annotations

from collections import Counter
from typing import Any

from nats.aio.msg import Msg

from toolgate.bench.trips import BACKGROUND, OWN_INBOX, SECTIONS, Counted, classify, table


def msg(subject: str, reply: str = "", data: bytes = b"", **headers: str) -> Msg:
    nothing: Any = None
    return Msg(_client=nothing, subject=subject, reply=reply, data=data, headers=headers or None)


def test_publishes_are_counted_per_stream_and_event_kind() -> None:
    assert classify(msg("toolgate.evt.CallAuthorized.echo", "_INBOX.x.1")) == (
        SECTIONS[0],
        "TOOLGATE_EVENTS: CallAuthorized",
    )
    assert classify(msg("toolgate.calls.acme.bot", "_R_.x")) == (
        SECTIONS[0],
        "TOOLGATE_CALLS: call",
    )
    assert classify(msg("toolgate.results.acme.bot.c1", "_INBOX.y.2"))[1] == (  # type: ignore[index]
        "TOOLGATE_RESULTS: result"
    )
    # The same bytes sent again as a plain publish (a retry's answer): no ack, not stored.
    assert classify(msg("toolgate.results.acme.bot.c1"))[0] == SECTIONS[5]  # type: ignore[index]


def test_kv_writes_say_create_update_put_or_delete() -> None:
    create = msg("$KV.toolgate_outcomes.a.b.c", "r", **{"Nats-Expected-Last-Subject-Sequence": "0"})
    update = msg("$KV.toolgate_outcomes.a.b.c", "r", **{"Nats-Expected-Last-Subject-Sequence": "7"})
    delete = msg("$KV.toolgate_user_tokens.a.b.c", "r", **{"KV-Operation": "DEL"})
    assert classify(create) == (SECTIONS[1], "toolgate_outcomes: create")
    assert classify(update) == (SECTIONS[1], "toolgate_outcomes: update")
    assert classify(msg("$KV.toolgate_outcomes.k", "r")) == (SECTIONS[1], "toolgate_outcomes: put")
    assert classify(delete) == (SECTIONS[1], "toolgate_user_tokens: delete")


def test_deliveries_and_acks_are_counted_per_durable_in_either_ack_subject_form() -> None:
    v1 = "$JS.ACK.TOOLGATE_EVENTS.policy.1.10.10.1700000000.0"
    v2 = "$JS.ACK.hub.ACCHASH.TOOLGATE_EVENTS.policy.1.10.10.1700000000.0.tok"
    assert classify(msg("_INBOX.p.3", v1)) == (SECTIONS[2], "TOOLGATE_EVENTS > policy")
    assert classify(msg("_INBOX.p.3", v2)) == (SECTIONS[2], "TOOLGATE_EVENTS > policy")
    assert classify(msg(v1, data=b"+ACK")) == (SECTIONS[3], "policy: ack")
    assert classify(msg(v2, data=b"-NAK {}")) == (SECTIONS[3], "policy: nak")
    assert classify(msg(v1, data=b"+WPI")) == (SECTIONS[3], "policy: in progress")
    assert classify(msg(v1, "_INBOX.z", data=b"+ACK")) == (SECTIONS[3], "policy: ack (awaited)")


def test_timers_and_the_taps_own_requests_are_kept_apart() -> None:
    pull = msg("$JS.API.CONSUMER.MSG.NEXT.TOOLGATE_EVENTS.policy", "_INBOX.q.1")
    assert classify(pull) == (BACKGROUND, "pull requests")
    assert classify(msg("_INBOX.q.1", Status="408"))[0] == BACKGROUND  # type: ignore[index]
    assert classify(msg("_INBOX.q.1", data=b"{}"))[0].strip() == BACKGROUND  # type: ignore[index]
    assert classify(msg("$JS.API.CONSUMER.INFO.TOOLGATE_EVENTS.audit", OWN_INBOX + ".1")) is None
    get = msg("$JS.API.DIRECT.GET.TOOLGATE_RESULTS.toolgate.results.a.b.c", "_INBOX.r")
    assert classify(get) == (SECTIONS[4], "direct get TOOLGATE_RESULTS")


def test_the_table_gives_counts_per_call_and_round_trips() -> None:
    counts = Counter(
        {
            (SECTIONS[0], "TOOLGATE_EVENTS: CallAuthorized"): 10,
            (SECTIONS[3], "policy: ack"): 10,
            (BACKGROUND, "pull requests"): 3,
        }
    )
    lines = table([Counted("seq", 10, counts, {"TOOLGATE_EVENTS": 10}, 1.0)])
    text = "\n".join(lines)
    assert "TOOLGATE_EVENTS: CallAuthorized" in text and "1.00" in text
    assert "requests answered per call (publish acks, awaited acks, other requests): seq 1.00" in (
        text
    )


def test_counting_nothing_is_refused_as_bad_input(capsys: Any) -> None:
    from toolgate.cli.main import main

    assert main(["bench", "trips", "-n", "0", "--burst", "0"]) == 2
    assert "toolgate bench trips:" in capsys.readouterr().err
