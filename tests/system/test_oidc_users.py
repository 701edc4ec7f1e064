"""End users verified by OIDC, through the whole gateway, against a real OpenID provider.

The gateway runs with `--oidc-issuer` naming the tests' provider (tests/oidc_provider.py,
built with authlib: discovery, JWKS, token endpoint on a loopback port). Calls carry the
user's access token in the NATS header `Authorization: Bearer <JWT>`. A valid token
makes the principal's user its `sub` and reaches the tool (`ToolContext.subject_token`);
forged, expired, wrong-audience and wrong-tenant tokens, a missing token and a payload
naming another user are denied with their codes; a rotated key is fetched; a provider
that is down fails closed; a token that expires while a human decides ends the call
USER_TOKEN_EXPIRED. Then every token used is searched for in every ClickHouse table,
every log file, the dead letters and the events stream: none is found.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx2
import nats
import pytest

from tests.harness import Gateway, make_test_registry
from tests.mcp_support import (
    agent_token,
    mcp_client,
    structured,
    toolgate,
    wait_for_front_door,
)
from tests.oidc_provider import JsonWebKey, OpenIdProvider
from tests.system.test_audit_redaction import audited_everything
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import ErrorCode, ToolResult
from toolgate.contracts.events import MessageDeadLettered
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient

pytestmark = pytest.mark.system

AUD = "toolgate-gateway"
WHOAMI = """
name: {name}
description: Says which user it runs for and which token it got (its hash). Test only.
function: tests.tools.users:whoami
input_schema: {{type: object, properties: {{n: {{type: integer}}}}, additionalProperties: false}}
output_schema:
  type: object
  properties: {{user: {{type: string}}, token_sha256: {{type: string}}}}
  required: [user, token_sha256]
