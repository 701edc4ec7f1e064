"""Audit rows: typed columns, redaction by the tool's audit metadata, nothing dropped."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal, ToolCall, ToolError, ToolResult
from toolgate.contracts.events import (
    ApprovalGranted,
    ArgumentsRejected,
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    CallDenied,
    Event,
    ExecutionFailed,
    ExecutionSucceeded,
    MessageDeadLettered,
    ResultAttached,
    call_fields,
    encode_event,
)
from toolgate.contracts.registry import AuditSpec, Registry, load_registry
from toolgate.services.audit.rows import (
    CALL_REQUESTED,
    CONTENT_COLUMNS,
    MAX_PAYLOAD_CHARS,
    UNDECODABLE_EVENT,
    RowBuilder,
    StoredMessage,
    sha256_of,
)

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
T0 = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
SECRET = {"payload": "the launch code is 0000"}


def registry() -> Registry:
    builtin = load_registry()
    echo = builtin.get("echo")
    assert echo is not None
    tools = {spec.name: spec for spec in builtin}
    tools["vault"] = echo.model_copy(
        update={
            "name": "vault",
            "risk": "high",
            "audit": AuditSpec(arguments="none", result="none"),
        }
    )
    tools["open_echo"] = echo.model_copy(
        update={"name": "open_echo", "audit": AuditSpec(arguments="full", result="full")}
    )
    return Registry(tools)


@pytest.fixture
def builder() -> RowBuilder:
    return RowBuilder(registry(), max_call_bytes=4096)


def stored_call(
    call: ToolCall | bytes, seq: int = 7, subject: str = "toolgate.calls.acme.researcher"
) -> StoredMessage:
    """A call as the calls stream stores it: under the subject of the agent that sent it."""
    data = call if isinstance(call, bytes) else msgspec.json.encode(call)
    return StoredMessage("TOOLGATE_CALLS", seq, T0, subject, data)


def stored_event(event: Event, seq: int = 9) -> StoredMessage:
    return StoredMessage("TOOLGATE_EVENTS", seq, T0, "toolgate.evt.x.y", encode_event(event))


def call_of(tool: str, arguments: dict | None = None) -> ToolCall:  # type: ignore[type-arg]
    return ToolCall(
        call_id="c-1",
        tool=tool,
        arguments=arguments or dict(SECRET),
        principal=ALICE,
        task_id="task-1",
    )


def common(call: ToolCall, event_id: str = "e-1") -> dict:  # type: ignore[type-arg]
    return dict(
        event_id=event_id,
        occurred_at=T0,
        service="svc",
        arguments_sha256=arguments_sha256(call.arguments),
        **call_fields(call),
    )


class TestCallRequested:
    def test_a_call_becomes_a_row_with_its_principal_and_arguments_hash(self, builder):
        call = call_of("open_echo")
        row = builder.row_for(stored_call(call))
        assert row["event_type"] == CALL_REQUESTED
        assert (
            row["call_id"],
            row["tool"],
            row["tenant"],
            row["user"],
            row["agent"],
            row["session"],
            row["task_id"],
        ) == ("c-1", "open_echo", "acme", "u-alice", "researcher", "s-1", "task-1")
        assert row["arguments_sha256"] == arguments_sha256(call.arguments)
        assert json.loads(row["payload"])["call"]["arguments"] == SECRET
        assert row["occurred_at"] == T0 and row["source_seq"] == 7
        assert set(row) == set(CONTENT_COLUMNS)

    def test_event_id_is_derived_from_the_stream_sequence(self, builder):
        call = call_of("open_echo")
        again = builder.row_for(stored_call(call, seq=7))
        assert builder.row_for(stored_call(call, seq=7))["event_id"] == again["event_id"]
        assert builder.row_for(stored_call(call, seq=8))["event_id"] != again["event_id"]

    def test_garbage_is_recorded_with_a_note_not_dropped(self, builder):
        row = builder.row_for(stored_call(b"{not json"))
        assert row["event_type"] == CALL_REQUESTED and row["call_id"] == ""
        assert row["note"].startswith("not a decodable ToolCall")
        # No excerpt, whatever the tool: only what identifies the bytes.
        assert json.loads(row["payload"]) == {
            "bytes": 9,
            "sha256": hashlib.sha256(b"{not json").hexdigest(),
        }

    def test_a_call_missing_fields_keeps_what_names_it(self, builder):
        row = builder.row_for(stored_call(b'{"call_id": "c-9", "tool": "echo"}'))
        assert (row["call_id"], row["tool"]) == ("c-9", "echo")
        assert "excerpt" not in json.loads(row["payload"])

    def test_tenant_and_agent_are_the_senders_not_the_payloads(self, builder):
        spoof = ToolCall(
            call_id="c-1",
            tool="open_echo",
            arguments={"payload": 1},
            principal=Principal(tenant="globex", user="u-mallory", agent="admin", session="s-x"),
        )
        row = builder.row_for(stored_call(spoof, subject="toolgate.calls.acme.researcher"))
        assert (row["tenant"], row["agent"]) == ("acme", "researcher")
        assert (row["user"], row["session"]) == ("u-mallory", "s-x")  # the platform's word
        assert "'globex'" in row["note"] and "sent by acme.researcher" in row["note"]
        # The payload is kept as sent: the auditor sees what was claimed.
        assert json.loads(row["payload"])["call"]["principal"]["tenant"] == "globex"

    def test_a_call_that_names_its_sender_has_no_note(self, builder):
        row = builder.row_for(stored_call(call_of("open_echo")))
        assert row["note"] == ""

    def test_undecodable_and_oversized_calls_still_name_their_sender(self, builder):
        for data in (b"{not json", b'{"x": "' + b"a" * 10_000 + b'"}'):
            row = builder.row_for(stored_call(data, subject="toolgate.calls.globex.writer"))
            assert (row["tenant"], row["agent"]) == ("globex", "writer")

    def test_a_call_under_no_agents_subject_keeps_the_payloads_word_with_a_note(self, builder):
        row = builder.row_for(stored_call(call_of("open_echo"), subject="toolgate.calls"))
        assert (row["tenant"], row["agent"]) == ("acme", "researcher")
        assert row["note"].startswith("not stored under an agent's calls subject")

    def test_oversized_call_keeps_its_size_and_sha256_only(self, builder):
        data = b'{"x": "' + b"a" * 10_000 + b'"}'
        row = builder.row_for(stored_call(data))
        assert "oversized" in row["note"]
        assert json.loads(row["payload"]) == {
            "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
        }


class TestRedaction:
    def test_hash_keeps_only_the_sha256_of_the_arguments(self, builder):
        call = call_of("echo")  # audit: {arguments: hash, result: hash}
        row = builder.row_for(stored_call(call))
        arguments = json.loads(row["payload"])["call"]["arguments"]
        assert arguments == {"redacted": "hash", "sha256": sha256_of(SECRET)}
        assert "launch code" not in row["payload"]
        assert row["arguments_sha256"] == arguments_sha256(SECRET)

    def test_none_keeps_neither_arguments_nor_their_hash(self, builder):
        call = call_of("vault")
        authorized = CallAuthorized(
            **common(call),
            call=call,
            policy_version="p1",
            authorization=Authorization(
                call_id="c-1",
                tool="vault",
                arguments_sha256=arguments_sha256(SECRET),
                policy_version="p1",
                expires_at=T0,
            ),
        )
        for row in (builder.row_for(stored_call(call)), builder.row_for(stored_event(authorized))):
            assert row["arguments_sha256"] == ""
            assert "launch code" not in row["payload"]
            assert arguments_sha256(SECRET) not in row["payload"]
            assert row["risk"] == "high"

    def test_results_follow_the_result_mode(self, builder):
        output = {"payload": "secret output"}
        for tool, kept in (("open_echo", True), ("echo", False), ("vault", False)):
            call = call_of(tool)
            succeeded = builder.row_for(
                stored_event(ExecutionSucceeded(**common(call), output=output, duration_ms=1.5))
            )
            attached = builder.row_for(
                stored_event(
                    ResultAttached(
                        **common(call, "e-2"),
                        result=ToolResult(call_id="c-1", ok=True, status="ok", data=output),
                    )
                )
            )
            for row in (succeeded, attached):
                assert ("secret output" in row["payload"]) is kept, (tool, row["payload"])
                assert row["result_sha256"] == ("" if tool == "vault" else sha256_of(output))

    def test_validation_messages_quoting_hashed_arguments_are_redacted(self, builder):
        call = call_of("echo")
        row = builder.row_for(
            stored_event(
                ArgumentsRejected(
                    **common(call),
                    status="invalid_arguments",
                    error=ToolError(
                        code="SCHEMA_VALIDATION_FAILED",
                        message="bad",
                        details=[{"path": "/payload", "message": "'the launch code' is bad"}],
                    ),
                )
            )
        )
        assert "launch code" not in row["payload"]
        assert json.loads(row["payload"])["error"]["details"][0]["path"] == "/payload"


class TestEventColumns:
    def test_policy_decision_columns(self, builder):
        call = call_of("open_echo")
        row = builder.row_for(
            stored_event(
                CallDenied(
                    **common(call),
                    status="denied",
                    policy_version="pv-3",
                    error=ToolError(code="TOOL_NOT_ALLOWED", message="no"),
                )
            )
        )
        assert (
            row["event_type"],
            row["decision"],
            row["status"],
            row["error_code"],
            row["policy_version"],
        ) == ("CallDenied", "denied", "denied", "TOOL_NOT_ALLOWED", "pv-3")

    def test_approval_and_execution_columns(self, builder):
        call = call_of("open_echo")
        granted = builder.row_for(
            stored_event(
                ApprovalGranted(
                    **common(call),
                    call=call,
                    policy_version="pv-3",
                    approver="u-bob",
                    quorum_reached=True,
                )
            )
        )
        assert (granted["decision"], granted["approver"]) == ("approved", "u-bob")
        failed = builder.row_for(
            stored_event(
                ExecutionFailed(
                    **common(call),
                    status="timeout",
                    duration_ms=500.25,
                    error=ToolError(code="TOOL_TIMEOUT", message="slow"),
                )
            )
        )
        assert (failed["status"], failed["error_code"], failed["duration_ms"]) == (
            "timeout",
            "TOOL_TIMEOUT",
            500.25,
        )
        validated = builder.row_for(stored_event(ArgumentsValidated(**common(call), call=call)))
        assert validated["duration_ms"] is None and validated["decision"] == ""

    def test_result_attached_carries_the_final_status(self, builder):
        call = call_of("open_echo")
        row = builder.row_for(
            stored_event(
                ResultAttached(
                    **common(call),
                    result=ToolResult(
                        call_id="c-1",
                        ok=False,
                        status="invalid_tool_result",
                        error=ToolError(code="OUTPUT_SCHEMA_VIOLATION", message="x"),
                    ),
                )
            )
        )
        assert (row["status"], row["error_code"]) == (
            "invalid_tool_result",
            "OUTPUT_SCHEMA_VIOLATION",
        )

    def test_a_dead_letter_of_a_call_names_the_sender_of_that_call(self, builder):
        letter = MessageDeadLettered(
            event_id="d-1",
            call_id="c-7",
            occurred_at=T0,
            service="validator",
            reason="malformed ToolCall",
            source_subject="toolgate.calls.globex.writer",
        )
        row = builder.row_for(stored_event(letter))
        assert (row["call_id"], row["tenant"], row["agent"]) == ("c-7", "globex", "writer")
        other = MessageDeadLettered(
            event_id="d-2",
            call_id="",
            occurred_at=T0,
            service="executor",
            reason="gave up",
            source_subject="toolgate.evt.CallAuthorized.echo",
        )
        assert builder.row_for(stored_event(other))["tenant"] == ""

    def test_an_undecodable_event_is_recorded(self, builder):
        message = StoredMessage("TOOLGATE_EVENTS", 3, T0, "toolgate.evt.X.y", b"\xff\x00junk")
        row = builder.row_for(message)
        assert row["event_type"] == UNDECODABLE_EVENT and row["event_id"]
        assert row["event_id"] == builder.row_for(message)["event_id"]
        assert json.loads(row["payload"])["subject"] == "toolgate.evt.X.y"

    def test_huge_payload_is_cut_with_its_hash(self, builder):
        call = call_of("open_echo", {"payload": "x" * (MAX_PAYLOAD_CHARS + 10)})
        row = builder.row_for(stored_call(msgspec.json.encode(call)))
        assert len(msgspec.json.encode(call)) > 4096  # bigger than max_call_bytes here
        big = builder.row_for(stored_event(ArgumentsValidated(**common(call), call=call)))
        assert "payload truncated" in big["note"]
        assert json.loads(big["payload"])["truncated"] is True
        assert "oversized" in row["note"]

    def test_times_outside_datetime64_are_clamped(self, builder):
        call = call_of("open_echo")
        event = ArgumentsValidated(
            **{**common(call), "occurred_at": T0 - timedelta(days=365 * 200)}, call=call
        )
        assert builder.row_for(stored_event(event))["occurred_at"].year == 1900


class _AckedMessage:
    """A message as a pull consumer delivers it: the ack subject says where it is stored."""

    subject = "toolgate.calls.acme.researcher"
    data = b"{}"

    def __init__(self, reply: str) -> None:
        self.reply = reply


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.TOOLGATE_CALLS.audit.1.42.40.1767322445678901234.7",
        "$JS.ACK.hub.ACCHASH.TOOLGATE_CALLS.audit.1.42.40.1767322445678901234.7.tok",
    ],
)
def test_stored_message_is_read_from_the_ack_subject(reply):
    from toolgate.services.audit.writer import stored_message

    stored = stored_message(_AckedMessage(reply))  # type: ignore[arg-type]
    assert (stored.stream, stored.sequence) == ("TOOLGATE_CALLS", 42)
    assert stored.stored_at == datetime(2026, 1, 2, 2, 54, 5, 678901, tzinfo=UTC)


class TestRedactionEverywhere:
    """A value sent to a hash/none tool appears in no excerpt, message or resource."""

    LEAK = "the launch code is 0000"

    def test_an_oversized_call_keeps_no_excerpt_of_a_guarded_tool(self, builder):
        call = call_of("vault", {"payload": self.LEAK + "x" * 5000})
        row = builder.row_for(stored_call(call))
        assert "oversized call" in row["note"] and self.LEAK not in row["payload"]
        # Not decoded, so not known to be open_echo's: no excerpt either.
        open_call = call_of("open_echo", {"payload": self.LEAK + "x" * 5000})
        assert self.LEAK not in builder.row_for(stored_call(open_call))["payload"]

    def test_a_broken_call_naming_a_guarded_tool_is_not_quoted(self, builder):
        broken = b'{"tool": "vault", "arguments": {"payload": "' + self.LEAK.encode()
        row = builder.row_for(stored_call(broken))
        assert self.LEAK not in row["payload"] and "not a decodable ToolCall" in row["note"]
        plain = b'{"tool": "open_echo", "arguments": {"payload": "' + self.LEAK.encode()
        assert self.LEAK not in builder.row_for(stored_call(plain))["payload"]
        # The tool's name written with a JSON escape: still not quoted.
        escaped = b'{"tool": "\\u0076ault", "arguments": "' + self.LEAK.encode() + b'"}'
        row = builder.row_for(stored_call(escaped))
        assert row["tool"] == "vault" and self.LEAK not in row["payload"]

    def test_a_decoded_call_is_redacted_under_its_decoded_tool_name(self, builder):
        escaped = (
            b'{"call_id": "c-1", "tool": "\\u0076ault", "arguments": {"payload": "'
            + self.LEAK.encode()
            + b'"}, "principal": {"tenant": "acme", "agent": "researcher"}}'
        )
        row = builder.row_for(stored_call(escaped))
        assert row["tool"] == "vault" and self.LEAK not in row["payload"]

    def test_a_call_to_a_tool_the_registry_does_not_know_is_kept_as_hash(self, builder):
        call = call_of("vault_lookupp", {"payload": self.LEAK})
        row = builder.row_for(stored_call(call))
        assert self.LEAK not in row["payload"]
        assert row["arguments_sha256"] == arguments_sha256(call.arguments)
        rejected = ArgumentsRejected(
            **common(call),
            status="unknown_tool",
            error=ToolError(code="TOOL_NOT_FOUND", message=f"no tool {self.LEAK}"),
        )
        assert self.LEAK not in builder.row_for(stored_event(rejected))["payload"]

    def test_a_dead_letter_of_a_guarded_tool_keeps_no_excerpt(self, builder):
        dead = MessageDeadLettered(
            event_id="d-1",
            call_id="",
            occurred_at=T0,
            service="validator",
            reason="gave up",
            source_subject="toolgate.calls.acme.researcher",
            payload_excerpt='{"tool": "vault", "arguments": {"payload": "' + self.LEAK,
        )
        row = builder.row_for(stored_event(dead))
        assert self.LEAK not in row["payload"]
        assert json.loads(row["payload"])["payload_excerpt"] == "[redacted]"

    def test_error_messages_and_resources_of_a_guarded_tool_are_redacted(self, builder):
        from toolgate.contracts.events import ResourceSeen

        call = call_of("vault")
        error = ToolError(
            code="SCHEMA_VALIDATION_FAILED",
            message=f"'{self.LEAK}' is not valid",
            retryable=False,
            details=[{"path": "/payload", "message": f"'{self.LEAK}' is too long"}],
        )
        rejected = ArgumentsRejected(status="invalid_arguments", error=error, **common(call))
        denied = CallDenied(
            status="denied",
            error=ToolError(code="POLICY_DENIED", message=self.LEAK, retryable=False),
            resources=[ResourceSeen(type="Account", id=self.LEAK, attributes={"owner": self.LEAK})],
            **common(call, "e-2"),
        )
        for event in (rejected, denied):
            row = builder.row_for(stored_event(event))
            assert self.LEAK not in row["payload"], type(event).__name__
        payload = json.loads(builder.row_for(stored_event(rejected))["payload"])
        assert payload["error"]["code"] == "SCHEMA_VALIDATION_FAILED"
        assert payload["error"]["details"][0]["path"] == "/payload"
