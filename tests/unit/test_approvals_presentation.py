"""Approver tokens on disk, and showing model-made arguments safely (text and HTML)."""

from __future__ import annotations

import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
import yaml

from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import ApprovalRequested, call_fields
from toolgate.services.approvals.approvers import (
    ApproverBook,
    ApproverError,
    add_approver,
    approvers_path,
)
from toolgate.services.approvals.inbox import call_html, history_filters
from toolgate.services.approvals.logic import Approver, new_state
from toolgate.services.approvals.protocol import ApprovalView, parse_call_ref, view_of
from toolgate.services.approvals.render import as_text, duplicates, pretty_arguments, visible

NASTY = {
    "claim": "<script>alert(1)</script>",
    "note": "\"'><img src=x onerror=alert(2)>",
    "ansi": "\x1b[31mred\x1b[0m",
    "bidi": "abc\u202edcba",
    "zh": "证据",
}


def state_with(arguments: dict) -> ApprovalView:
    call = ToolCall(
        call_id="call_x",
        tool="save_evidence",
        arguments=arguments,
        principal=Principal(tenant="acme", user="u-alice", agent="a", session="s"),
    )
    now = datetime.now(UTC)
    return view_of(
        new_state(
            ApprovalRequested(
                event_id="r",
                occurred_at=now,
                service="policy",
                call=call,
                policy_version="p",
                risk="critical",
                expires_at=now + timedelta(minutes=5),
                arguments_sha256=arguments_sha256(arguments),
                **call_fields(call),
            )
        )
    )


def test_add_approver_stores_only_a_hash_and_authenticates(tmp_path: Path) -> None:
    token = add_approver(tmp_path, "bob", tenants=["acme"])
    text = approvers_path(tmp_path).read_text()
    assert token not in text
    assert stat.S_IMODE(approvers_path(tmp_path).stat().st_mode) == 0o600
    book = ApproverBook(tmp_path)
    assert book.authenticate(token) == Approver("bob", tenants=("acme",))
    assert not book.authenticate(token).may_vote_for("globex")  # type: ignore[union-attr]
    assert book.authenticate(token + "x") is None
    assert book.authenticate("") is None and book.authenticate(None) is None
    assert yaml.safe_load(text)["approvers"]["bob"]["tenants"] == ["acme"]


def test_a_new_approver_and_a_rotated_token_are_seen_without_restart(tmp_path: Path) -> None:
    book = ApproverBook(tmp_path)
    assert book.authenticate("tgap_nothing") is None
    old = add_approver(tmp_path, "bob", ["acme"])
    assert book.authenticate(old) == Approver("bob", ("acme",))
    with pytest.raises(ApproverError):
        add_approver(tmp_path, "Bob", ["acme"])
    new = add_approver(tmp_path, "bob", ["acme", "globex"], rotate=True)
    assert book.authenticate(new) == Approver("bob", ("acme", "globex"))
    assert book.authenticate(old) is None


def test_an_approver_belongs_to_tenants_or_explicitly_to_all(tmp_path: Path) -> None:
    with pytest.raises(ApproverError, match="--tenant"):
        add_approver(tmp_path, "bob")
    with pytest.raises(ApproverError, match="not a tenant"):
        add_approver(tmp_path, "bob", ["acme.*"])
    with pytest.raises(ApproverError, match="not both"):
        add_approver(tmp_path, "bob", ["acme"], all_tenants=True)
    desk = add_approver(tmp_path, "sec-desk", all_tenants=True)
    book = ApproverBook(tmp_path)
    found = book.authenticate(desk)
    assert found == Approver("sec-desk", (), all_tenants=True) and found.may_vote_for("any")


def test_an_entry_of_an_older_file_with_no_tenants_sees_nothing(tmp_path: Path) -> None:
    token = add_approver(tmp_path, "bob", ["acme"])
    data = yaml.safe_load(approvers_path(tmp_path).read_text())
    data["approvers"]["bob"]["tenants"] = []  # what "every tenant" used to look like
    approvers_path(tmp_path).write_text(yaml.safe_dump(data))
    found = ApproverBook(tmp_path).authenticate(token)
    assert found is not None and not found.may_vote_for("acme")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("acme.researcher.call_1", ("call_1", "acme", "researcher")),
        ("call_1", ("call_1", None, None)),
        (" acme.researcher.call_1 ", ("call_1", "acme", "researcher")),
        ("acme.call_1", None),
        ("acme.*.call_1", None),
        ("acme.researcher.>", None),
        ("a.b.c.d", None),
        ("", None),
        ("acme..call_1", None),
    ],
)
def test_calls_are_named_by_their_key_or_a_bare_call_id(text: str, expected: object) -> None:
    ref = parse_call_ref(text)
    assert (None if ref is None else (ref.call_id, ref.tenant, ref.agent)) == expected


@pytest.mark.parametrize("name", ["", "a b", "x/y", "toolgate", "a" * 65, "<b>"])
def test_bad_approver_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ApproverError):
        add_approver(tmp_path, name)


