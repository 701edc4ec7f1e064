"""The front door runs the SDK's per-request span only while something records spans."""

from __future__ import annotations

from typing import Any

import pytest
from mcp.server._otel import OpenTelemetryMiddleware
from opentelemetry.sdk.trace import TracerProvider

from toolgate.contracts.registry import Registry
from toolgate.services.mcp_front import app
from toolgate.services.mcp_front.app import FrontDoor, FrontDoorOptions, SpansWhenRecorded


class Recorder:
    """Stands in for the SDK's middleware: says whether it ran."""

    def __init__(self) -> None:
        self.ran = 0

    async def __call__(self, ctx: Any, call_next: Any) -> Any:
        self.ran += 1
        return await call_next(ctx)


async def call_next(ctx: Any) -> str:
    return f"handled {ctx}"


async def test_no_tracer_provider_no_sdk_span(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    spans = SpansWhenRecorded(recorder)  # type: ignore[arg-type]
    assert await spans("ctx", call_next) == "handled ctx"  # type: ignore[arg-type]
    assert recorder.ran == 0
    monkeypatch.setattr(app, "get_tracer_provider", TracerProvider)  # one is set: spans
    assert await spans("ctx", call_next) == "handled ctx"  # type: ignore[arg-type]
    assert recorder.ran == 1


def test_the_front_doors_server_wraps_the_sdks_span_middleware() -> None:
    server = app.build_server(FrontDoor(Registry({}), FrontDoorOptions()))
    assert not any(isinstance(m, OpenTelemetryMiddleware) for m in server.middleware)
    wrapped = [m for m in server.middleware if isinstance(m, SpansWhenRecorded)]
    assert len(wrapped) == 1 and isinstance(wrapped[0].otel, OpenTelemetryMiddleware)
