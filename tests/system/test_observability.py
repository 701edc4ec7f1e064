"""Traces, metrics, status and health of a real gateway, read the way an SRE reads them.

The services export spans over OTLP/HTTP to a real receiver here (an HTTP
server decoding the OTLP protobuf), serve Prometheus /metrics and /healthz,
and `toolgate status` reads the same counts. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import gzip
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.harness import Gateway, make_test_registry
from toolgate.cli.main import main as toolgate
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts.calls import Principal
from toolgate.contracts.events import traceparent_of
from toolgate.runtime.health import probe
from toolgate.stack.supervisor import ServiceProcess

pytestmark = pytest.mark.system

BOB = Principal(tenant="acme", user="u-bob", agent="researcher", session="s-9")
HEALTH_GRACE_S = 3.0


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]


@dataclass
class OtlpReceiver:
    """The OTLP/HTTP traces endpoint (`POST /v1/traces`, protobuf), keeping what it got."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        found = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    found.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                        )
                    )
        with self.lock:
            self.spans += found

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def otlp() -> Iterator[tuple[OtlpReceiver, str]]:
    receiver = OtlpReceiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # http.server's name
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            if self.path == "/v1/traces":
                receiver.take(body)
            answer = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield receiver, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def observed(
    tmp_path_factory: pytest.TempPathFactory, otlp: tuple[OtlpReceiver, str]
) -> Iterator[Gateway]:
    """A gateway whose services export traces to the receiver and serve /metrics."""
    base = tmp_path_factory.mktemp("observed")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp[1])
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within a fraction of a second
        gateway = Gateway(
            with_mcp=True,
            with_http=True,
            data_dir=base / "data",
            registry_dir=make_test_registry(base / "reg"),
        )
        gateway.stack.health_grace_s = HEALTH_GRACE_S
        gateway.start()
    yield gateway
    gateway.stop()


