"""Metrics and traces of a service: what an SRE watches, at a cost only when asked for.

Two switches, both off by default, both set once in `main()` (`configure`):

- metrics: Prometheus collectors in a registry of this process, served on
  `/metrics` by runtime/health.py when the service has an HTTP port;
- traces: OpenTelemetry spans, exported over OTLP/HTTP only when
  `OTEL_EXPORTER_OTLP_ENDPOINT` is set. The W3C `traceparent` travels in NATS
  headers: each stage's span is a child of the span that published its input,
  so one call is one trace (its trace id is the call's own `traceparent`, the
  platform's or one derived from `call_id`, so the audit's traceparent column
  finds it). The executor's tool run is an `execute_tool {tool}` span with
  the GenAI semantic conventions.

The bus calls three hooks on the hot path (`observed` around `settle`,
`emitted` and `trace_headers` in `Publisher`); with both switches off each is
one global lookup and a return. (FastStream's own telemetry middlewares hang
on its subscriber stack, which the services no longer use for consuming.)
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import msgspec

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from toolgate.contracts.events import Event

OTLP_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
# Stage latency buckets (seconds): most stages take milliseconds, tools seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# Decisions and approvals, by the event that records them.
DECISIONS = {
    "CallAuthorized": "allowed",
    "CallDenied": "denied",
    "ApprovalRequested": "approval_required",
}
APPROVAL_OUTCOMES = {
    "ApprovalGranted": "granted",
    "ApprovalDenied": "denied",
    "ApprovalExpired": "expired",
}


class Metrics:
    """The collectors of one service process (its own registry: nothing global)."""

    def __init__(self, service: str) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.service = service
        self.registry: CollectorRegistry = CollectorRegistry()
        r = self.registry
        self.calls = Counter(
            "toolgate_calls", "Calls answered (ToolResult stored), by tool and status",
            ["tool", "status"], registry=r,
        )  # fmt: skip
        self.stage_seconds = Histogram(
            "toolgate_stage_seconds", "Time to handle one message and settle it, per durable",
            ["service", "durable"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tool_seconds = Histogram(
            "toolgate_tool_seconds", "Tool run time in the executor, by tool and status",
            ["tool", "status"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "toolgate_decisions", "Policy decisions, by outcome", ["outcome"], registry=r
        )
        self.approvals = Counter(
            "toolgate_approvals_decided", "Approvals decided, by outcome", ["outcome"], registry=r
        )
        self.approvals_pending = Gauge(
            "toolgate_approvals_pending", "Approvals waiting for a human", registry=r
        )
        self.dead_letters = Counter(
            "toolgate_dead_letters", "Messages dead-lettered, by the service that gave up",
            ["service"], registry=r,
        )  # fmt: skip
        self.events = Counter(
            "toolgate_events_published", "Events published, by type", ["type"], registry=r
        )
        self.pending = Gauge(
            "toolgate_consumer_pending", "Messages not yet delivered, per durable consumer",
            ["stream", "durable"], registry=r,
        )  # fmt: skip
        self.ack_pending = Gauge(
            "toolgate_consumer_ack_pending", "Messages delivered and not yet acked, per durable",
            ["stream", "durable"], registry=r,
        )  # fmt: skip
        self.redelivered = Gauge(
            "toolgate_consumer_redelivered", "Messages being redelivered, per durable",
            ["stream", "durable"], registry=r,
        )  # fmt: skip
        self.audit_lag = Gauge(
            "toolgate_audit_lag_messages",
            "Messages stored in NATS and not yet in ClickHouse (audit durables: pending + "
            "ack pending)",
            registry=r,
        )
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.up = Gauge(
            "toolgate_dependency_up", "1 while a dependency answers (nats, clickhouse)",
            ["dependency"], registry=r,
        )  # fmt: skip

    def stage(self, durable: str) -> Any:
        """The latency histogram of one durable (looked up once: labels() is not free)."""
        return self.child(self.stage_seconds, self.service, durable)

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, looked up once per label values (a call's hot path
        asked prometheus_client for it on every call: 2 % of the executor's CPU)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def emitted(self, event: Event) -> None:
        kind = type(event).__name__
        self.child(self.events, kind).inc()
        if kind == "ResultAttached":
            status = event.result.status  # type: ignore[attr-defined]
            self.child(self.calls, event.tool, status).inc()
        elif kind in DECISIONS:
            self.child(self.decisions, DECISIONS[kind]).inc()
        elif kind in APPROVAL_OUTCOMES:
            self.child(self.approvals, APPROVAL_OUTCOMES[kind]).inc()
        elif kind == "MessageDeadLettered":
            self.child(self.dead_letters, event.service).inc()


class Tracing:
    """An OpenTelemetry tracer exporting over OTLP/HTTP (endpoint from the environment)."""

    def __init__(self, service: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.propagators.textmap import DefaultGetter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(
            resource=Resource.create({"service.name": f"toolgate-{service}"})
        )
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        self.tracer = self.provider.get_tracer("toolgate")
        self.propagator = TraceContextTextMapPropagator()
        self.getter = DefaultGetter()
        self.service = service

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is batched


# The switches: set by `configure`, read on every hot-path hook.
_metrics: Metrics | None = None
_tracing: Tracing | None = None


def configure(service: str, metrics: bool, environ: dict[str, str] | None = None) -> None:
    """Turn on what this process was asked for (in main(), before the app starts)."""
    global _metrics, _tracing
    env = os.environ if environ is None else environ
    _metrics = Metrics(service) if metrics else None
    _tracing = Tracing(service) if env.get(OTLP_ENDPOINT_ENV) else None


def export_library_spans() -> None:
    """Export the spans of libraries that trace through OpenTelemetry's global API (the
    MCP SDK's server spans) with this process's tracer, when tracing is on."""
    if _tracing is not None:
        from opentelemetry import trace

        trace.set_tracer_provider(_tracing.provider)


def reset() -> None:
    """Both switches off again (tests; a service's shutdown)."""
    global _metrics, _tracing
    if _tracing is not None:
        _tracing.shutdown()
    _metrics = _tracing = None


def metrics() -> Metrics | None:
    return _metrics


def tracing_on() -> bool:
    return _tracing is not None


# ---------------------------------------------------------------- hot-path hooks


class _CallOfRawMessage(msgspec.Struct):
    """Just enough of a raw ToolCall to find its trace: call_id and context.traceparent."""

    call_id: str = ""
    context: dict[str, Any] = {}


_call_decoder = msgspec.json.Decoder(_CallOfRawMessage)


def call_traceparent(raw: bytes) -> str | None:
    """The traceparent a raw call belongs to: the platform's, else the one derived from
    call_id (the same rule as the events' `traceparent`)."""
    from toolgate.contracts.events import traceparent_of

    try:
        found = _call_decoder.decode(raw)
    except (msgspec.DecodeError, ValueError):
        return None
    if not found.call_id:
        return None
    return traceparent_of(found)  # type: ignore[arg-type]


def _parent_context(tracing: Tracing, msg: Any) -> Any:
    headers = msg.headers or {}
    if "traceparent" not in headers:
        # A call straight from an agent: its trace is the call's (see call_traceparent).
        traceparent = call_traceparent(msg.data)
        headers = {"traceparent": traceparent} if traceparent else {}
    return tracing.propagator.extract(headers, getter=tracing.getter)


Settle = Callable[..., Awaitable[None]]


def observed(settle: Settle) -> Settle:
    """Wrap the bus's `settle`: a span per stage (child of the publisher's) and the
    stage's latency, when switched on; otherwise straight through."""

    @functools.wraps(settle)
    async def settle_observed(msg: Any, delivery: Any, work: Any, give_up: Any) -> None:
        if _metrics is None and _tracing is None:
            await settle(msg, delivery, work, give_up)
            return
        durable = _durable_of(msg)
        started = time.perf_counter()
        try:
            if _tracing is None:
                await settle(msg, delivery, work, give_up)
            else:
                from opentelemetry.trace import SpanKind

                with _tracing.tracer.start_as_current_span(
                    f"process {durable}",
                    context=_parent_context(_tracing, msg),
                    kind=SpanKind.CONSUMER,
                    attributes={
                        "messaging.system": "nats",
                        "messaging.operation.type": "process",
                        "messaging.destination.name": delivery.subject,
                        "messaging.consumer.group.name": durable,
                        "messaging.message.delivery_count": delivery.attempt,
                        "toolgate.service": _tracing.service,
                    },
                ):
                    await settle(msg, delivery, work, give_up)
        finally:
            if _metrics is not None:
                _metrics.stage(durable).observe(time.perf_counter() - started)

    return settle_observed


def _durable_of(msg: Any) -> str:
    from toolgate.runtime.jetstream import ack_subject_fields  # (nats-py: loaded by then)

    fields = ack_subject_fields(getattr(msg, "reply", None))
    if fields is not None:
        return fields[1]
    try:
        return str(msg.metadata.consumer)
    except Exception:  # not a JetStream delivery
        return ""


def emitted(event: Event) -> None:
    if _metrics is not None:
        _metrics.emitted(event)


def trace_headers(headers: dict[str, str]) -> dict[str, str]:
    """`headers` plus the current span's `traceparent`, when tracing (else `headers`)."""
    if _tracing is not None:
        _tracing.propagator.inject(headers)
    return headers


def tool_span(tool: str, call_id: str) -> contextlib.AbstractContextManager[ToolRun]:
    """The GenAI `execute_tool {tool}` span around one tool run (a no-op when off)."""
    if _tracing is None and _metrics is None:
        return _no_span
    return _tool_span(tool, call_id)


@contextlib.contextmanager
def _tool_span(tool: str, call_id: str) -> Iterator[ToolRun]:
    run = ToolRun(tool)
    started = time.perf_counter()
    if _tracing is None:
        try:
            yield run
        finally:
            run.record(time.perf_counter() - started)
        return
    from opentelemetry.trace import SpanKind, Status, StatusCode

    with _tracing.tracer.start_as_current_span(
        f"execute_tool {tool}",
        kind=SpanKind.INTERNAL,
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": call_id,
            "gen_ai.tool.type": "function",
        },
    ) as span:
        try:
            yield run
        finally:
            run.record(time.perf_counter() - started)
            if run.error_type:
                span.set_attribute("error.type", run.error_type)
                span.set_status(Status(StatusCode.ERROR, run.error_type))


class ToolRun:
    """What the executor tells the tool span about the run's outcome."""

    def __init__(self, tool: str) -> None:
        self.tool = tool
        self.status = "ok"
        self.error_type: str | None = None

    def finished(self, status: str, error_code: str | None = None) -> None:
        self.status = status
        if status != "ok":
            self.error_type = error_code or status

    def record(self, seconds: float) -> None:
        if _metrics is not None:
            _metrics.child(_metrics.tool_seconds, self.tool, self.status).observe(seconds)


class _NoRun(ToolRun):
    def finished(self, status: str, error_code: str | None = None) -> None:
        pass


_no_span = contextlib.nullcontext(_NoRun(""))


def scrape() -> bytes:
    """The Prometheus text exposition of this process (empty when metrics are off)."""
    if _metrics is None:
        return b""
    from prometheus_client import generate_latest

    return bytes(generate_latest(_metrics.registry))


def registry() -> CollectorRegistry | None:
    return _metrics.registry if _metrics is not None else None
