"""The executor's function for `http:` entries against real HTTP servers on loopback: a
backend that records what it receives and an OAuth server issuing JWTs (tests/http_support).

The function is resolved from a registry entry as the executor does and run under
`run_tool`, so the outcome is what the executor publishes. Token exchange is driven here
with a ToolContext that carries the user's verified token, as the executor builds it once
OIDC is configured (#23.1-2); tests/system/test_http_tools.py drives the whole gateway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.http_support import GRANT_TOKEN_EXCHANGE, Backend, TokenServer
from toolgate.contracts.calls import Principal
from toolgate.contracts.registry import ToolSpec
from toolgate.contracts.tooling import ToolContext
from toolgate.services.executor.http_auth import PROCESS_TOKENS
from toolgate.services.executor.logic import ToolOutcome, resolve_function, run_tool

CLIENT_ID, CLIENT_SECRET = "toolgate-gw", "gw-secret-8c1d4e2f9a"
STATIC_TOKEN = "static-bearer-5e7b1c9d3f"
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-2")
POOL = ThreadPoolExecutor(max_workers=2)


@pytest.fixture(autouse=True)
def no_tokens_kept() -> None:
    """Each test starts with the executor process's token cache empty."""
    PROCESS_TOKENS.clear()


@pytest.fixture(scope="module")
def backend() -> Iterator[Backend]:
    server = Backend()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def other_host() -> Iterator[Backend]:
    """Another origin (another port): a redirect there must not be followed."""
    server = Backend()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def idp() -> Iterator[TokenServer]:
    server = TokenServer(clients={CLIENT_ID: CLIENT_SECRET})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("secrets")
    (folder / "bearer").write_text(STATIC_TOKEN + "\n")
    (folder / "client_secret").write_text(CLIENT_SECRET)
    (folder / "wrong_secret").write_text("not-the-secret-0000")
    return folder


def spec_for(url: str, method: str = "GET", auth: dict[str, Any] | None = None, **http: Any):  # type: ignore[no-untyped-def]
    return ToolSpec.model_validate(
        {
            "name": "api_call",
            "description": "One HTTP request. Test only.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "item_id": {"type": "string"},
                    "q": {"type": "string"},
                    "n": {"type": "integer"},
                    "payload": {"type": "object"},
                },
                "required": ["item_id"],
            },
            "output_schema": {},
            "http": {"method": method, "url": url, **({"auth": auth} if auth else {}), **http},
            "read_only": method in ("GET", "HEAD"),
            "timeout_s": 10,
            "risk": "low",
            "allowed_agents": ["*"],
        }
    )


def ctx_for(
    tmp_path: Path, principal: Principal = ALICE, subject_token: str | None = None
) -> ToolContext:
    return ToolContext(
        call_id="c-1",
        tool="api_call",
        principal=principal,
        task_id=None,
        data_dir=tmp_path,
        subject_token=subject_token,
    )


def run(spec: ToolSpec, arguments: dict[str, Any], ctx: ToolContext) -> ToolOutcome:
    return asyncio.run(run_tool(resolve_function(spec), arguments, ctx, spec, POOL))


def client_credentials(secrets: Path, idp: TokenServer, secret: str = "client_secret") -> dict:
    return {
        "oauth_client_credentials": {
            "token_endpoint": idp.token_endpoint,
            "client_id": CLIENT_ID,
            "client_secret_file": str(secrets / secret),
            "scope": "orders.read",
        }
    }


def token_exchange(secrets: Path, idp: TokenServer, audience: str = "orders-api") -> dict:
    return {
        "token_exchange": {
            "token_endpoint": idp.token_endpoint,
            "audience": audience,
            "client_id": CLIENT_ID,
            "client_secret_file": str(secrets / "client_secret"),
        }
    }


