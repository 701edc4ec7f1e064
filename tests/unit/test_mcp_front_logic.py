"""The MCP front door's pure parts: tokens, the listing, the call_id, the answer's shape."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from toolgate.contracts.calls import (
    ErrorDetail,
    Provenance,
    ToolError,
    ToolResult,
    failure,
    success,
)
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry
from toolgate.services.mcp_front import logic
from toolgate.services.mcp_front.tokens import (
    TokenError,
    TokenStore,
    mint_token,
    parse_token,
    token_path,
)


def agent_record(data_dir: Path, tenant: str, agent: str, user: str, revoked: bool = False) -> None:
    """What `toolgate agents add` / `revoke` leave beside the token (stack/nats_auth.py)."""
    directory = data_dir / "auth" / "agents"
    directory.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"tenant": tenant, "agent": agent, "account": "A", "user": user}
    record.update(
        created_at="2026-01-01T00:00:00Z", revoked_at="2026-01-02T00:00:00Z" if revoked else None
    )
    (directory / f"{tenant}.{agent}.json").write_text(json.dumps(record))


class TestTokens:
    def test_a_minted_token_names_its_agent_and_only_its_hash_is_stored(
        self, tmp_path: Path
    ) -> None:
        agent_record(tmp_path, "acme", "researcher", "UKEY1")
        token = mint_token(tmp_path, "acme", "researcher")
        assert TokenStore(tmp_path).identify(token) == ("acme", "researcher")
        stored = token_path(tmp_path, "acme", "researcher")
        assert token not in stored.read_text()
        assert os.stat(stored).st_mode & 0o777 == 0o600

    def test_bad_forged_and_other_agents_tokens_are_refused(self, tmp_path: Path) -> None:
        agent_record(tmp_path, "acme", "researcher", "UKEY1")
        agent_record(tmp_path, "acme", "writer", "UKEY2")
        token = mint_token(tmp_path, "acme", "researcher")
        store = TokenStore(tmp_path)
        secret = token.rsplit(".", 1)[1]
        for bad in (
            "",
            "nonsense",
            f"tgmcp.acme.writer.{secret}",
            token + "x",
            f"tgmcp.acme.{secret}",
        ):
            assert store.identify(bad) is None, bad

    def test_minting_again_replaces_the_token(self, tmp_path: Path) -> None:
        agent_record(tmp_path, "acme", "researcher", "UKEY1")
        old = mint_token(tmp_path, "acme", "researcher")
        store = TokenStore(tmp_path)
        assert store.identify(old) is not None
        new = mint_token(tmp_path, "acme", "researcher")
        assert store.identify(old) is None and store.identify(new) == ("acme", "researcher")

    def test_revoking_the_agent_kills_the_token_for_good(self, tmp_path: Path) -> None:
        agent_record(tmp_path, "acme", "researcher", "UKEY1")
        token = mint_token(tmp_path, "acme", "researcher")
        store = TokenStore(tmp_path)
        agent_record(tmp_path, "acme", "researcher", "UKEY1", revoked=True)
        assert store.identify(token) is None
        # Re-added: a new NATS user key; the old token stays dead.
        agent_record(tmp_path, "acme", "researcher", "UKEY9")
        assert store.identify(token) is None

    def test_no_token_for_an_unknown_or_revoked_agent_or_a_bad_name(self, tmp_path: Path) -> None:
        with pytest.raises(TokenError, match="agents add"):
            mint_token(tmp_path, "acme", "ghost")
        agent_record(tmp_path, "acme", "gone", "U", revoked=True)
        with pytest.raises(TokenError):
            mint_token(tmp_path, "acme", "gone")
        with pytest.raises(TokenError, match="subject-safe"):
            mint_token(tmp_path, "acme", "a.b")

    def test_parse_token(self) -> None:
        assert parse_token("tgmcp.acme.researcher.abc") == ("acme", "researcher")
        assert parse_token("tgmcp.acme.researcher.") is None
        assert parse_token("other.acme.researcher.abc") is None
        assert parse_token("tgmcp.ac*me.researcher.abc") is None


class TestListing:
    def test_the_listing_is_visible_to_with_schemas_and_hints(self) -> None:
        registry = load_registry(BUILTIN_TOOLS_DIR)
        tools = logic.listing_for(registry, "researcher")
        assert [t.name for t in tools] == [s.name for s in registry.visible_to("researcher")]
        search = next(t for t in tools if t.name == "search_sources")
        spec = registry.get("search_sources")
        assert spec is not None
        assert search.input_schema == spec.input_schema
        assert search.output_schema == spec.output_schema
        assert search.annotations is not None and search.annotations.read_only_hint is True
        assert search.annotations.destructive_hint is False

    def test_a_tool_no_agent_of_this_name_may_call_is_not_listed(self) -> None:
        registry = load_registry(BUILTIN_TOOLS_DIR)
        listed = {t.name for t in logic.listing_for(registry, "nobody-in-particular")}
        assert listed == {s.name for s in registry if "*" in s.allowed_agents}


class TestCallId:
    def test_meta_call_id_or_none(self) -> None:
        assert logic.requested_call_id(None) is None
        assert logic.requested_call_id({"progressToken": 1}) is None
        assert logic.requested_call_id({logic.CALL_ID_META_KEY: "call_1"}) == "call_1"

    @pytest.mark.parametrize("bad", ["", "a.b", "x" * 129, 5, None, "a b"])
    def test_a_bad_meta_call_id_is_a_precise_error(self, bad: object) -> None:
        with pytest.raises(logic.BadMeta, match="toolgate/call_id"):
            logic.requested_call_id({logic.CALL_ID_META_KEY: bad})


# An upstream tool that declares no output schema, as `tools import-mcp` writes it.
UPSTREAM_PLAIN: dict[str, Any] = {
    "name": "up_plain",
    "description": "Answers in plain text.",
    "input_schema": {"type": "object"},
    "output_schema": {
        "type": "object",
        "properties": {"content": {"type": "array", "items": {"type": "object"}}},
        "required": ["content"],
        "additionalProperties": False,
    },
    "mcp": {"url": "http://u/mcp", "tool": "plain", "definition_sha256": "0" * 64},
    "read_only": True,
    "timeout_s": 10,
    "risk": "low",
    "allowed_agents": ["*"],
}


class TestAnswer:
    def test_ok_is_structured_content_and_the_same_json_as_text(self) -> None:
        answer = logic.call_result(success("c1", {"items": [1]}))
        assert answer.is_error is False
        assert answer.structured_content == {"items": [1]}
        assert json.loads(answer.content[0].text) == {"items": [1]}  # type: ignore[union-attr]
        assert answer.meta == {logic.CALL_ID_META_KEY: "c1", logic.STATUS_META_KEY: "ok"}

    def test_an_error_status_is_is_error_with_the_whole_error(self) -> None:
        error = ToolError(
            code="SCHEMA_VALIDATION_FAILED",
            message="bad",
            retryable=False,
            details=[ErrorDetail(path="/limit", message="too big")],
        )
        answer = logic.call_result(failure("c2", "invalid_arguments", error))
        assert answer.is_error is True
        # No structured content: a client checks it against the tool's outputSchema.
        assert answer.structured_content is None
        assert json.loads(answer.content[0].text) == {  # type: ignore[union-attr]
            "call_id": "c2",
            "status": "invalid_arguments",
            "error": {
                "code": "SCHEMA_VALIDATION_FAILED",
                "message": "bad",
                "retryable": False,
                "details": [{"path": "/limit", "message": "too big"}],
            },
        }

    def test_still_waiting_has_no_structured_content(self) -> None:
        answer = logic.still_waiting("c9", 5.0)
        assert answer.is_error is True and answer.structured_content is None
        assert json.loads(answer.content[0].text)["status"] == "pending"  # type: ignore[union-attr]

    def test_upstream_content_passes_through_as_content_and_lists_no_output_schema(
        self,
    ) -> None:
        from toolgate.contracts.registry import ToolSpec

        spec = ToolSpec.model_validate(UPSTREAM_PLAIN)
        assert logic.passes_content(spec)
        assert logic.tool_of(spec).output_schema is None
        blocks = [
            {"type": "text", "text": "it is 12:00"},
            {"type": "image", "data": "aGk=", "mimeType": "image/png"},
            {"type": "resource_link", "uri": "file:///x", "name": "x"},
        ]
        answer = logic.call_result(success("c4", {"content": blocks}), spec)
        assert answer.is_error is False and answer.structured_content is None
        assert [
            b.model_dump(mode="json", by_alias=True, exclude_none=True) for b in answer.content
        ] == blocks
        # Not MCP content after all: JSON text, as any data.
        odd = logic.call_result(success("c5", {"content": [{"type": "nope"}]}), spec)
        assert json.loads(odd.content[0].text) == {"content": [{"type": "nope"}]}  # type: ignore[union-attr]
        # A tool of our own with such a schema is not an upstream's: JSON as before.
        own = ToolSpec.model_validate({**UPSTREAM_PLAIN, "mcp": None, "function": "x:y"})
        assert not logic.passes_content(own)

    def test_an_upstream_result_carries_its_provenance(self) -> None:
        result = ToolResult(
            call_id="c3",
            ok=True,
            status="ok",
            data={"v": 1},
            provenance=Provenance(source="mcp", server="http://u/mcp", tool="t"),
        )
        answer = logic.call_result(result)
        assert answer.meta is not None
        assert answer.meta[logic.PROVENANCE_META_KEY] == {
            "source": "mcp",
            "server": "http://u/mcp",
            "tool": "t",
            "trust": "untrusted",
        }

    def test_a_result_without_provenance_encodes_as_before(self) -> None:
        import msgspec

        assert msgspec.json.decode(msgspec.json.encode(success("c", 1))) == {
            "call_id": "c",
            "ok": True,
            "status": "ok",
            "data": 1,
            "error": None,
        }


def test_a_token_file_is_not_mistaken_for_an_agent_record(tmp_path: Path) -> None:
    from toolgate.stack.nats_auth import add_agent, list_agents, revoke_agent

    add_agent(tmp_path, "acme", "researcher")
    token = mint_token(tmp_path, "acme", "researcher")
    assert [(r.tenant, r.agent) for r in list_agents(tmp_path)] == [("acme", "researcher")]
    assert TokenStore(tmp_path).identify(token) == ("acme", "researcher")
    revoke_agent(tmp_path, "acme", "researcher")
    assert TokenStore(tmp_path).identify(token) is None
    add_agent(tmp_path, "acme", "researcher")  # re-added: a new identity, the old token stays dead
    assert TokenStore(tmp_path).identify(token) is None


def test_token_holders_are_the_active_agents_with_a_current_token(tmp_path: Path) -> None:
    from toolgate.services.mcp_front.tokens import token_holders

    agent_record(tmp_path, "acme", "researcher", "U1")
    agent_record(tmp_path, "acme", "writer", "U2")
    agent_record(tmp_path, "acme", "idle", "U3")
    mint_token(tmp_path, "acme", "researcher")
    mint_token(tmp_path, "acme", "writer")
    assert token_holders(tmp_path) == [("acme", "researcher"), ("acme", "writer")]
    agent_record(tmp_path, "acme", "writer", "U2", revoked=True)
    assert token_holders(tmp_path) == [("acme", "researcher")]


def test_the_front_door_account_imports_only_the_token_holders_subjects(tmp_path: Path) -> None:
    from toolgate.runtime.creds import jwt_claims
    from toolgate.stack.nats_auth import (
        AuthKeys,
        add_agent,
        mcp_front_account_jwt,
        revoke_agent,
    )

    add_agent(tmp_path, "acme", "researcher")
    add_agent(tmp_path, "acme", "writer")
    mint_token(tmp_path, "acme", "researcher")

    def imported() -> list[str]:
        _, token = mcp_front_account_jwt(AuthKeys.load(tmp_path), tmp_path)
        return sorted(i["subject"] for i in jwt_claims(token)["nats"].get("imports") or [])

    assert imported() == [
        "$JS.API.DIRECT.GET.TOOLGATE_RESULTS.toolgate.results.acme.researcher.>",
        "toolgate.calls.acme.researcher",
        "toolgate.results.acme.researcher.>",
        "toolgate.tools.acme.researcher",
    ]
    revoke_agent(tmp_path, "acme", "researcher")
    assert imported() == []


def test_the_traceparent_of_a_span_context() -> None:
    from opentelemetry.trace import INVALID_SPAN_CONTEXT, SpanContext, TraceFlags

    span = SpanContext(
        trace_id=0x0AF7651916CD43DD8448EB211C80319C,
        span_id=0xB7AD6B7169203331,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
    )
    assert (
        logic.traceparent_of_span(span) == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    )
    assert logic.traceparent_of_span(INVALID_SPAN_CONTEXT) is None
    assert logic.traceparent_of_span(None) is None


@pytest.mark.parametrize(
    ("header", "handshake"),
    [
        (None, True),  # no header: an `initialize` or a handshake-era client
        ("2025-11-25", True),
        ("2025-06-18", True),
        ("2026-07-28", False),
        ("1999-01-01", False),  # unknown: the SDK's modern entry answers it with its error
    ],
)
def test_the_era_of_a_request_is_the_sdks_own_rule(header: str | None, handshake: bool) -> None:
    assert logic.handshake_era(header) is handshake


def test_only_a_body_with_a_progress_token_asks_for_the_stream() -> None:
    plain = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}}
    assert not logic.wants_stream(json.dumps(plain).encode())
    asked = {**plain, "params": {"name": "echo", "_meta": {"progressToken": 7}}}
    assert logic.wants_stream(json.dumps(asked).encode())
    # Anywhere in the body: the stream, which is never wrong, only slower.
    in_arguments = {**plain, "params": {"name": "echo", "arguments": {"progressToken": 1}}}
    assert logic.wants_stream(json.dumps(in_arguments).encode())
    assert not logic.wants_stream(b"")


class TestRetries:
    """Calls without a client call_id: a retry joins the call or collects its result."""

    def minted(self) -> Any:
        counter = iter(range(1, 100))
        return lambda: f"call_{next(counter)}"

    def test_a_retry_while_the_first_waits_for_a_human_joins_it(self) -> None:
        retries, mint = logic.Retries(), self.minted()
        assert retries.claim("k", 0.0, mint) == ("call_1", True)
        retries.waits_for_human("k", "call_1")
        assert retries.claim("k", 0.1, mint) == ("call_1", False)
        # Another call is another call.
        assert retries.claim("other", 0.1, mint) == ("call_2", True)

    def test_an_identical_call_at_the_same_moment_is_a_call_of_its_own(self) -> None:
        retries, mint = logic.Retries(join_after_s=1.0), self.minted()
        assert retries.claim("k", 0.0, mint) == ("call_1", True)
        assert retries.claim("k", 0.5, mint) == ("call_2", True)
        # One in flight for a while is joined.
        assert retries.claim("k", 1.6, mint) == ("call_2", False)

    def test_a_delivered_result_ends_the_entry(self) -> None:
        retries, mint = logic.Retries(), self.minted()
        call_id, _ = retries.claim("k", 0.0, mint)
        retries.ended("k", call_id, 5.0, delivered=True)
        assert retries.claim("k", 6.0, mint) == ("call_2", True)

    def test_an_undelivered_result_goes_to_the_next_identical_call_within_the_window(
        self,
    ) -> None:
        retries, mint = logic.Retries(window_s=600.0), self.minted()
        call_id, _ = retries.claim("k", 0.0, mint)
        retries.ended("k", call_id, 5.0, delivered=False)
        assert retries.claim("k", 604.0, mint) == ("call_1", False)
        retries.ended("k", call_id, 605.0, delivered=False)
        # Past the window: a new call.
        assert retries.claim("k", 605.0 + 601.0, mint) == ("call_2", True)

    def test_the_entry_waits_for_its_last_handler(self) -> None:
        retries, mint = logic.Retries(), self.minted()
        retries.claim("k", 0.0, mint)
        retries.waits_for_human("k", "call_1")
        retries.claim("k", 1.0, mint)  # joined
        retries.ended("k", "call_1", 2.0, delivered=False)  # the first client gave up
        assert retries.entries["k"].undelivered_at is None
        retries.ended("k", "call_1", 3.0, delivered=True)  # the retry got it
        assert "k" not in retries.entries

    def test_the_key_is_who_asks_what(self) -> None:
        key = logic.call_key("acme", "a", "t", {"x": 1, "y": 2}, "u", "s", None)
        assert key == logic.call_key("acme", "a", "t", {"y": 2, "x": 1}, "u", "s", None)
        for other in (
            ("acme", "b", "t", {"x": 1, "y": 2}, "u", "s", None),
            ("acme", "a", "t", {"x": 1, "y": 3}, "u", "s", None),
            ("acme", "a", "t", {"x": 1, "y": 2}, "v", "s", None),
            ("acme", "a", "t", {"x": 1, "y": 2}, "u", "s", "task_1"),
        ):
            assert logic.call_key(*other) != key  # type: ignore[arg-type]


class TestTasks:
    def test_only_a_modern_client_that_declared_the_extension_gets_tasks(self) -> None:
        import mcp_types as types

        declared = types.ClientCapabilities(extensions={logic.TASKS_EXTENSION: {}})
        assert logic.wants_tasks("2026-07-28", declared)
        assert not logic.wants_tasks("2025-11-25", declared)
        assert not logic.wants_tasks("2026-07-28", types.ClientCapabilities())
        assert not logic.wants_tasks("2026-07-28", None)

    def test_the_task_id_is_the_call(self) -> None:
        task_id = logic.task_id_of("approved_action", "call_1")
        assert logic.call_of_task(task_id) == ("approved_action", "call_1")
        for bad in ("", "call_1", "a.b.c", ".x", 5, "t.bad id"):
            with pytest.raises(logic.BadMeta):
                logic.call_of_task(bad)

    def test_a_task_body_is_flat_with_its_result(self) -> None:
        body = logic.task_body(
            "t.c",
            "completed",
            created_at="a",
            updated_at="b",
            ttl_s=60,
            result=logic.call_result(success("c", {"v": 1})),
        )
        assert body["taskId"] == "t.c" and body["status"] == "completed"
        assert body["ttlMs"] == 60_000 and "pollIntervalMs" not in body
        assert body["result"]["structuredContent"] == {"v": 1}
        working = logic.task_body("t.c", "working", created_at="a", updated_at="b", ttl_s=None)
        assert working["pollIntervalMs"] == logic.TASK_POLL_INTERVAL_MS


def test_only_a_schema_with_an_x_mcp_header_has_mcp_param_headers_to_check() -> None:
    plain = {"type": "object", "properties": {"payload": {"type": "string"}}}
    nested = {
        "type": "object",
        "properties": {
            "where": {
                "type": "object",
                "properties": {"region": {"type": "string", "x-mcp-header": "Region"}},
            }
        },
    }
    in_a_list = {"anyOf": [plain, {"properties": {"a": {"x-mcp-header": "A"}}}]}
    assert not logic.declares_mcp_headers(plain)
    assert not logic.declares_mcp_headers({})
    assert not logic.declares_mcp_headers(None)
    assert logic.declares_mcp_headers(nested)
    assert logic.declares_mcp_headers(in_a_list)
