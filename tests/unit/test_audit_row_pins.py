"""The audit sink's rows, chain and insert columns are pinned byte for byte (issue #26).

The sink's per-row path is tuned for speed (stored_message, RowBuilder, Chain.link,
insert_columns); what it makes must stay exactly what it made: stored chains keep
verifying, and the rows of a message redelivered to a newer sink are the same. Each
digest below was computed by the sink before the tuning, over a spread of messages:
every story of `bench audit-queries` under every audit mode, and every odd case. They
pass on the sink before the tuning as after it; any byte changed fails them.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from typing import Any

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tests.unit.test_audit_rows import (
    ALICE,
    SECRET,
    T0,
    call_of,
    common,
    registry,
    stored_call,
    stored_event,
)
from toolgate.bench.audit_queries import _templates, story_messages
from toolgate.contracts.calls import ToolError, ToolResult
from toolgate.contracts.events import (
    ApprovalGranted,
    ArgumentsRejected,
    ArgumentsValidated,
    CallDenied,
    ExecutionFailed,
    ExecutionRefused,
    ExecutionSucceeded,
    MessageDeadLettered,
    ResourceSeen,
    ResultAttached,
)
from toolgate.services.audit.chain import Chain, content_bytes
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import MAX_PAYLOAD_CHARS, RowBuilder, StoredMessage
from toolgate.services.audit.writer import AuditWriter, insert_columns, stored_message

# sha256 over every row's content bytes and chain hash, and over the insert's columns.
# Recomputed once when the bench's stories changed their input (805f287: each event
# carries its story's time); the sink was unchanged, and the stories before that change
# gave the first pair (0b7eab6f..., 947e5df4...) on this same sink.
CHAIN_DIGEST = "fb92d881bb68c84f79cc8ead67be6363b699955295ba9cd797cc63972d78445e"
COLUMNS_DIGEST = "ae29faf781c1244d9b03480aa5c04bce45ab73dd0967f13b70c09a2dd83d928f"
TOOLS = (b"search_sources", b"open_echo", b"vault", b"no_such_tool", b"echo")


def bench_messages() -> list[StoredMessage]:
    """The stories `bench audit-queries` loads, read from their ack subjects, each under
    every audit mode (the tool renamed): full, none, unknown (hash), the registry's."""
    templates = _templates()
    out: list[StoredMessage] = []
    seq = [0]
    for i in range(40):
        for message in story_messages(templates, i * 7, seq, 400):
            for tool in TOOLS:
                message.data = message.data.replace(b"search_sources", tool)
                out.append(stored_message(message))  # type: ignore[arg-type]
                message.data = message.data.replace(tool, b"search_sources")
    return out


