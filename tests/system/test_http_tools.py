"""HTTP APIs as tools through the whole gateway: docs/tools.md's worked example, run.

The page's OpenAPI document is imported with `toolgate tools import-openapi` (against a
recording backend and a JWT-issuing token endpoint the test starts on loopback, as
tests/http_support.py builds them), served by a whole gateway with its audit, and called
on the wire contract: the read runs at once, the write waits for an approver; the backend
sees the right method, path, query, body and bearer. Then the audit (every column of
every row) and every log are searched for the client secret and each token issued.

`test_token_exchange_end_to_end_as_the_verified_user` runs the gateway with an OIDC issuer
(`toolgate up --oidc-issuer`): the user's verified token is exchanged (RFC 8693), never sent.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
import yaml

from tests.docs.readme import all_blocks
from tests.harness import REPO_ROOT, Gateway, make_test_registry
from tests.http_support import Backend, TokenServer
from tests.mcp_support import toolgate
from tests.system.test_approval_flow import approvals_as, approver, waiting
from tests.system.test_audit_redaction import audited_everything
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, Provenance, ToolCall
from toolgate.runtime.creds import connect_options, nats_servers

pytestmark = pytest.mark.system

CLIENT_ID, CLIENT_SECRET = "toolgate", "shop-client-secret-4b8e1f0a7c"
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
HEADING = "HTTP APIs as tools (`http:` entries, `toolgate tools import-openapi`)"


@dataclass
class Shop:
    gateway: Gateway
    backend: Backend
    idp: TokenServer


def readme_example(folder: Path) -> Path:
    """Run the page's worked example's Python block in `folder`: it writes the OpenAPI
    document (and an auth file naming example hosts, replaced here)."""
    block = next(
        b for b in all_blocks(REPO_ROOT) if b.heading == HEADING and b.language == "python"
    )
    (folder / "example.py").write_text(block.text)
    subprocess.run([sys.executable, "example.py"], cwd=folder, check=True, timeout=60)
    return folder / "shop.openapi.yaml"


def hand_written(backend: Backend, auth: dict) -> dict[str, dict]:
    """Entries an operator writes by hand: one that answers 404 quoting the credential, one
    that acts for the user (token exchange)."""
    common = {
        "input_schema": {
            "type": "object",
            "properties": {"orderId": {"type": "string"}},
            "required": ["orderId"],
        },
        "output_schema": {"type": "object"},
        "read_only": True,
        "timeout_s": 20,
        "risk": "low",
        "allowed_agents": ["*"],
    }
    return {
        "shop_refused": {
            **common,
            "name": "shop_refused",
            "description": "Always answers 404. Test only.",
            "http": {"method": "GET", "url": f"{backend.url}/status/404", "auth": auth},
        },
        "shop_my_orders": {
            **common,
            "name": "shop_my_orders",
            "description": "Orders of the user, on the user's behalf. Test only.",
            "http": {
                "method": "GET",
                "url": f"{backend.url}/v1/mine/{{orderId}}",
                "auth": {
                    "token_exchange": {
                        "token_endpoint": auth["oauth_client_credentials"]["token_endpoint"],
                        "audience": "shop-api",
                        "client_id": CLIENT_ID,
                        "client_secret_file": auth["oauth_client_credentials"][
                            "client_secret_file"
                        ],
                    }
                },
            },
        },
    }


@pytest.fixture(scope="module")
def shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shop]:
    base = tmp_path_factory.mktemp("http-tools")
    backend, idp = Backend(), TokenServer(clients={CLIENT_ID: CLIENT_SECRET})
    gateway = None
    try:
        secret = base / "shop_client_secret"
        secret.write_text(CLIENT_SECRET)
        spec = readme_example(base)
        auth = {
            "oauth_client_credentials": {
                "token_endpoint": idp.token_endpoint,
                "client_id": CLIENT_ID,
                "client_secret_file": str(secret),
                "scope": "orders",
            }
        }
        (base / "auth.yaml").write_text(yaml.safe_dump(auth))
        out = str(base / "shop-tools")
        done = toolgate(
            *("tools", "import-openapi", str(spec), "--prefix", "shop", "--out", out),
            *("--base-url", f"{backend.url}/v1", "--auth", str(base / "auth.yaml")),
        )
        assert done.returncode == 0, done.stderr
        written = sorted(Path(line).name for line in done.stdout.split())
        assert written == ["shop_add_order_note.yaml", "shop_get_order.yaml"]
        registry = make_test_registry(base / "registry")
        for path in (base / "shop-tools").glob("*.yaml"):
            (registry / path.name).write_text(path.read_text())  # reviewed: kept as imported
        for name, entry in hand_written(backend, auth).items():
            (registry / f"{name}.yaml").write_text(yaml.safe_dump(entry))
        # (The notifier too: its log is one of those searched for the secrets.)
        gateway = Gateway(
            with_mcp=True,
            data_dir=base / "data",
            registry_dir=registry,
            with_audit=True,
            with_notifier=True,
        ).start()
        yield Shop(gateway, backend, idp)
    finally:
        if gateway is not None:
            gateway.stop()
        backend.stop()
        idp.stop()


def test_the_readme_example_from_openapi_to_governed_calls(shop: Shop) -> None:
    backend, idp = shop.backend, shop.idp
    backend.answers["/v1/orders/o-1"] = (200, {"id": "o-1", "status": "shipped"})
    backend.answers["/v1/orders/o-2"] = (200, {"id": "o-2", "status": "lost"})  # not in the enum
    backend.answers["/v1/orders/o-1/notes"] = (201, {"id": "n-1"})
    carol = approver(shop.gateway, "carol", "acme")

    async def calls() -> dict:
        async with await shop.gateway.client() as client:
            read = await client.call(
                "shop_get_order",
                {"orderId": "o-1", "expand": ["lines"]},
                principal=ALICE,
                timeout=60,
            )
            broken = await client.call(
                "shop_get_order", {"orderId": "o-2"}, principal=ALICE, timeout=60
            )
            refused = await client.call(
                "shop_refused", {"orderId": "x"}, principal=ALICE, timeout=60
            )
            mine = await client.call(
                "shop_my_orders", {"orderId": "x"}, principal=ALICE, timeout=60
            )
            note = ToolCall(
                call_id="call_n1",
                tool="shop_add_order_note",
                arguments={"orderId": "o-1", "body": {"text": "Leaves Monday"}},
                principal=ALICE,
            )
            async with await approvals_as(shop.gateway, carol) as approvals:
                submitted = asyncio.create_task(client.submit(note, timeout=120))
                state = await waiting(approvals, subjects.call_key("acme", "researcher", "call_n1"))
                posted_before = [r for r in backend.received if r.method == "POST"]
                vote = await approvals.vote(
                    state.key,
                    "approve",
                    arguments_sha256=arguments_sha256(note.arguments),
                    reason="ok",
                )
                assert vote.accepted, vote
                written = await submitted
        return dict(
            read=read, broken=broken, refused=refused, mine=mine, note=written, before=posted_before
        )

    got = asyncio.run(calls())
    read = got["read"]
    assert read.ok and read.data == {"id": "o-1", "status": "shipped"}, read
    assert read.provenance == Provenance(
        source="http", server=backend.url, tool="GET /v1/orders/{orderId}"
    )
    get = next(r for r in backend.received if r.path.startswith("/v1/orders/o-1?"))
    assert (get.method, get.path) == ("GET", "/v1/orders/o-1?expand=lines")
    claims = idp.verify(get.bearer or "")
    assert claims["sub"] == CLIENT_ID and claims["scope"] == "orders"
    # The output is checked against the schema the document declared.
    assert got["broken"].status == "invalid_tool_result", got["broken"]
    assert got["broken"].error.code == "OUTPUT_SCHEMA_VIOLATION"
    refused = got["refused"]
    assert refused.status == "execution_error" and refused.error.code == "UPSTREAM_HTTP_ERROR"
    assert "answered HTTP 404" in refused.error.message and "[redacted]" in refused.error.message
    assert not refused.error.retryable
    # Acting for the user needs the user's verified token; none came with this call.
    mine = got["mine"]
    assert mine.status == "execution_error" and mine.error.code == "USER_TOKEN_REQUIRED"
    assert not any(r.path.startswith("/v1/mine/") for r in backend.received)
    # The write waited for its approver: nothing was sent before the vote.
    assert got["before"] == []
    note = got["note"]
    assert note.ok and note.data == {"id": "n-1"}, note
    post = next(r for r in backend.received if r.method == "POST")
    assert post.path == "/v1/orders/o-1/notes" and post.json == {"text": "Leaves Monday"}
    assert post.bearer == get.bearer  # the gateway's token, fetched once and kept
    assert [g.grant_type for g in idp.grants] == ["client_credentials"]

    # httpx's own INFO line names every URL it requests: the arguments in the path and the
    # query (which an entry may audit as hashes only) are not logged.
    executor_log = (shop.gateway.data_dir / "logs" / "executor.log").read_text()
    assert "expand=lines" not in executor_log and "/v1/orders/o-1" not in executor_log
    asyncio.run(audited_everything(shop.gateway))
    assert_no_secret_anywhere(
        shop,
        [CLIENT_SECRET, *(g.issued for g in idp.grants if g.issued)],
        {"ExecutionSucceeded", "ExecutionFailed", "ApprovalGranted"},
    )


def assert_no_secret_anywhere(shop: Shop, secrets: list[str], kinds: set[str]) -> None:
    client = shop.gateway.audit_client()
    found = {r[0] for r in client.query("SELECT DISTINCT event_type FROM event_log").result_rows}
    assert kinds <= found  # the search below searches the right rows
    tables = [r[0] for r in client.query("SHOW TABLES").result_rows]
    assert "event_log" in tables
    everything = "\n".join(
        client.raw_query(f"SELECT * FROM `{table}` FORMAT TSVRaw").decode(errors="replace")
        for table in tables
    )
    logs = [p for p in shop.gateway.data_dir.rglob("*.log") if p.is_file()]
    assert any(p.name == "executor.log" for p in logs)
    for secret in secrets:
        assert secret not in everything
        assert [str(p) for p in logs if secret in p.read_text(errors="replace")] == []


def test_token_exchange_end_to_end_as_the_verified_user(tmp_path: Path) -> None:
    """A call as u-alice, her token in the NATS header, reaches
    the backend with an exchanged token (audience of the backend, subject u-alice, the
    gateway as actor), never alice's own; neither token is in the audit or the logs."""
    backend, idp = Backend(), TokenServer(clients={CLIENT_ID: CLIENT_SECRET})
    gateway = None
    try:
        secret = tmp_path / "secret"
        secret.write_text(CLIENT_SECRET)
        auth = {
            "oauth_client_credentials": {
                "token_endpoint": idp.token_endpoint,
                "client_id": CLIENT_ID,
                "client_secret_file": str(secret),
            }
        }
        registry = make_test_registry(tmp_path / "registry")
        entry = hand_written(backend, auth)["shop_my_orders"]
        (registry / "shop_my_orders.yaml").write_text(yaml.safe_dump(entry))
        gateway = Gateway(
            with_mcp=True, data_dir=tmp_path / "data", registry_dir=registry, with_audit=True
        )
        gateway.stack.oidc_args = ["--oidc-issuer", idp.issuer, "--oidc-audience", "toolgate"]
        gateway.start()
        alice_token = idp.user_token("u-alice", audience="toolgate", tenant="acme")

        async def call() -> dict:
            creds = await gateway.agent_creds("acme", "researcher")
            nc = await nats.connect(nats_servers(gateway.url), **connect_options(creds))
            try:
                body = json.dumps(
                    {
                        "call_id": "call_x1",
                        "tool": "shop_my_orders",
                        "arguments": {"orderId": "o-9"},
                        "principal": {
                            "tenant": "acme",
                            "user": "u-alice",
                            "agent": "researcher",
                            "session": "s-1",
                        },
                    }
                ).encode()
                await nc.jetstream().publish(
                    subjects.calls_subject("acme", "researcher"),
                    body,
                    headers={"Authorization": f"Bearer {alice_token}"},
                )
            finally:
                await nc.close()
            async with await gateway.client() as client:
                for _ in range(600):
                    result = await client.result("call_x1")
                    if result is not None:
                        return {"result": result}
                    await asyncio.sleep(0.1)
            raise TimeoutError("no result for call_x1")

        result = asyncio.run(call())["result"]
        assert result.ok, result
        sent = next(r for r in backend.received if r.path == "/v1/mine/o-9")
        assert sent.bearer != alice_token
        claims = idp.verify(sent.bearer or "", audience="shop-api")
        assert claims["sub"] == "u-alice" and claims["act"] == {"sub": CLIENT_ID}
        asyncio.run(audited_everything(gateway))
        issued = [g.issued for g in idp.grants if g.issued]
        assert_no_secret_anywhere(
            Shop(gateway, backend, idp),
            [alice_token, CLIENT_SECRET, *issued],
            {"ExecutionSucceeded"},
        )
    finally:
        if gateway is not None:
            gateway.stop()
        backend.stop()
        idp.stop()
