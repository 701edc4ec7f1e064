"""Health verdicts, the status page and the metrics hooks: pure logic, no servers."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from toolgate.cli.status import ConsumerLag, Status, render
from toolgate.contracts.calls import ToolError, ToolResult
from toolgate.contracts.events import CallDenied, MessageDeadLettered, ResultAttached
from toolgate.runtime import telemetry
from toolgate.runtime.health import Dependency, alive, clickhouse_ping_url, ready

NOW = datetime(2026, 1, 1, tzinfo=UTC)


class TestLiveness:
    def test_alive_while_every_dependency_answered_within_the_grace(self) -> None:
        deps = [Dependency("nats", last_ok=95.0), Dependency("clickhouse", last_ok=80.0)]
        assert alive(100.0, 0.0, deps, grace_s=30) == (True, [])

    def test_dead_once_one_is_lost_beyond_the_grace(self) -> None:
        deps = [Dependency("nats", last_ok=95.0), Dependency("clickhouse", last_ok=60.0)]
        ok, why = alive(100.0, 0.0, deps, grace_s=30)
        assert not ok and why == ["clickhouse lost for 40 s (grace 30 s)"]

    def test_a_starting_service_gets_the_grace_from_its_start(self) -> None:
        deps = [Dependency("nats")]
        assert alive(10.0, 0.0, deps, grace_s=30)[0]
        ok, why = alive(31.0, 0.0, deps, grace_s=30)
        assert not ok and "never answered" in why[0]

    def test_a_dependency_not_tried_yet_is_not_blamed_for_the_one_it_waits_for(self) -> None:
        """The audit sink connects to NATS only once ClickHouse answered: a ClickHouse
        that never does is named, not NATS."""
        deps = [Dependency("clickhouse"), Dependency("nats", waits_for="clickhouse")]
        ok, why = alive(31.0, 0.0, deps, grace_s=30)
        assert not ok and why == ["clickhouse never answered (grace 30 s)"]
        assert ready(deps)[1] == [
            "clickhouse not answering",
            "nats not tried until clickhouse answers",
        ]
        deps[0].last_ok = 30.0  # ClickHouse answered: now NATS is on the clock
        ok, why = alive(31.0, 0.0, deps, grace_s=30)
        assert not ok and why == ["nats never answered (grace 30 s)"]

    def test_ready_only_while_everything_answers_now(self) -> None:
        assert ready([Dependency("nats", ok_now=True)]) == (True, [])
        assert ready([Dependency("nats", ok_now=False)])[1] == ["nats not answering"]


def test_clickhouse_is_pinged_on_its_own_liveness_url() -> None:
    assert clickhouse_ping_url("http://127.0.0.1:8123/toolgate") == "http://127.0.0.1:8123/ping"
    assert clickhouse_ping_url("https://ch.example:8443/db") == "https://ch.example:8443/ping"


def test_status_shows_lag_per_durable_and_the_audit_lag() -> None:
    status = Status(
        nats_url="nats://x:4222",
        services={"validator": "up     http://127.0.0.1:1/metrics"},
        consumers=[
            ConsumerLag("executor", "TOOLGATE_EVENTS", "executor-echo", 7, 2),
            ConsumerLag("audit", "TOOLGATE_CALLS", "audit", 3, 1),
            ConsumerLag("audit", "TOOLGATE_EVENTS", "audit", 10, 0),
            ConsumerLag("executor", "TOOLGATE_EVENTS", "executor-new", None, None),
        ],
        approvals_waiting=2,
        dead_letters=1,
    )
    text = render(status)
    assert "executor-echo" in text and " 7 " in text
    assert "(no such durable yet)" in text
    assert "approvals waiting: 2" in text and "dead letters:      1" in text
    assert "audit lag:         14 messages" in text


@pytest.fixture
def metrics_on() -> telemetry.Metrics:
    telemetry.configure("attacher", metrics=True, environ={})
    found = telemetry.metrics()
    assert found is not None
    yield found
    telemetry.reset()


def _value(metrics: telemetry.Metrics, name: str, **labels: str) -> float:
    found = metrics.registry.get_sample_value(name, labels)
    return 0.0 if found is None else found


class TestMetricsHooks:
    def test_results_decisions_and_dead_letters_are_counted(
        self, metrics_on: telemetry.Metrics
    ) -> None:
        result = ToolResult(call_id="c1", ok=True, status="ok", data={}, error=None)
        common = dict(event_id="e", call_id="c1", occurred_at=NOW, service="x", tool="echo")
        telemetry.emitted(ResultAttached(result=result, **common))  # type: ignore[arg-type]
        denial = ToolError(code="POLICY_DENIED", message="no", retryable=False)
        telemetry.emitted(CallDenied(status="denied", error=denial, **common))  # type: ignore[arg-type]
        telemetry.emitted(
            MessageDeadLettered(
                event_id="d", call_id="", occurred_at=NOW, service="validator",
                reason="bad", source_subject="s",
            )
        )  # fmt: skip
        assert _value(metrics_on, "toolgate_calls_total", tool="echo", status="ok") == 1
        assert _value(metrics_on, "toolgate_decisions_total", outcome="denied") == 1
        assert _value(metrics_on, "toolgate_dead_letters_total", service="validator") == 1
        assert b"toolgate_calls_total" in telemetry.scrape()

    def test_off_by_default_nothing_is_kept_and_headers_pass_through(self) -> None:
        telemetry.reset()
        assert telemetry.metrics() is None and not telemetry.tracing_on()
        headers = {"Nats-Msg-Id": "x"}
        assert telemetry.trace_headers(headers) == {"Nats-Msg-Id": "x"}
        assert telemetry.scrape() == b""
        with telemetry.tool_span("echo", "c1") as run:
            run.finished("timeout", "TOOL_TIMEOUT")  # a no-op, and no error

    def test_tracing_only_when_an_otlp_endpoint_is_set(self) -> None:
        telemetry.configure("validator", metrics=False, environ={})
        assert not telemetry.tracing_on()
        telemetry.configure(
            "validator",
            metrics=False,
            environ={"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"},
        )
        try:
            assert telemetry.tracing_on()
        finally:
            telemetry.reset()


def test_a_raw_calls_trace_is_the_calls_own() -> None:
    from toolgate.contracts.events import traceparent_of

    raw = b'{"call_id": "call_01", "tool": "echo", "arguments": {}}'
    derived = telemetry.call_traceparent(raw)
    assert derived is not None and derived.startswith("00-")
    given = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    raw_given = b'{"call_id": "c", "context": {"traceparent": "%s"}}' % given.encode()
    assert telemetry.call_traceparent(raw_given) == given
    assert telemetry.call_traceparent(b"{not json") is None
    assert traceparent_of  # the same rule as the events' traceparent