def odd_messages() -> list[StoredMessage]:
    """Every case the builder treats apart."""
    out: list[StoredMessage] = []
    for tool in ("open_echo", "vault", "echo", "nobody"):
        call = call_of(tool)
        error = ToolError(
            code="SCHEMA_VALIDATION_FAILED",
            message=f"'{SECRET['payload']}' is not valid",
            retryable=False,
            details=[{"path": "/payload", "message": "too long"}],
        )
        out += [
            stored_call(call),
            stored_call(call, subject="toolgate.calls"),
            stored_call(call, subject="toolgate.calls.globex.writer"),
            stored_event(ArgumentsValidated(**common(call), call=call)),
            stored_event(
                ArgumentsRejected(status="invalid_arguments", error=error, **common(call))
            ),
            stored_event(
                CallDenied(
                    status="denied",
                    policy_version="pv-3",
                    error=ToolError(code="POLICY_DENIED", message="no", retryable=False),
                    resources=[ResourceSeen(type="Account", id="a-1", attributes={"o": "x"})],
                    **common(call, "e-2"),
                )
            ),
            stored_event(
                ApprovalGranted(
                    **common(call),
                    call=call,
                    policy_version="pv",
                    approver="bob",
                    quorum_reached=True,
                )
            ),
            stored_event(
                ExecutionFailed(**common(call), status="timeout", duration_ms=500.25, error=error)
            ),
            stored_event(
                ExecutionSucceeded(
                    **common(call), output={"b": [1, "é"], "a": None}, duration_ms=0.1
                )
            ),
            stored_event(ExecutionRefused(**common(call), reason="not signed")),
            stored_event(
                ResultAttached(
                    **common(call),
                    result=ToolResult(call_id="c-1", ok=True, status="ok", data={"z": 1, "y": 2}),
                )
            ),
            stored_event(
                ResultAttached(
                    **common(call),
                    result=ToolResult(call_id="c-1", ok=False, status="error", error=error),
                )
            ),
            stored_event(
                MessageDeadLettered(
                    **common(call),
                    reason="gave up",
                    source_subject="toolgate.calls.acme.researcher",
                    payload_excerpt=f'{{"tool": "{tool}"',
                )
            ),
        ]
    for subject in ("toolgate.calls.globex.writer", "toolgate.evt.CallAuthorized.echo"):
        letter = MessageDeadLettered(
            event_id="d-1",
            call_id="c-7",
            occurred_at=T0,
            service="validator",
            reason="malformed",
            source_subject=subject,
        )
        out.append(stored_event(letter))
    call = call_of("open_echo")
    for at in (
        T0 - timedelta(days=365 * 200),
        T0 + timedelta(days=365 * 300),
        T0.replace(tzinfo=None),
        T0.astimezone(timezone(timedelta(hours=5))),
    ):
        out.append(
            stored_event(ArgumentsValidated(**{**common(call), "occurred_at": at}, call=call))
        )
    huge = call_of("open_echo", {"payload": "ü" * (MAX_PAYLOAD_CHARS + 10)})
    out += [
        stored_event(ArgumentsValidated(**common(huge), call=huge)),
        stored_call(huge),
        stored_call(b"{not json"),
        stored_call(b'{"call_id": "c-9", "tool": "echo"}'),
        stored_call(msgspec.json.encode(call_of("open_echo")).replace(b'"c-1"', b'"c 1"')),
        StoredMessage("TOOLGATE_EVENTS", 3, T0, "toolgate.evt.X.y", b"\xff\x00junk"),
        StoredMessage("TOOLGATE_CALLS", 4, datetime(2026, 1, 2), "toolgate.calls.a.b", b"{}"),
        stored_event(
            ArgumentsValidated(
                **{**common(call), "principal": msgspec.structs.replace(ALICE, user="Ünï ☃")},
                call=call,
            )
        ),
    ]
    return out


def digests() -> tuple[str, str]:
    builder = RowBuilder(registry(), max_call_bytes=4096)
    messages = bench_messages() + odd_messages()
    linked = Chain("pinned/chain").link([builder.row_for(m) for m in messages])
    # The sink's own path (rows with their content digests, then the links) makes the same.
    writer = AuditWriter(
        ClickHouseTarget.from_url("http://127.0.0.1:9/never"),
        builder,
        Ed25519PrivateKey.generate(),
        "pins",
    )
    writer.chain = Chain("pinned/chain")
    assert writer.chain.link(*writer._rows(messages)) == linked
    hashed = hashlib.sha256()
    for row in linked:
        hashed.update(content_bytes(row))
        hashed.update(row["chain_hash"].encode())
    columns = hashlib.sha256(msgspec.json.encode(_plain(insert_columns(linked))))
    return hashed.hexdigest(), columns.hexdigest()


def _plain(columns: list[Any]) -> list[Any]:
    return [list(column) for column in columns]


def test_rows_chain_and_columns_are_those_of_the_sink_before_its_tuning():
    assert digests() == (CHAIN_DIGEST, COLUMNS_DIGEST)


if __name__ == "__main__":
    print(digests())