read_only: {read_only}
timeout_s: 5
risk: {risk}
requires_approval: {approval}
acts_for_user: {acts}
allowed_agents: ["*"]
audit: {{arguments: full, result: full}}
"""
# Every token a test sent: none may be found at rest afterwards.
USED: list[str] = []


@pytest.fixture(scope="module")
def provider() -> Iterator[OpenIdProvider]:
    started = OpenIdProvider().start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def oidc_gateway(
    tmp_path_factory: pytest.TempPathFactory, provider: OpenIdProvider
) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("oidc")
    registry = make_test_registry(base / "registry")
    for name, read_only, risk, approval, acts in (
        ("whoami", "true", "low", "false", "true"),
        ("whoami_approved", "false", "high", "true", "true"),
        ("public_probe", "true", "low", "false", "false"),
    ):
        (registry / f"{name}.yaml").write_text(
            WHOAMI.format(name=name, read_only=read_only, risk=risk, approval=approval, acts=acts)
        )
    gateway = Gateway(with_mcp=True, data_dir=base / "data", registry_dir=registry, with_audit=True)
    gateway.stack.oidc_args = [
        "--oidc-issuer",
        provider.issuer,
        "--oidc-audience",
        AUD,
        "--oidc-clock-skew",
        "0",
    ]
    yield gateway.start()
    gateway.stop()


def token(provider: OpenIdProvider, **fields: object) -> str:
    found = provider.token(**({"sub": "u-alice", "aud": AUD, "tenant": "acme"} | fields))
    USED.append(found)
    return found


async def call(
    gateway: Gateway, tool: str, user_token: str | None, user: str = "", timeout: float = 60
) -> ToolResult:
    async with await gateway.client() as client:
        return await client.call(
            tool, {}, user=user, session="s-1", user_token=user_token, timeout=timeout
        )


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_valid_token_makes_its_sub_the_user_and_reaches_the_tool(
    oidc_gateway: Gateway, provider: OpenIdProvider
) -> None:
    alice = token(provider)
    result = asyncio.run(call(oidc_gateway, "whoami", alice))
    assert result.ok, result
    assert result.data == {"user": "u-alice", "token_sha256": sha(alice)}
    named = asyncio.run(call(oidc_gateway, "whoami", alice, user="u-alice"))
    assert named.ok and named.data["user"] == "u-alice"
    # the sealed copy is gone once the tool has run
    assert asyncio.run(sealed_entries(oidc_gateway)) == []


def test_the_cli_sends_a_token_from_a_file(
    oidc_gateway: Gateway, provider: OpenIdProvider, tmp_path: Path
) -> None:
    alice = token(provider)
    (tmp_path / "alice.token").write_text(alice + "\n")
    creds = asyncio.run(oidc_gateway.agent_creds())
    common = ["--data-dir", str(oidc_gateway.data_dir), "--creds", str(creds)]
    done = toolgate(
        "call", "whoami", "{}", "--user-token-file", str(tmp_path / "alice.token"), *common
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["data"] == {"user": "u-alice", "token_sha256": sha(alice)}
    without = toolgate("call", "whoami", "{}", *common)
    assert without.returncode == 1 and "USER_TOKEN_REQUIRED" in without.stdout


def test_bad_tokens_are_denied_with_their_codes(
    oidc_gateway: Gateway, provider: OpenIdProvider
) -> None:
    forger = JsonWebKey.generate_key("RSA", 2048, is_private=True)
    forger = JsonWebKey.import_key(
        forger.as_dict(is_private=True) | {"kid": provider.signing_key.as_dict()["kid"]}
    )
    forged = provider.sign(provider.claims("u-alice", AUD, "acme"), forger)
    USED.append(forged)
    cases = {
        "forged": (forged, "", ErrorCode.USER_TOKEN_INVALID),
        "expired": (token(provider, expires_in=-600), "", ErrorCode.USER_TOKEN_EXPIRED),
        "audience": (token(provider, aud="other"), "", ErrorCode.USER_TOKEN_WRONG_AUDIENCE),
        "tenant": (token(provider, tenant="globex"), "", ErrorCode.USER_TOKEN_WRONG_TENANT),
        "no tenant": (token(provider, tenant=""), "", ErrorCode.USER_TOKEN_WRONG_TENANT),
        "missing": (None, "u-alice", ErrorCode.USER_TOKEN_REQUIRED),
        "other user": (token(provider), "u-bob", ErrorCode.USER_MISMATCH),
    }
    for name, (user_token, user, code) in cases.items():
        result = asyncio.run(call(oidc_gateway, "whoami", user_token, user=user))
        assert (result.status, result.error and result.error.code) == ("denied", code), name
        assert not result.error.retryable, name
    # a tool that acts for no user needs no token; the user stays the platform's word
    public = asyncio.run(call(oidc_gateway, "public_probe", None, user="u-carol"))
    assert public.ok and public.data == {"user": "u-carol", "token_sha256": ""}


def test_a_token_that_expires_while_a_human_decides_ends_the_call(
    oidc_gateway: Gateway, provider: OpenIdProvider
) -> None:
    short = token(provider, expires_in=6)
    expires_at = json.loads(__import__("base64").urlsafe_b64decode(short.split(".")[1] + "=="))[
        "exp"
    ]
    approver = add_approver(oidc_gateway.data_dir, f"carol-{uuid.uuid4().hex[:6]}", ["acme"])

    async def scenario() -> ToolResult:
        options = connect_options(oidc_gateway.stack.creds_of("inbox"))
        async with (
            await oidc_gateway.client() as client,
            await ApprovalsClient.connect(oidc_gateway.url, token=approver, **options) as approvals,
        ):
            call_id = new_call_id()
            submitted = asyncio.create_task(
                client.call(
                    "whoami_approved",
                    {},
                    session="s",
                    user_token=short,
                    call_id=call_id,
                    timeout=120,
                )
            )
            key = subjects.call_key("acme", "researcher", call_id)
            state = None
            while state is None:
                state = await approvals.get(key)
                await asyncio.sleep(0.1)
            assert state.call.principal.user == "u-alice"  # the sub, as the human sees it
            # the token's own expiry passes
            await asyncio.sleep(max(0.0, expires_at - time.time()) + 1)
            granted = await approvals.vote(
                key, "approve", arguments_sha256=state.arguments_sha256, reason="ok"
            )
            assert granted.accepted
            return await submitted

    result = asyncio.run(scenario())
    assert result.status == "denied" and result.error is not None
    assert result.error.code == ErrorCode.USER_TOKEN_EXPIRED and result.error.retryable


async def test_the_front_door_is_an_oauth_resource_server(
    oidc_gateway: Gateway, provider: OpenIdProvider
) -> None:
    url = await wait_for_front_door(oidc_gateway)
    answer = await post_initialize(url, {})
    assert answer.status_code == 401
    challenge = answer.headers["www-authenticate"]
    assert challenge.startswith("Bearer ") and "resource_metadata=" in challenge
    metadata_url = challenge.split('resource_metadata="', 1)[1].split('"', 1)[0]
    async with httpx2.AsyncClient() as http:
        metadata = (await http.get(metadata_url)).json()
    assert metadata["resource"] == url
    assert metadata["authorization_servers"] == [provider.issuer]
    await agent_token(oidc_gateway, "acme", "researcher")  # the door acts for this agent
    # issued for the door (and the gateway: the door passes it on as the user's token)
    both = token(provider, sub="u-erin", aud=f"{url} {AUD}", agent="researcher")
    async with mcp_client(url, both) as client:
        result = structured(await client.call_tool("whoami", {}))
    assert result == {"user": "u-erin", "token_sha256": sha(both)}
    refused = {
        "gateway audience only": token(provider, sub="u-erin", agent="researcher"),
        "another audience": token(provider, aud="elsewhere", agent="researcher"),
        "an agent the door does not act for": token(provider, aud=url, agent="ghost"),
        "another tenant": token(provider, aud=url, tenant="globex", agent="researcher"),
        "expired": token(provider, aud=url, agent="researcher", expires_in=-600),
    }
    for name, bad in refused.items():
        answer = await post_initialize(url, {"Authorization": f"Bearer {bad}"})
        assert answer.status_code == 401, name
        assert "resource_metadata=" in answer.headers["www-authenticate"], name
    # the operator's static token still works beside OAuth
    static = await agent_token(oidc_gateway, "acme", "researcher")
    assert (await post_initialize(url, {"Authorization": f"Bearer {static}"})).status_code == 200


async def post_initialize(url: str, headers: dict[str, str]) -> httpx2.Response:
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-11-25",
            "capabilities": {},
            "clientInfo": {"name": "test", "version": "0"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
    async with httpx2.AsyncClient() as http:
        return await http.post(url, json=body, headers={**accept, **headers})


def test_a_rotated_key_is_fetched_and_a_provider_down_fails_closed(
    oidc_gateway: Gateway, provider: OpenIdProvider
) -> None:
    provider.rotate(keep_old=False)
    rotated = token(provider, sub="u-dan")
    result = asyncio.run(call(oidc_gateway, "whoami", rotated))
    assert result.ok and result.data["user"] == "u-dan", result
    # A bad call with the token in its header: dead-lettered, the token kept nowhere.
    asyncio.run(publish_raw(oidc_gateway, b'{"call_id": "' + new_call_id().encode(), rotated))
    provider.rotate(keep_old=False)
    unknown_key = token(provider)
    provider.stop()
    down = asyncio.run(call(oidc_gateway, "whoami", unknown_key))
    assert down.status == "denied" and down.error is not None
    assert down.error.code == ErrorCode.USER_TOKEN_UNVERIFIABLE and down.error.retryable


def test_no_token_rests_in_the_audit_logs_dead_letters_or_events(oidc_gateway: Gateway) -> None:
    assert len(USED) >= 10
    asyncio.run(audited_everything(oidc_gateway))
    client = oidc_gateway.audit_client()
    tables = [r[0] for r in client.query("SHOW TABLES").result_rows]
    assert "event_log" in tables
    dump = "\n".join(
        client.raw_query(f"SELECT * FROM `{table}` FORMAT TSVRaw").decode(errors="replace")
        for table in tables
    )
    assert "u-alice" in dump and "USER_TOKEN_INVALID" in dump  # the calls are there
    logs = [p for p in oidc_gateway.data_dir.rglob("*.log") if p.is_file()]
    assert any(p.name == "validator.log" for p in logs)
    events = asyncio.run(oidc_gateway.events())
    letters = [e for e in events if isinstance(e, MessageDeadLettered)]
    assert letters
    raw_events = asyncio.run(stream_bytes(oidc_gateway, subjects.EVENTS_STREAM))
    for used in USED:
        for part in (used, used.split(".")[2]):  # the token, and its signature alone
            assert part not in dump
            assert not [p for p in logs if part in p.read_text(errors="replace")]
            assert all(part not in e.reason for e in letters)
            assert part.encode() not in raw_events
    sealed = asyncio.run(sealed_values(oidc_gateway))
    assert not [v for v in sealed for used in USED if used.encode() in v]


async def publish_raw(gateway: Gateway, body: bytes, user_token: str) -> None:
    creds = await gateway.agent_creds()
    nc = await nats.connect(nats_servers(gateway.url), **connect_options(creds))
    try:
        await nc.jetstream().publish(
            subjects.calls_subject("acme", "researcher"),
            body,
            stream=subjects.CALLS_STREAM,
            headers={"Authorization": f"Bearer {user_token}"},
        )
    finally:
        await nc.close()


async def stream_bytes(gateway: Gateway, stream: str) -> bytes:
    nc = await gateway.connect()
    try:
        jsm = nc.jsm()
        info = await jsm.stream_info(stream)
        found = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await jsm.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            found.append(msg.data or b"")
            found.append(json.dumps(dict(msg.headers or {})).encode())
        return b"\n".join(found)
    finally:
        await nc.close()


async def sealed_entries(gateway: Gateway) -> list[str]:
    nc = await gateway.connect()
    try:
        kv = await nc.jetstream().key_value(subjects.USER_TOKENS_BUCKET)
        try:
            return list(await kv.keys())
        except nats.js.errors.NoKeysError:
            return []
    finally:
        await nc.close()


async def sealed_values(gateway: Gateway) -> list[bytes]:
    return [
        b
        for b in (await stream_bytes(gateway, f"KV_{subjects.USER_TOKENS_BUCKET}")).split(b"\n")
        if b
    ]