class TestRequests:
    def test_a_get_sends_the_path_and_query_with_the_bearer_from_a_file(
        self, backend: Backend, secrets: Path, tmp_path: Path
    ) -> None:
        spec = spec_for(
            f"{backend.url}/items/{{item_id}}",
            auth={"bearer_file": str(secrets / "bearer")},
            headers={"X-Api-Version": "2"},
        )
        outcome = run(spec, {"item_id": "a/b c", "q": "x&y", "n": 3}, ctx_for(tmp_path))
        assert outcome.status == "ok", outcome.error
        got = backend.last()
        assert got.method == "GET" and got.path == "/items/a%2Fb%20c?n=3&q=x%26y"
        assert got.bearer == STATIC_TOKEN and got.headers["x-api-version"] == "2"
        assert outcome.output == {"method": "GET", "path": got.path, "body": None}

    def test_a_post_sends_the_other_arguments_as_json(
        self, backend: Backend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("API_TOKEN_FOR_TEST", "env-token-1")
        spec = spec_for(
            f"{backend.url}/items/{{item_id}}",
            "POST",
            auth={"bearer_env": "API_TOKEN_FOR_TEST"},
            query=["q"],
        )
        outcome = run(
            spec, {"item_id": "i1", "q": "v", "payload": {"a": [1, "é"]}}, ctx_for(tmp_path)
        )
        assert outcome.status == "ok", outcome.error
        got = backend.last()
        assert (got.method, got.path) == ("POST", "/items/i1?q=v")
        assert got.json == {"payload": {"a": [1, "é"]}}
        assert got.headers["content-type"] == "application/json"
        assert got.bearer == "env-token-1"

    def test_an_empty_answer_is_null_and_head_reads_no_body(
        self, backend: Backend, tmp_path: Path
    ) -> None:
        assert (
            run(spec_for(f"{backend.url}/empty"), {"item_id": "x"}, ctx_for(tmp_path)).output
            is None
        )
        head = run(
            spec_for(f"{backend.url}/h/{{item_id}}", "HEAD"), {"item_id": "x"}, ctx_for(tmp_path)
        )
        assert head.status == "ok" and head.output is None and backend.last().method == "HEAD"


class TestAnswers:
    @pytest.mark.parametrize(
        "code, retryable", [(404, False), (400, False), (403, False), (429, True), (503, True)]
    )
    def test_a_status_other_than_2xx_is_an_execution_error_quoting_the_body_safely(
        self, backend: Backend, secrets: Path, tmp_path: Path, code: int, retryable: bool
    ) -> None:
        spec = spec_for(
            f"{backend.url}/status/{code}", auth={"bearer_file": str(secrets / "bearer")}
        )
        outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path))
        assert outcome.status == "execution_error" and outcome.error is not None
        assert outcome.error.code == "UPSTREAM_HTTP_ERROR"
        assert outcome.error.retryable is retryable
        message = outcome.error.message
        assert f"answered HTTP {code}" in message and "you sent Bearer [redacted]" in message
        # The backend echoed the credential and a terminal escape: neither is passed on.
        assert STATIC_TOKEN not in message and "\x1b" not in message

    def test_a_redirect_to_another_host_is_not_followed_one_to_the_same_host_is(
        self, backend: Backend, other_host: Backend, secrets: Path, tmp_path: Path
    ) -> None:
        auth = {"bearer_file": str(secrets / "bearer")}
        before = len(other_host.received)
        away = run(
            spec_for(f"{backend.url}/redirect?to={other_host.url}/steal", auth=auth),
            {"item_id": "x"},
            ctx_for(tmp_path),
        )
        assert away.status == "execution_error" and away.error is not None
        assert away.error.code == "UPSTREAM_BAD_RESPONSE" and "another host" in away.error.message
        assert len(other_host.received) == before  # the credential never went there
        same = run(
            spec_for(f"{backend.url}/redirect?to={backend.url}/landed", auth=auth),
            {"item_id": "x"},
            ctx_for(tmp_path),
        )
        assert same.status == "ok" and backend.last().path.startswith("/landed")
        assert backend.last().bearer == STATIC_TOKEN

    @pytest.mark.parametrize(
        "path, words", [("/big", "more than 1048576 bytes"), ("/text", "text/plain")]
    )
    def test_a_body_too_large_or_not_json_is_refused(
        self, backend: Backend, tmp_path: Path, path: str, words: str
    ) -> None:
        outcome = run(spec_for(f"{backend.url}{path}"), {"item_id": "x"}, ctx_for(tmp_path))
        assert outcome.status == "execution_error" and outcome.error is not None
        assert outcome.error.code == "UPSTREAM_BAD_RESPONSE" and words in outcome.error.message
        assert outcome.error.retryable is False

    def test_an_unreachable_backend_is_retryable(self, tmp_path: Path) -> None:
        from toolgate.stack.supervisor import free_port

        spec = spec_for(f"http://127.0.0.1:{free_port()}/x")
        outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path))
        assert outcome.status == "execution_error" and outcome.error is not None
        assert outcome.error.code == "UPSTREAM_HTTP_ERROR" and outcome.error.retryable


