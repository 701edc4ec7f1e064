"""HTTP tools without a network: the registry's `http:` and `auth` entries, the request built
from the arguments, the token cache, and what is quoted from a server."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from toolgate.contracts.registry import McpUpstream, ToolSpec, UpstreamAuth
from toolgate.contracts.tooling import ToolRefused
from toolgate.services.executor.http_auth import TokenCache, scrub
from toolgate.services.executor.upstream_http import build_request

ORDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "expand": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "note": {"type": "string"},
        "body": {"type": "object"},
    },
    "required": ["order_id"],
    "additionalProperties": False,
}


def entry(**http: Any) -> dict[str, Any]:
    return {
        "name": "get_order",
        "description": "Read one order.",
        "input_schema": ORDER_SCHEMA,
        "output_schema": {"type": "object"},
        "http": {"method": "GET", "url": "https://api.example.com/orders/{order_id}", **http},
        "read_only": True,
        "timeout_s": 5,
        "risk": "low",
        "allowed_agents": ["*"],
    }


def http_of(**http: Any):  # type: ignore[no-untyped-def]
    spec = ToolSpec.model_validate(entry(**http))
    assert spec.http is not None
    return spec.http


class TestRegistry:
    def test_an_http_entry_is_a_third_implementation_and_only_one(self) -> None:
        assert http_of().path_parameters == ["order_id"]
        with pytest.raises(ValidationError, match="exactly one of `function`"):
            ToolSpec.model_validate({**entry(), "function": "a.b:c"})

    @pytest.mark.parametrize(
        "url, message",
        [
            ("https://api.example.com/orders/{missing}", "placeholder {missing}"),
            ("https://api.example.com/orders/{note}", "placeholder {note}"),  # not required
            ("https://api.example.com/orders?id={order_id}", "only be in the path"),
            ("https://api.example.com?id={order_id}", "only be in the path"),
            ("https://{order_id}.example.com/orders", "String should match pattern"),
            ("ftp://api.example.com/orders", "String should match pattern"),
        ],
    )
    def test_placeholders_name_required_arguments_of_the_path_only(
        self, url: str, message: str
    ) -> None:
        with pytest.raises(ValidationError, match=message.replace("{", r"\{").replace("?", r"\?")):
            http_of(url=url)

    @pytest.mark.parametrize("header", ["Authorization", "host", "Cookie", "Content-Length"])
    def test_headers_the_transport_or_auth_set_are_not_written_in_a_file(self, header: str) -> None:
        with pytest.raises(ValidationError, match="never by a registry file"):
            http_of(headers={header: "x"})
        with pytest.raises(ValidationError, match="line break"):
            http_of(headers={"X-Trace": "a\r\nX-Evil: 1"})

    def test_auth_is_exactly_one_kind_with_its_secret_outside_the_file(self) -> None:
        assert UpstreamAuth(bearer_file="/run/secrets/api").bearer_file == "/run/secrets/api"
        with pytest.raises(ValidationError, match="exactly one of bearer_file"):
            UpstreamAuth(bearer_file="/a", bearer_env="B")
        with pytest.raises(ValidationError, match="exactly one of bearer_file"):
            UpstreamAuth()
        client = {"token_endpoint": "https://idp/token", "client_id": "gw"}
        with pytest.raises(ValidationError, match="client_secret_file"):
            UpstreamAuth.model_validate({"oauth_client_credentials": client})
        # A secret written into the file itself is no field of the registry.
        inline = {**client, "client_secret": "x", "client_secret_env": "S"}
        with pytest.raises(ValidationError, match="client_secret\n  Extra inputs"):
            UpstreamAuth.model_validate({"oauth_client_credentials": inline})
        exchange = {**client, "client_secret_env": "GW_SECRET", "audience": "orders"}
        assert UpstreamAuth.model_validate({"token_exchange": exchange}).token_exchange

    def test_token_exchange_acts_for_the_user(self) -> None:
        exchange = {
            "token_endpoint": "https://idp/token",
            "client_id": "gw",
            "client_secret_env": "S",
            "audience": "orders",
        }
        ToolSpec.model_validate(entry(auth={"token_exchange": exchange}))
        with pytest.raises(ValidationError, match="acts_for_user cannot be false"):
            ToolSpec.model_validate(
                {**entry(auth={"token_exchange": exchange}), "acts_for_user": False}
            )

    def test_an_mcp_upstream_takes_auth_but_no_token_exchange(self) -> None:
        base = {"url": "http://x/mcp", "tool": "t", "definition_sha256": "0" * 64}
        McpUpstream.model_validate({**base, "auth": {"bearer_env": "UP"}})
        exchange = {
            "token_endpoint": "https://idp/token",
            "client_id": "gw",
            "client_secret_env": "S",
            "audience": "a",
        }
        with pytest.raises(ValidationError, match="token_exchange is for http: tools only"):
            McpUpstream.model_validate({**base, "auth": {"token_exchange": exchange}})
        with pytest.raises(ValidationError, match="not both"):
            McpUpstream.model_validate(
                {**base, "auth": {"bearer_env": "UP"}, "headers_from_env": {"Authorization": "A"}}
            )

    def test_query_and_body_name_declared_arguments(self) -> None:
        with pytest.raises(ValidationError, match="'nope' is not a property"):
            http_of(query=["nope"])
        with pytest.raises(ValidationError, match="carries no body"):
            http_of(body="body")
        with pytest.raises(ValidationError, match="fills the url path"):
            http_of(method="POST", query=["order_id"])


class TestBuildRequest:
    def test_path_arguments_are_one_encoded_segment_and_the_rest_the_query(self) -> None:
        request = build_request(
            http_of(),
            {"order_id": "a/b?c#d e%", "expand": True, "tags": ["x", "y z"], "note": None},
        )
        assert request.method == "GET" and not request.has_body
        assert request.url == (
            "https://api.example.com/orders/a%2Fb%3Fc%23d%20e%25?expand=true&tags=x&tags=y%20z"
        )

    @pytest.mark.parametrize("value", ["", ".", ".."])
    def test_a_path_argument_cannot_walk_the_path(self, value: str) -> None:
        with pytest.raises(ToolRefused, match="path segment"):
            build_request(http_of(), {"order_id": value})

    def test_other_methods_send_the_rest_as_a_json_body(self) -> None:
        request = build_request(
            http_of(method="POST", query=["expand"]),
            {"order_id": "o1", "expand": False, "note": "hi", "body": {"k": 1}},
        )
        assert request.url == "https://api.example.com/orders/o1?expand=false"
        assert request.has_body and request.body == {"note": "hi", "body": {"k": 1}}
        named = build_request(
            http_of(method="PUT", body="body", query=["note"]),
            {"order_id": "o1", "note": "n", "body": {"k": [1]}},
        )
        assert named.url == "https://api.example.com/orders/o1?note=n"
        assert named.body == {"k": [1]}

    def test_a_static_query_is_kept_and_an_object_never_goes_into_a_query(self) -> None:
        request = build_request(
            http_of(url="https://api.example.com/orders/{order_id}?v=2"),
            {"order_id": 7, "note": "a&b=c"},
        )
        assert request.url == "https://api.example.com/orders/7?v=2&note=a%26b%3Dc"
        with pytest.raises(ToolRefused, match="cannot be sent in a query"):
            build_request(http_of(), {"order_id": "o", "body": {"a": 1}})


class TestTokenCache:
    def test_a_token_is_kept_until_shortly_before_it_expires(self) -> None:
        now = [1000.0]
        cache = TokenCache(clock=lambda: now[0])
        cache.put(("k",), "t1", 300)
        now[0] += 269
        assert cache.get(("k",)) == "t1"
        now[0] += 2  # within the margin (30 s) of its expiry
        assert cache.get(("k",)) is None and len(cache) == 0

    def test_a_token_without_a_lifetime_is_not_kept_and_the_cache_is_bounded(self) -> None:
        cache = TokenCache(max_entries=2)
        cache.put(("a",), "ta", None)
        assert cache.get(("a",)) is None
        for key in "bcd":
            cache.put((key,), f"t{key}", 60)
        assert len(cache) == 2 and cache.get(("b",)) is None and cache.get(("d",)) == "td"


def test_quoted_server_text_is_bounded_escaped_and_without_secrets() -> None:
    quoted = scrub("denied for sk-SECRET-1 \x1b[2J" + "x" * 1000, ["sk-SECRET-1"])
    assert "sk-SECRET-1" not in quoted and "[redacted]" in quoted
    assert "\x1b" not in quoted and "\\u001b" in quoted
    assert len(quoted) < 400


def test_an_http_tools_output_is_checked_and_says_where_it_came_from() -> None:
    from toolgate.contracts.calls import Principal, Provenance
    from toolgate.contracts.events import ExecutionSucceeded, utc_now
    from toolgate.contracts.registry import Registry
    from toolgate.services.attacher.logic import ResultBuilder

    spec = ToolSpec.model_validate(
        {
            **entry(url="https://api.example.com:8443/v1/orders/{order_id}?v=2"),
            "output_schema": {"type": "object", "required": ["id"]},
        }
    )
    builder = ResultBuilder(Registry({spec.name: spec}))

    def result_of(output: Any):  # type: ignore[no-untyped-def]
        return builder.result_for(
            ExecutionSucceeded(
                event_id="e",
                call_id="c1",
                occurred_at=utc_now(),
                service="executor",
                tool=spec.name,
                principal=Principal(tenant="acme", user="u", agent="a", session="s"),
                output=output,
                duration_ms=1.0,
            )
        )

    good, bad = result_of({"id": "o1"}), result_of({"di": "o1"})
    assert good.ok and good.provenance == Provenance(
        source="http", server="https://api.example.com:8443", tool="GET /v1/orders/{order_id}"
    )
    assert bad.status == "invalid_tool_result" and bad.data is None
