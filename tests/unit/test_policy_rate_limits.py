"""Rate-limit windows: which counter a call lands in (pure; the counting is integration)."""

from __future__ import annotations

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import RateLimit
from toolgate.services.policy.rate_limits import window_key

LIMIT = RateLimit(calls=3, per_seconds=60)


def call(user: str = "u-alice", tool: str = "search_sources", tenant: str = "acme") -> ToolCall:
    return ToolCall(
        call_id="c",
        tool=tool,
        arguments={},
        principal=Principal(tenant=tenant, user=user, agent="a", session="s"),
    )


def test_calls_of_one_user_and_tool_in_one_window_share_a_counter() -> None:
    assert window_key(call(), LIMIT, 120.0)[0] == window_key(call(), LIMIT, 179.9)[0]
    assert window_key(call(), LIMIT, 120.0)[0] != window_key(call(), LIMIT, 180.0)[0]


def test_tenant_user_and_tool_each_get_their_own_counter() -> None:
    keys = {
        window_key(c, LIMIT, 0.0)[0]
        for c in (call(), call(user="u-bob"), call(tool="echo"), call(tenant="globex"))
    }
    assert len(keys) == 4


def test_key_is_a_valid_kv_key_whatever_the_ids_hold() -> None:
    key, retry_after = window_key(call(user="a b/*.>", tenant="t\n"), LIMIT, 125.0)
    assert all(ch.isalnum() or ch == "." for ch in key)
    assert retry_after == 55.0
