"""A secret sent to a hash-audited tool never lands in the audit or in any log.

Each kind of bad call carries the secret: arguments that break the schema,
a malformed call, a call_id that is not subject-safe, JSON that does not
parse, arguments nested too deep, a tool that raises quoting it, a tool
whose output breaks its schema quoting it, and a call that succeeds; and,
with the tool's name written with a JSON escape (`\u0076ault_lookup`), a
malformed call, a body with `NaN` and a call over the size cap; and a call to
a misspelt tool. Then every row of event_log (all columns), every dead letter
in JetStream and every file under the data dir's logs (services and the
embedded ClickHouse) is searched for it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, make_test_registry
from tests.waiting import all_settled
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import MAX_CALL_BYTES, Principal
from toolgate.contracts.events import MessageDeadLettered

pytestmark = pytest.mark.system  # a whole gateway as processes (so slow too)

SECRET = "sk-LIVE-7f3a9c1e5b2d4680"
ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
VAULT = """
name: vault_lookup
description: Looks up a balance with a secret token. Test only.
function: tests.tools.secrets:vault_lookup
input_schema:
  type: object
  properties:
    token: {type: string, pattern: "^tok-"}
    mode: {enum: [ok, raise, broken]}
    nested: {}
  required: [token]
  additionalProperties: false
output_schema:
  type: object
  properties:
    balance: {type: integer}
    echo: {type: string}
  required: [balance]
read_only: true
idempotent: true
timeout_s: 5
risk: low
allowed_agents: ["*"]
audit: {arguments: hash, result: hash}
"""


@pytest.fixture(scope="module")
def vaulted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("vaulted")
    registry = make_test_registry(base / "registry")
    (registry / "vault_lookup.yaml").write_text(VAULT)
    # The notifier too: its log is one of those searched for the secret.
    gateway = Gateway(
        data_dir=base / "data", registry_dir=registry, with_audit=True, with_notifier=True
    ).start()
    yield gateway
    gateway.stop()


def nested(depth: int) -> dict:
    value: dict = {"deep": SECRET}
    for _ in range(depth):
        value = {"n": value}
    return value


async def send_bad_calls(gateway: Gateway) -> dict[str, str]:
    statuses: dict[str, str] = {}
    async with await gateway.client() as client:
        for name, arguments in {
            "schema": {"token": SECRET, "mode": "ok"},  # breaks the pattern: quoted by jsonschema
            "raise": {"token": "tok-" + SECRET, "mode": "raise"},
            "broken": {"token": "tok-" + SECRET, "mode": "broken"},
            "ok": {"token": "tok-" + SECRET},
            "deep": {"token": "tok-x", "nested": nested(70)},
        }.items():
            result = await client.call("vault_lookup", arguments, principal=ALICE, timeout=60)
            statuses[name] = result.status
        misspelt = await client.call("vault_lookupp", {"token": SECRET}, principal=ALICE)
        statuses["unknown_tool"] = misspelt.status
    nc = await gateway.connect()
    js = nc.jetstream()
    calls = subjects.calls_subject(ALICE.tenant, ALICE.agent)
    principal = {"tenant": "acme", "user": "u-alice", "agent": "researcher", "session": "s"}
    raw = {
        # arguments not an object: MALFORMED_CALL, dead-lettered with an excerpt
        "malformed": {"call_id": new_call_id(), "tool": "vault_lookup", "arguments": SECRET},
        # no answerable call_id: dead-lettered with an excerpt
        "bad_call_id": {
            "call_id": "not safe!",
            "tool": "vault_lookup",
            "arguments": {"token": SECRET},
            "principal": principal,
        },
    }
    for body in raw.values():
        await js.publish(calls, json.dumps(body).encode())
    await js.publish(calls, b'{"tool": "vault_lookup", "arguments": {"token": "' + SECRET.encode())
    # The tool's name with a JSON escape: no literal "vault_lookup" in the bytes.
    escaped = b'"tool": "\\u0076ault_lookup"'
    p = json.dumps(principal).encode()
    for body in (
        # arguments not an object: MALFORMED_CALL and a dead letter
        b'{"call_id": "%s", %s, "arguments": "%s", "principal": %s}'
        % (new_call_id().encode(), escaped, SECRET.encode(), p),
        # not JSON (NaN): MALFORMED_CALL and a dead letter
        b'{"call_id": "%s", %s, "arguments": {"token": "%s", "n": NaN}, "principal": %s}'
        % (new_call_id().encode(), escaped, SECRET.encode(), p),
        # over the size cap: PAYLOAD_TOO_LARGE, the call kept in the calls stream only
        b'{"call_id": "%s", %s, "arguments": {"token": "%s", "pad": "%s"}, "principal": %s}'
        % (new_call_id().encode(), escaped, SECRET.encode(), b"x" * MAX_CALL_BYTES, p),
        # decodable: checked (and kept) under its decoded name
        b'{"call_id": "%s", %s, "arguments": {"token": "%s"}, "principal": %s}'
        % (new_call_id().encode(), escaped, SECRET.encode(), p),
    ):
        await js.publish(calls, body)
    await nc.close()
    return statuses


async def audited_everything(gateway: Gateway, timeout: float = 120.0) -> None:
    """Every stage has handled the calls (attachers and dead letters of the last ones too),
    and the audit has every call and event as rows."""
    await all_settled(gateway, timeout)


def test_a_secret_of_a_hash_audited_tool_is_nowhere(vaulted: Gateway) -> None:
    statuses = asyncio.run(send_bad_calls(vaulted))
    assert statuses == {
        "schema": "invalid_arguments",
        "raise": "execution_error",
        "broken": "invalid_tool_result",
        "ok": "ok",
        "deep": "invalid_arguments",
        "unknown_tool": "unknown_tool",
    }
    asyncio.run(audited_everything(vaulted))
    client = vaulted.audit_client()
    rows = client.query("SELECT event_type, note, payload FROM event_log").result_rows
    kinds = {r[0] for r in rows}
    # every kind of bad call made it to the audit, so the search below is meaningful
    assert {"CallRequested", "ArgumentsRejected", "MessageDeadLettered", "ExecutionFailed"} <= kinds
    assert any("not a decodable ToolCall" in r[1] for r in rows)
    assert any("oversized call" in r[1] for r in rows)
    dead = [json.loads(r[2]) for r in rows if r[0] == "MessageDeadLettered"]
    assert len(dead) >= 4 and all(d["payload_excerpt"] in ("", "[redacted]") for d in dead)
    # The dead letters in JetStream: the message's size and SHA-256, no excerpt.
    letters = [e for e in asyncio.run(vaulted.events()) if isinstance(e, MessageDeadLettered)]
    assert len(letters) >= 4
    assert all(e.payload_excerpt == "" and len(e.payload_sha256) == 64 for e in letters)
    assert all(SECRET not in e.reason for e in letters)
    everything = client.raw_query("SELECT * FROM event_log FORMAT TSVRaw").decode()
    assert SECRET not in everything
    checkpoints = client.raw_query("SELECT * FROM chain_checkpoints FORMAT TSVRaw").decode()
    assert SECRET not in checkpoints
    logs = [p for p in Path(vaulted.data_dir).rglob("*.log") if p.is_file()]
    assert any(p.name == "validator.log" for p in logs)
    leaked = [str(p) for p in logs if SECRET in p.read_text(errors="replace")]
    assert leaked == []