def test_a_backend_slower_than_the_entrys_timeout_is_a_retryable_error(
    backend: Backend, tmp_path: Path
) -> None:
    spec = spec_for(f"{backend.url}/slow", timeout=0.2)
    outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path))
    assert outcome.status == "execution_error" and outcome.error is not None
    assert outcome.error.code == "UPSTREAM_HTTP_ERROR" and outcome.error.retryable
    assert "did not answer within 0.2s" in outcome.error.message


class TestClientCredentials:
    def test_the_gateway_token_is_fetched_once_and_sent(
        self, backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path
    ) -> None:
        spec = spec_for(f"{backend.url}/cc/{{item_id}}", auth=client_credentials(secrets, idp))
        function = resolve_function(spec)
        before = len(idp.grants)

        async def twice() -> list[ToolOutcome]:
            return [
                await run_tool(function, {"item_id": str(i)}, ctx_for(tmp_path), spec, POOL)
                for i in range(2)
            ]

        outcomes = asyncio.run(twice())
        assert [o.status for o in outcomes] == ["ok", "ok"]
        grants = idp.grants[before:]
        assert len(grants) == 1  # cached for the second call
        assert (
            grants[0].grant_type == "client_credentials"
            and grants[0].form["scope"] == "orders.read"
        )
        claims = idp.verify(backend.last().bearer or "")
        assert claims["sub"] == CLIENT_ID and backend.last().bearer == grants[0].issued

    def test_a_refused_client_is_an_error_that_names_no_secret(
        self, backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path
    ) -> None:
        received = len(backend.received)
        spec = spec_for(f"{backend.url}/x", auth=client_credentials(secrets, idp, "wrong_secret"))
        outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path))
        assert outcome.status == "execution_error" and outcome.error is not None
        assert outcome.error.code == "UPSTREAM_AUTH_FAILED" and not outcome.error.retryable
        assert "HTTP 401 invalid_client" in outcome.error.message
        assert "not-the-secret" not in outcome.error.message
        assert len(backend.received) == received  # never called without its credential

    def test_a_missing_secret_file_is_refused_naming_the_file(
        self, backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path
    ) -> None:
        spec = spec_for(f"{backend.url}/x", auth=client_credentials(secrets, idp, "absent"))
        outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path))
        assert outcome.error is not None and outcome.error.code == "UPSTREAM_AUTH_FAILED"
        assert str(secrets / "absent") in outcome.error.message


