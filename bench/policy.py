"""`toolgate bench policy`: decision latency of the Cedar engine alone (no broker).

A mix of the seed's calls (allowed, cross-task, agent not allowed, a critical
tool awaiting approval), decided one at a time as the service does. For
comparison it also times Cedar given the policy text on every call, which is
what parsing once avoids.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import cedarpy

from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.registry import ToolSpec, load_registry
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, POLICY_SUFFIX, load_bundle
from toolgate.services.policy.engine import CedarEngine
from toolgate.services.policy.entities import (
    NO_APPROVAL,
    action_entities,
    call_entities,
    request_for,
    tool_entity,
)

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
BOT = Principal(tenant="acme", user="u-alice", agent="browser-bot", session="s-1")


SHAPES = ("allowed read", "allowed write", "cross-task write", "agent not allowed",
          "critical: awaits approval (two evaluations)")


def bench_calls() -> list[tuple[ToolCall, ToolSpec]]:
    registry = load_registry()
    spec = registry.get
    critical = spec("echo").model_copy(update={"risk": "critical"})  # type: ignore[union-attr]
    evidence = {"task_id": "task_c04", "claim": "x", "source_url": "https://example.org"}
    cases = [
        ("search_sources", {"query": "agents", "source_type": "any", "limit": 3}, ALICE, None),
        ("save_evidence", evidence, ALICE, None),
        ("save_evidence", {**evidence, "task_id": "task_other"}, ALICE, None),
        ("save_evidence", evidence, BOT, None),
        ("echo", {"payload": 1}, ALICE, critical),
    ]
    return [(ToolCall(call_id=f"bench-{i}", tool=tool, arguments=args, principal=who,
                      task_id="task_c04"), override or spec(tool))  # type: ignore[misc]
            for i, (tool, args, who, override) in enumerate(cases)]


def percentile(sorted_values: list[float], fraction: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))]


def run_policy_bench(n: int = 10_000, bundle_dir: Path = DEFAULT_BUNDLE_DIR) -> dict[str, float]:
    started = time.perf_counter()
    engine = CedarEngine(load_bundle(bundle_dir))
    load_ms = (time.perf_counter() - started) * 1000
    calls = bench_calls()
    for call, spec in calls * 50:  # warm up caches (tool entities) and the allocator
        engine.decide(call, spec)
    by_shape: list[list[float]] = [[] for _ in calls]
    for i in range(n):
        call, spec = calls[i % len(calls)]
        started = time.perf_counter()
        engine.decide(call, spec)
        by_shape[i % len(calls)].append((time.perf_counter() - started) * 1e6)
    latencies_us = sorted(value for shape in by_shape for value in shape)
    text_p50 = text_per_call_p50_us(engine, calls, min(n, 2000))
    figures = {
        "decisions": float(n),
        "p50_us": percentile(latencies_us, 0.50),
        "p99_us": percentile(latencies_us, 0.99),
        "mean_us": statistics.fmean(latencies_us),
        "decisions_per_s": n / (sum(latencies_us) / 1e6),
        "bundle_load_ms": load_ms,
        "text_per_call_p50_us": text_p50,
    }
    print(f"policy engine, bundle {engine.version}, {n} decisions "
          f"({len(calls)} call shapes, pure engine, no broker)")
    for name, value in figures.items():
        print(f"  {name:22} {value:12.1f}")
    for shape, values in zip(SHAPES, by_shape, strict=True):
        print(f"  p50_us {shape:43} {percentile(sorted(values), 0.5):8.1f}")
    return figures


def text_per_call_p50_us(engine: CedarEngine, calls: list[tuple[ToolCall, ToolSpec]],
                         n: int) -> float:
    """One Cedar evaluation given the policies as text, parsed on every call."""
    text = "\n".join(body for name, body in sorted(engine.bundle.files.items())
                     if name.endswith(POLICY_SUFFIX))
    latencies = []
    for i in range(n):
        call, spec = calls[i % len(calls)]
        entities = action_entities() + [tool_entity(spec)] + call_entities(call, spec, {})
        started = time.perf_counter()
        cedarpy.is_authorized(request_for(call, spec, NO_APPROVAL, 0), text, entities)
        latencies.append((time.perf_counter() - started) * 1e6)
    latencies.sort()
    return percentile(latencies, 0.50)