async def _wait_for(predicate, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(0.2)


def _scrape(service: ServiceProcess) -> str:
    with urllib.request.urlopen(f"{service.http_url}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def _sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_one_calls_spans_form_one_trace(
    observed: Gateway, otlp: tuple[OtlpReceiver, str]
) -> None:
    receiver, _ = otlp
    call_id = new_call_id()
    async with await observed.client() as client:
        result = await client.call("echo", {"payload": 1}, principal=BOB, call_id=call_id)
    assert result.ok
    # The call's trace id: the one every event of the call carries (derived from call_id).
    trace_id = traceparent_of_call(call_id)
    expected = {
        "process validator",
        "process policy",
        "process executor-echo",
        "execute_tool echo",
        "process attacher-ExecutionSucceeded",
    }

    async def all_exported() -> bool:
        return expected <= {s.name for s in receiver.of_trace(trace_id)}

    await _wait_for(all_exported)
    spans = {s.name: s for s in receiver.of_trace(trace_id)}
    # One trace, each stage the child of the stage that published its input.
    assert spans["process policy"].parent_span_id == spans["process validator"].span_id
    assert spans["process executor-echo"].parent_span_id == spans["process policy"].span_id
    tool = spans["execute_tool echo"]
    assert tool.parent_span_id == spans["process executor-echo"].span_id
    assert (
        spans["process attacher-ExecutionSucceeded"].parent_span_id
        == spans["process executor-echo"].span_id
    )
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "echo"
    assert tool.attributes["gen_ai.tool.call.id"] == call_id
    assert "error.type" not in tool.attributes
    assert {s.service for s in spans.values()} == {
        "toolgate-validator",
        "toolgate-policy",
        "toolgate-executor",
        "toolgate-attacher",
    }


def traceparent_of_call(call_id: str) -> str:
    from toolgate.contracts.calls import ToolCall

    call = ToolCall(call_id=call_id, tool="echo", arguments={}, principal=BOB)
    return traceparent_of(call).split("-")[1]


async def test_a_failed_tool_run_says_its_error_type(
    observed: Gateway, otlp: tuple[OtlpReceiver, str]
) -> None:
    receiver, _ = otlp
    call_id = new_call_id()
    async with await observed.client() as client:
        result = await client.call("slow_backend", {"sleep_s": 5}, principal=BOB, call_id=call_id)
    assert result.status == "timeout"
    trace_id = traceparent_of_call(call_id)

    async def exported() -> bool:
        return any(s.name == "execute_tool slow_backend" for s in receiver.of_trace(trace_id))

    await _wait_for(exported)
    tool = next(s for s in receiver.of_trace(trace_id) if s.name == "execute_tool slow_backend")
    assert tool.attributes["error.type"] == "TOOL_TIMEOUT"


async def test_metrics_and_status_count_the_calls(
    observed: Gateway, capsys: pytest.CaptureFixture[str]
) -> None:
    async with await observed.client() as client:
        for i in range(3):
            assert (await client.call("echo", {"payload": i}, principal=BOB)).ok
    attacher, policy, executor = (observed.service(n) for n in ("attacher", "policy", "executor"))
    ok_calls = _sample(_scrape(attacher), "toolgate_calls_total", status="ok", tool="echo")
    assert ok_calls is not None and ok_calls >= 3
    allowed = _sample(_scrape(policy), "toolgate_decisions_total", outcome="allowed")
    assert allowed is not None and allowed >= 3

    async def lag_gauges_read() -> bool:  # refreshed from JetStream every few seconds
        text = await asyncio.to_thread(_scrape, executor)
        pending = _sample(
            text, "toolgate_consumer_pending", durable="executor-echo", stream="TOOLGATE_EVENTS"
        )
        return pending is not None

    await _wait_for(lag_gauges_read)
    approvals = observed.service("approvals")

    async def approvals_counted() -> bool:  # read from the approvals bucket
        text = await asyncio.to_thread(_scrape, approvals)
        return _sample(text, "toolgate_approvals_pending") == 0.0

    await _wait_for(approvals_counted)
    text = _scrape(executor)
    assert _sample(text, "toolgate_tool_seconds_count", status="ok", tool="echo") is not None
    assert _sample(text, "toolgate_dependency_up", dependency="nats") == 1.0

    data = observed.data_dir
    code = await asyncio.to_thread(
        toolgate,
        [
            "status",
            "--data-dir",
            str(data),
            "--nats-url",
            observed.url,
            "--creds",
            str(observed.stack.creds_of("admin")),
        ],
    )
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "executor-echo" in out and "attacher-ExecutionSucceeded" in out
    assert "approvals waiting: 0" in out
    for name in ("validator", "policy", "executor", "attacher", "approvals"):
        assert any(line.split()[:2] == [name, "up"] for line in out.splitlines()), out


async def test_a_service_that_lost_nats_fails_its_health_check_and_is_restarted(
    observed: Gateway,
) -> None:
    validator = observed.service("validator")
    health = f"{validator.http_url}/healthz"
    assert (probe(health) or {}).get("alive") is True
    assert observed.stack.nats is not None
    observed.stack.nats.stop()
    try:

        async def failing() -> bool:
            verdict = await asyncio.to_thread(probe, health)
            return verdict is not None and verdict["alive"] is False

        await _wait_for(failing)
        assert "nats" in " ".join(probe(health)["why"])  # type: ignore[index]
        pid = validator.process.pid if validator.process else None
        # `toolgate up`'s supervisor asks the same /healthz: twice failing, restarted.
        observed.stack.restart_unhealthy(every_s=0)
        observed.stack.restart_unhealthy(every_s=0)
        assert validator.restarts == 1 and validator.process and validator.process.pid != pid
    finally:
        observed.stack.nats.start()

    async def healthy_again() -> bool:
        verdict = await asyncio.to_thread(probe, health)
        return verdict is not None and verdict["alive"] is True

    await _wait_for(healthy_again)
    async with await observed.client() as client:
        assert (await client.call("echo", {"payload": "back"}, principal=BOB)).ok


def test_the_endpoint_answers_404_elsewhere(observed: Gateway) -> None:
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{observed.service('attacher').http_url}/nope", timeout=5)
    assert missing.value.code == 404


@pytest.fixture
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("audited-health")
    gateway = Gateway(
        data_dir=base / "data",
        registry_dir=make_test_registry(base / "reg"),
        with_audit=True,
        with_http=True,
    )
    gateway.stack.health_grace_s = HEALTH_GRACE_S
    gateway.start()
    yield gateway
    gateway.stop()


async def test_the_audit_fails_its_health_check_while_clickhouse_is_lost(
    audited: Gateway,
) -> None:
    audit = audited.service("audit")
    health = f"{audit.http_url}/healthz"
    clickhouse = audited.stack.clickhouse
    assert clickhouse is not None

    async def verdict_is(alive: bool) -> bool:
        verdict = await asyncio.to_thread(probe, health)
        return verdict is not None and verdict["alive"] is alive

    async def both_answer() -> bool:
        verdict = await asyncio.to_thread(probe, health)
        return verdict is not None and verdict["ready"] is True

    # Ready, not only alive: within its first grace the audit is alive before it has
    # connected to NATS (it does once ClickHouse has its schema and genesis seal), and
    # ClickHouse lost then would leave NATS never answering too.
    await _wait_for(both_answer)
    clickhouse.kill()
    try:
        await _wait_for(lambda: verdict_is(False))
        why = " ".join((probe(health) or {}).get("why") or [])
        assert "clickhouse" in why and "nats" not in why
    finally:
        clickhouse.ensure_running()
    await _wait_for(lambda: verdict_is(True))
    async with await audited.client() as client:  # and the audit writes again
        assert (await client.call("echo", {"payload": "after"}, principal=BOB)).ok


async def test_an_mcp_clients_trace_goes_on_through_the_front_door(
    observed: Gateway, otlp: tuple[OtlpReceiver, str]
) -> None:
    """An instrumented MCP client sends its trace context in `_meta`: the front door's
    span (the SDK's `tools/call echo`) is its child, and the call's spans in the
    pipeline are the front door's children, in the client's trace."""
    from tests.mcp_support import agent_token, mcp_client, wait_for_front_door

    receiver, _ = otlp
    await wait_for_front_door(observed)
    client_trace, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    meta = {"traceparent": f"00-{client_trace}-{client_span}-01"}
    token = await agent_token(observed, "acme", "researcher")
    async with mcp_client(observed.stack.mcp_url or "", token) as c:
        answer = await c.call_tool("echo", {"payload": "traced"}, meta=meta)
    assert not answer.is_error

    async def exported() -> bool:
        names = {s.name for s in receiver.of_trace(client_trace)}
        return {"tools/call echo", "process validator", "execute_tool echo"} <= names

    await _wait_for(exported)
    spans = {s.name: s for s in receiver.of_trace(client_trace)}
    door = spans["tools/call echo"]
    assert door.service == "toolgate-mcp" and door.parent_span_id == client_span
    assert door.attributes["gen_ai.tool.name"] == "echo"
    assert spans["process validator"].parent_span_id == door.span_id
    assert spans["execute_tool echo"].service == "toolgate-executor"