class TestTokenExchange:
    """RFC 8693 on the user's behalf. Runs today with a ToolContext carrying the user's
    token; the whole-gateway version is in tests/system/test_http_tools.py (needs OIDC)."""

    def test_the_backend_gets_an_exchanged_token_for_the_user_never_the_users_own(
        self, backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path
    ) -> None:
        spec = spec_for(f"{backend.url}/mine/{{item_id}}", auth=token_exchange(secrets, idp))
        function = resolve_function(spec)
        alice_token = idp.user_token("u-alice")
        bob_token = idp.user_token("u-bob")
        before = len(idp.grants)

        async def calls() -> list[tuple[ToolOutcome, str | None]]:
            seen = []
            for principal, token in ((ALICE, alice_token), (ALICE, alice_token), (BOB, bob_token)):
                outcome = await run_tool(
                    function, {"item_id": "o1"}, ctx_for(tmp_path, principal, token), spec, POOL
                )
                seen.append((outcome, backend.last().bearer))
            return seen

        seen = asyncio.run(calls())
        assert [o.status for o, _ in seen] == ["ok", "ok", "ok"]
        (_, first), (_, second), (_, for_bob) = seen
        assert first not in (alice_token, None) and first == second  # cached per user
        claims = idp.verify(first or "", audience="orders-api")
        assert claims["sub"] == "u-alice" and claims["act"] == {"sub": CLIENT_ID}
        assert idp.verify(for_bob or "", audience="orders-api")["sub"] == "u-bob"
        grants = idp.grants[before:]
        assert [g.grant_type for g in grants] == [GRANT_TOKEN_EXCHANGE] * 2
        assert grants[0].form["subject_token"] == alice_token
        assert grants[0].form["audience"] == "orders-api"

    def test_without_a_user_token_the_call_is_refused_and_nothing_is_sent(
        self, backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path
    ) -> None:
        received, grants = len(backend.received), len(idp.grants)
        spec = spec_for(f"{backend.url}/x", auth=token_exchange(secrets, idp))
        outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path, subject_token=None))
        assert outcome.status == "execution_error" and outcome.error is not None
        assert outcome.error.code == "USER_TOKEN_REQUIRED" and not outcome.error.retryable
        assert len(backend.received) == received and len(idp.grants) == grants

    def test_a_refused_exchange_never_quotes_the_users_token(
        self, backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path
    ) -> None:
        forged = idp.user_token("u-alice")[:-6] + "AAAAAA"  # a bad signature
        spec = spec_for(f"{backend.url}/x", auth=token_exchange(secrets, idp))
        outcome = run(spec, {"item_id": "x"}, ctx_for(tmp_path, subject_token=forged))
        assert outcome.error is not None and outcome.error.code == "UPSTREAM_AUTH_FAILED"
        assert "invalid_grant" in outcome.error.message
        assert forged not in outcome.error.message and "[redacted]" in outcome.error.message


@pytest.mark.parametrize("kind", ["bearer_file", "oauth_client_credentials"])
def test_an_mcp_upstream_gets_the_entrys_auth(
    backend: Backend, idp: TokenServer, secrets: Path, tmp_path: Path, kind: str
) -> None:
    """The `auth` of an `mcp:` entry: the Authorization header of its requests. The
    recording backend is no MCP server, so the call fails after the header is seen."""
    auth = (
        {"bearer_file": str(secrets / "bearer")}
        if kind == "bearer_file"
        else client_credentials(secrets, idp)
    )
    grants = len(idp.grants)
    spec = ToolSpec.model_validate(
        {
            "name": "up_lookup",
            "description": "An upstream MCP tool. Test only.",
            "input_schema": {"type": "object"},
            "output_schema": {},
            "mcp": {
                "url": f"{backend.url}/mcp",
                "tool": "lookup",
                "definition_sha256": "0" * 64,
                "auth": auth,
            },
            "read_only": True,
            "timeout_s": 10,
            "risk": "low",
            "allowed_agents": ["*"],
        }
    )
    received = len(backend.received)
    outcome = run(spec, {}, ctx_for(tmp_path))
    assert outcome.status == "execution_error"
    sent = backend.received[received:]
    expected = STATIC_TOKEN if kind == "bearer_file" else idp.grants[grants].issued
    assert sent and all(r.bearer == expected for r in sent)
