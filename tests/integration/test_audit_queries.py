"""Every query of infra/clickhouse/QUERIES.md runs and says the right thing on recorded stories."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.integration.test_audit_store import StoredJsMessage
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import (
    Principal,
    Provenance,
    ToolCall,
    ToolError,
    ToolResult,
    failure,
    success,
)
from toolgate.contracts.events import (
    ApprovalDenied,
    ApprovalGranted,
    ApprovalRequested,
    ArgumentsValidated,
    Authorization,
    CallAuthorized,
    CallDenied,
    Event,
    ExecutionStarted,
    ExecutionSucceeded,
    ResultAttached,
    call_fields,
    encode_event,
)
from toolgate.contracts.registry import Registry, load_registry
from toolgate.services.audit.chain import ensure_seal_key
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.rows import RowBuilder
from toolgate.services.audit.sql_console import run_readonly
from toolgate.services.audit.trace import format_trace, read_call_events, story
from toolgate.services.audit.writer import AuditWriter

QUERIES = Path(__file__).resolve().parents[2] / "infra" / "clickhouse" / "QUERIES.md"
T0 = datetime(2026, 3, 1, 9, 0, 0, tzinfo=UTC)
RESEARCHER = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
WRITER = Principal(tenant="acme", user="u-carol", agent="writer", session="s-2")
# Another tenant's agent of the same name: an agent is named with its tenant.
GLOBEX_WRITER = Principal(tenant="globex", user="u-dave", agent="writer", session="s-3")


def registry() -> Registry:
    builtin = load_registry()
    echo = builtin.get("echo")
    assert echo is not None
    tools = {spec.name: spec for spec in builtin}
    tools["wire_money"] = echo.model_copy(
        update={"name": "wire_money", "risk": "critical", "requires_approval": True}
    )
    return Registry(tools)


class Story:
    """The events of one call, as the pipeline would emit them, a few ms apart."""

    def __init__(self, call_id: str, tool: str, principal: Principal, start: datetime) -> None:
        self.call = ToolCall(
            call_id=call_id, tool=tool, arguments={"payload": call_id}, principal=principal
        )
        self.at = start
        self.events: list[Event] = []

    def _common(self, kind: str, ms: float) -> dict[str, Any]:
        self.at += timedelta(milliseconds=ms)
        # Unique per call (tenant, agent, call_id), as the pipeline's derived ids are.
        key = subjects.call_key(
            self.call.principal.tenant, self.call.principal.agent, self.call.call_id
        )
        return dict(
            event_id=f"{key}-{kind}-{len(self.events)}",
            occurred_at=self.at,
            service="test",
            arguments_sha256=arguments_sha256(self.call.arguments),
            **call_fields(self.call),
        )

    def add(self, cls: type[Event], ms: float = 1.0, **fields: Any) -> Story:
        self.events.append(cls(**self._common(cls.__name__, ms), **fields))
        return self

    def validated(self) -> Story:
        return self.add(ArgumentsValidated, call=self.call)

    def authorized(self) -> Story:
        return self.add(
            CallAuthorized,
            call=self.call,
            policy_version="pv-1",
            authorization=Authorization(
                call_id=self.call.call_id,
                tool=self.call.tool,
                arguments_sha256="x",
                policy_version="pv-1",
                expires_at=T0,
            ),
        )

    def executed(self, output: Any, ms: float = 5.0) -> Story:
        self.add(ExecutionStarted, attempt=1, worker="w")
        return self.add(ExecutionSucceeded, ms=ms, output=output, duration_ms=ms)

    def attached(self, result: ToolResult) -> Story:
        return self.add(ResultAttached, result=result)

    def approval(self, approver: str, granted: bool, reason: str = "") -> Story:
        self.add(
            ApprovalRequested,
            call=self.call,
            policy_version="pv-1",
            risk="critical",
            expires_at=T0 + timedelta(hours=1),
        )
        if granted:
            return self.add(
                ApprovalGranted,
                ms=30_000,
                call=self.call,
                policy_version="pv-1",
                approver=approver,
                reason=reason,
                quorum_reached=True,
            )
        return self.add(
            ApprovalDenied,
            ms=20_000,
            approver=approver,
            reason="not today",
            error=ToolError(code="APPROVAL_DENIED", message="denied"),
        )


def denied(call_id: str, principal: Principal, start: datetime) -> Story:
    s = Story(call_id, "save_evidence", principal, start)
    return (
        s.validated()
        .add(
            CallDenied,
            status="denied",
            policy_version="pv-1",
            error=ToolError(code="TASK_SCOPE_VIOLATION", message="x"),
        )
        .attached(
            failure(s.call.call_id, "denied", ToolError(code="TASK_SCOPE_VIOLATION", message="x"))
        )
    )


def approved_wire(call_id: str, principal: Principal, start: datetime) -> Story:
    ok = {"payload": "fine"}
    s = Story(call_id, "wire_money", principal, start)
    return (
        s.validated()
        .approval("u-boss", True)
        .authorized()
        .executed(ok)
        .attached(success(s.call.call_id, ok))
    )


def stories() -> list[Story]:
    ok = {"payload": "fine"}
    found = []
    for i in range(5):
        s = Story(f"ok-{i}", "echo", RESEARCHER, T0 + timedelta(seconds=i))
        found.append(s.validated().authorized().executed(ok).attached(success(s.call.call_id, ok)))
    for i, principal in enumerate((RESEARCHER, WRITER, WRITER)):
        found.append(denied(f"denied-{i}", principal, T0 + timedelta(seconds=10 + i)))
    # The same call_id in another tenant: another call.
    found.append(denied("denied-1", GLOBEX_WRITER, T0 + timedelta(seconds=13)))
    found.append(approved_wire("wire-approved", WRITER, T0 + timedelta(seconds=20)))
    s = Story("wire-refused", "wire_money", WRITER, T0 + timedelta(seconds=21))
    found.append(
        s.validated()
        .approval("u-boss", False)
        .attached(
            failure(
                s.call.call_id, "approval_denied", ToolError(code="APPROVAL_DENIED", message="no")
            )
        )
    )
    s = Story("broken", "broken_output", RESEARCHER, T0 + timedelta(seconds=22))
    found.append(
        s.validated()
        .authorized()
        .executed({"items": "not-a-list"})
        .attached(
            failure(
                s.call.call_id,
                "invalid_tool_result",
                ToolError(code="OUTPUT_SCHEMA_VIOLATION", message="bad output"),
            )
        )
    )
    # One call_id, two agents: two independent calls, each its own row everywhere.
    s = Story("shared", "echo", RESEARCHER, T0 + timedelta(seconds=30))
    found.append(s.validated().authorized().executed(ok).attached(success(s.call.call_id, ok)))
    found.append(denied("shared", WRITER, T0 + timedelta(seconds=31)))
    found.append(approved_wire("wire-shared", WRITER, T0 + timedelta(seconds=40)))
    found.append(approved_wire("wire-shared", RESEARCHER, T0 + timedelta(seconds=41)))
    return found


def identity(story: Story) -> tuple[str, str, str]:
    principal = story.call.principal
    return principal.tenant, principal.agent, story.call.call_id


def messages(all_stories: list[Story]) -> list[StoredJsMessage]:
    found, seq = [], 0
    for s in all_stories:
        seq += 1
        # Stored under the subject of the agent that sent it, as the server does.
        sender = subjects.calls_subject(s.call.principal.tenant, s.call.principal.agent)
        found.append(
            StoredJsMessage(
                "TOOLGATE_CALLS",
                seq,
                msgspec.json.encode(s.call),
                subject=sender,
                stored_at=s.events[0].occurred_at - timedelta(microseconds=300),
            )
        )
        for event in s.events:
            seq += 1
            found.append(
                StoredJsMessage(
                    "TOOLGATE_EVENTS", seq, encode_event(event), subject="toolgate.evt.x.y"
                )
            )
    return found


async def record(url: str, keys: Path, all_stories: list[Story]) -> None:
    writer = AuditWriter(
        ClickHouseTarget.from_url(url), RowBuilder(registry()), ensure_seal_key(keys), "test-sink"
    )
    await writer.start()
    batch = messages(all_stories)
    await writer.write([m for m in batch if m.stream == "TOOLGATE_CALLS"])  # type: ignore[misc]
    await writer.write([m for m in batch if m.stream == "TOOLGATE_EVENTS"])  # type: ignore[misc]
    await writer.close()


def documented_queries() -> dict[str, str]:
    text = QUERIES.read_text()
    found = {}
    for match in re.finditer(r"^## (.+?)\n(.*?)```sql\n(.*?)```", text, re.S | re.M):
        found[match[1].strip()] = match[3].strip()
    return found


@pytest.fixture(scope="module")
def recorded(clickhouse_server, tmp_path_factory):  # type: ignore[no-untyped-def]
    import asyncio

    url = clickhouse_server.url_for("admin", "queries")
    asyncio.run(record(url, tmp_path_factory.mktemp("keys"), stories()))
    return ClickHouseTarget.from_url(url).client()


def by_title(fragment: str) -> str:
    return next(sql for title, sql in documented_queries().items() if fragment in title)


def rows_of(client, sql: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    columns, rows = run_readonly(client, sql)
    return [dict(zip(columns, row, strict=True)) for row in rows]


def test_every_documented_query_runs(recorded):
    queries = documented_queries()
    assert len(queries) >= 5
    for title, sql in queries.items():
        run_readonly(recorded, sql)  # raises on any error
        assert title


def test_denials_by_agent_and_reason(recorded):
    rows = rows_of(recorded, by_title("Denials"))
    counts = {
        (r["tenant"], r["agent"], r["event_type"], r["error_code"]): (r["denials"], r["calls"])
        for r in rows
    }
    assert counts == {
        ("acme", "writer", "CallDenied", "TASK_SCOPE_VIOLATION"): (3, 3),
        ("acme", "researcher", "CallDenied", "TASK_SCOPE_VIOLATION"): (1, 1),
        ("globex", "writer", "CallDenied", "TASK_SCOPE_VIOLATION"): (1, 1),
        ("acme", "writer", "ApprovalDenied", "APPROVAL_DENIED"): (1, 1),
    }


def test_approvals_by_approver(recorded):
    [row] = rows_of(recorded, by_title("Approvals by approver"))
    # wire-shared was approved for two agents: two calls, not one.
    assert (row["approver"], row["granted"], row["denied"], row["calls"]) == ("u-boss", 3, 1, 4)


def test_stage_percentiles_per_tool(recorded):
    rows = rows_of(recorded, by_title("p50 / p99"))
    stages = {(r["tool"], r["stage"]): r for r in rows}
    assert stages[("echo", "execute")]["p50_ms"] == pytest.approx(5.0)
    assert stages[("echo", "execute")]["calls"] == 6
    assert stages[("wire_money", "approval")]["p50_ms"] == pytest.approx(30_000, rel=0.5)
    assert ("echo", "approval") not in stages  # never reached: NULL, not zero
    assert {s for t, s in stages if t == "echo"} == {
        "check",
        "policy",
        "queue",
        "execute",
        "attach",
        "total",
    }


def test_high_risk_without_approval_is_zero_until_one_happens(
    recorded, clickhouse_server, tmp_path
):
    assert rows_of(recorded, by_title("High-risk")) == []
    import asyncio

    url = clickhouse_server.url_for("admin", "planted")
    ok = {"payload": "fine"}
    s = Story("wire-unapproved", "wire_money", WRITER, T0)
    planted = s.validated().authorized().executed(ok).attached(success(s.call.call_id, ok))
    # Another agent's approved call with the same call_id must not hide an unapproved one
    # (grouped by call_id alone, the writer's approval made the researcher's run look approved).
    twin_approved = approved_wire("wire-twin", WRITER, T0 + timedelta(minutes=1))
    s = Story("wire-twin", "wire_money", RESEARCHER, T0 + timedelta(minutes=2))
    twin_unapproved = s.validated().authorized().executed(ok).attached(success(s.call.call_id, ok))
    asyncio.run(record(url, tmp_path, [*stories(), planted, twin_approved, twin_unapproved]))
    client = ClickHouseTarget.from_url(url).client()
    found = [
        (r["tenant"], r["agent"], r["call_id"]) for r in rows_of(client, by_title("High-risk"))
    ]
    assert found == [("acme", "writer", "wire-unapproved"), ("acme", "researcher", "wire-twin")]


def test_invalid_tool_results(recorded):
    rows = rows_of(recorded, by_title("invalid_tool_result"))
    assert [(r["call_id"], r["final_error_code"]) for r in rows] == [
        ("broken", "OUTPUT_SCHEMA_VIOLATION")
    ]


def test_calls_view_has_one_row_per_call_with_its_final_status(recorded):
    rows = rows_of(
        recorded,
        "SELECT tenant, agent, call_id, call_key, final_status, approved, "
        "executed, events, user FROM calls ORDER BY call_id",
    )
    assert sorted((r["tenant"], r["agent"], r["call_id"]) for r in rows) == sorted(
        identity(s) for s in stories()
    )
    assert all(r["call_key"] == f"{r['tenant']}.{r['agent']}.{r['call_id']}" for r in rows)
    status = {r["call_key"]: (r["final_status"], r["approved"], r["executed"]) for r in rows}
    assert status["acme.writer.wire-approved"] == ("ok", True, True)
    assert status["acme.writer.wire-refused"] == ("approval_denied", False, False)
    assert status["acme.researcher.denied-0"] == ("denied", False, False)


def test_two_agents_same_call_id_stay_two_calls(recorded):
    """The same call_id from two agents (or two tenants) is two rows of `calls`, each with
    its own sender, user, status and events: nothing of one leaks into the other."""
    rows = rows_of(
        recorded,
        "SELECT tenant, agent, user, tool, final_status, executed, "
        "approvers, events FROM calls WHERE call_id = 'shared' "
        "ORDER BY agent",
    )
    researcher = [s for s in stories() if identity(s) == ("acme", "researcher", "shared")][0]
    writer = [s for s in stories() if identity(s) == ("acme", "writer", "shared")][0]
    assert rows == [
        {
            "tenant": "acme",
            "agent": "researcher",
            "user": "u-alice",
            "tool": "echo",
            "final_status": "ok",
            "executed": True,
            "approvers": [],
            "events": len(researcher.events) + 1,
        },  # + the raw call (CallRequested)
        {
            "tenant": "acme",
            "agent": "writer",
            "user": "u-carol",
            "tool": "save_evidence",
            "final_status": "denied",
            "executed": False,
            "approvers": [],
            "events": len(writer.events) + 1,
        },
    ]
    tenants = rows_of(
        recorded, "SELECT tenant, user FROM calls WHERE call_id = 'denied-1' ORDER BY tenant"
    )
    assert tenants == [
        {"tenant": "acme", "user": "u-carol"},
        {"tenant": "globex", "user": "u-dave"},
    ]
    both = rows_of(
        recorded,
        "SELECT agent, approved, executed FROM calls WHERE call_id = 'wire-shared' ORDER BY agent",
    )
    assert both == [
        {"agent": "researcher", "approved": True, "executed": True},
        {"agent": "writer", "approved": True, "executed": True},
    ]


def test_trace_tells_the_story_in_order(recorded):
    steps = story(read_call_events(recorded, "wire-approved"))
    assert [s.event_type for s in steps] == [
        "CallRequested",
        "ArgumentsValidated",
        "ApprovalRequested",
        "ApprovalGranted",
        "CallAuthorized",
        "ExecutionStarted",
        "ExecutionSucceeded",
        "ResultAttached",
        "ResultAttached",
    ]
    text = format_trace("wire-approved", steps)
    for phrase in (
        "requested wire_money by agent writer",
        "approval granted by u-boss, quorum reached",
        "policy decision: allowed (policy pv-1",
        "finished, succeeded, in 5.0 ms",
        "result checked against the output_schema: valid",
        "result attached: ok",
    ):
        assert phrase in text, text
    broken = format_trace("broken", story(read_call_events(recorded, "broken")))
    assert "INVALID (OUTPUT_SCHEMA_VIOLATION)" in broken


def test_trace_shows_each_approvers_reason_and_the_upstream_provenance(clickhouse_server, tmp_path):
    """Both are in the recorded events; the trace shows them, escaped (they came from
    outside), and an approver's reason stays redacted for a tool whose audit keeps no
    arguments (a reason may quote them)."""
    import asyncio

    url = clickhouse_server.url_for("admin", "traced")
    ok = {"payload": "fine"}
    s = Story("upstream", "fetch_document", RESEARCHER, T0)
    upstream = msgspec.structs.replace(
        success(s.call.call_id, ok),
        provenance=Provenance(source="mcp", server="http://up.example/mcp\x1b[31m", tool="look"),
    )
    traced = (
        s.validated()
        .approval("u-boss", True, reason="Checked the source by hand.\u202e")
        .authorized()
        .executed(ok)
        .attached(upstream)
    )
    s = Story("wire-reasoned", "wire_money", WRITER, T0)
    wire = s.validated().approval("u-boss", True, reason="payee IBAN DE00 checked")
    asyncio.run(record(url, tmp_path / "keys", [traced, wire]))
    client = ClickHouseTarget.from_url(url).client()
    text = format_trace("upstream", story(read_call_events(client, "upstream")))
    assert (
        "approval granted by u-boss, quorum reached: Checked the source by hand.\\u202e"
    ) in text, text
    assert (
        "result attached: ok, content from upstream mcp server "
        "http://up.example/mcp\\u001b[31m tool look (untrusted)"
    ) in text, text
    assert "\x1b" not in text and "\u202e" not in text
    text = format_trace("wire-reasoned", story(read_call_events(client, "wire-reasoned")))
    assert "approval granted by u-boss, quorum reached: [redacted]" in text, text
    assert "IBAN" not in text