def test_text_shows_hidden_characters_as_escapes() -> None:
    shown = pretty_arguments(NASTY)
    assert "\x1b" not in shown and "\\u001b[31m" in shown
    assert "\u202e" not in shown and "\\u202e" in shown
    assert "证据" in shown
    assert visible("a\tb") == "a\\u0009b"
    text = as_text(state_with(NASTY), datetime.now(UTC))
    assert "\x1b" not in text and arguments_sha256(NASTY) in text
    assert text.startswith("acme.a.call_x  save_evidence")


def test_html_escapes_every_model_value() -> None:
    html = call_html(state_with(NASTY), Approver("bob", ("acme",)), "csrf")
    assert "<script>" not in html and "<img" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "\u202e" not in html


def test_html_offers_no_approve_button_to_the_caller() -> None:
    state = state_with({"a": 1})
    html = call_html(state, Approver("bob", ("acme",)), "c")
    assert "value=approve" in html
    assert 'name=call value="acme.a.call_x"' in html  # votes address the call key
    own = call_html(state, Approver("u-alice", ("acme",)), "c")
    assert "value=approve" not in own and "value=deny" in own


def test_duplicates_pair_pending_calls_of_one_sender_tool_and_arguments() -> None:
    one = state_with({"claim": "a"})
    twin = msgspec.structs.replace(one, key="acme.a.call_y", call_id="call_y")
    other = msgspec.structs.replace(
        state_with({"claim": "b"}), key="acme.a.call_z", call_id="call_z"
    )
    elsewhere = msgspec.structs.replace(twin, key="acme.b.call_w", agent="b")
    decided = msgspec.structs.replace(twin, key="acme.a.call_v", status="denied")
    found = duplicates([one, twin, other, elsewhere, decided])
    assert found == {one.key: ["acme.a.call_y"], "acme.a.call_y": [one.key]}


def test_history_filters_from_a_query_string() -> None:
    found = history_filters("tool=up_wire&decision=denied&approver=bob&since=2026-12-01")
    assert found is not None and found["tool"] == "up_wire" and found["approver"] == "bob"
    assert found["since"] == datetime(2026, 12, 1, tzinfo=UTC) and found["until"] is None
    assert history_filters("") == {
        "tool": "",
        "approver": "",
        "decision": "",
        "since": None,
        "until": None,
    }
    for bad in ("decision=maybe", "since=yesterday", "until=2026-13-01", "tool=" + "x" * 300):
        assert history_filters(bad) is None, bad


def test_in_history_takes_decided_calls_that_match_every_filter() -> None:
    from toolgate.services.approvals.app import in_history
    from toolgate.services.approvals.logic import Vote
    from toolgate.services.approvals.protocol import HistoryRequest

    view = state_with({"claim": "a"})
    at = view.requested_at + timedelta(minutes=1)
    vote = Vote(approver="Bob", decision="deny", reason="no", at=at)
    state = new_state(
        ApprovalRequested(
            event_id="r",
            occurred_at=view.requested_at,
            service="policy",
            call=view.call,
            policy_version="p",
            risk="critical",
            expires_at=view.expires_at,
            **call_fields(view.call),
        )
    )
    assert not in_history(state, HistoryRequest(token="t"))  # still pending
    state = msgspec.structs.replace(state, status="denied", decided_at=at, votes=[vote])
    assert in_history(state, HistoryRequest(token="t"))
    assert in_history(state, HistoryRequest(token="t", approver="bob", decision="denied"))
    assert in_history(state, HistoryRequest(token="t", since=at.replace(tzinfo=None)))
    assert not in_history(state, HistoryRequest(token="t", until=at))
    assert not in_history(state, HistoryRequest(token="t", tool="echo"))
    assert not in_history(state, HistoryRequest(token="t", decision="granted"))
    assert not in_history(state, HistoryRequest(token="t", approver="carol"))


def test_a_card_names_an_upstream_tools_server_and_pin_escaped() -> None:
    from toolgate.contracts.registry import ToolSpec
    from toolgate.services.approvals.app import tool_info_of

    spec = ToolSpec.model_validate(
        {
            "name": "up_x",
            "description": "Does <b>x</b>\nfolded.",
            "input_schema": {"type": "object"},
            "output_schema": {"type": "object"},
            "mcp": {"url": "http://u/mcp?<i>", "tool": "x", "definition_sha256": "d" * 64},
            "read_only": True,
            "timeout_s": 5,
            "risk": "critical",
            "allowed_agents": ["*"],
        }
    )
    info = tool_info_of(spec)
    assert info is not None and info.server == "http://u/mcp?<i>" and info.pin == "d" * 64
    view = msgspec.structs.replace(state_with({"claim": "a"}), tool_info=info)
    html = call_html(view, Approver("bob", ("acme",)), "csrf")
    assert "Does &lt;b&gt;x&lt;/b&gt; folded." in html
    assert "<code class=server>http://u/mcp?&lt;i&gt;</code>" in html
    assert f"<code class=pin>{'d' * 64}</code>" in html
    text = as_text(view, datetime.now(UTC))
    assert "  tool:       Does <b>x</b> folded." in text
    assert f"  upstream:   http://u/mcp?<i> (tool x, pinned sha256 {'d' * 64})" in text
    assert tool_info_of(None) is None
