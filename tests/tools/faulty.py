"""Tools that misbehave on purpose, for the system tests. Never shipped."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from toolgate.contracts.tooling import ToolContext


def slow_backend(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    time.sleep(float(arguments.get("sleep_s", 30)))
    return {"done": True}


def broken_output(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    # output_schema wants {"items": [...]}; this is what a broken backend sends.
    return {"items": "not-a-list", "leaked": "internal detail"}


def count_runs(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    """A side effect we can count: one line per real run, in the runtime's dir."""
    ctx.data_dir.mkdir(parents=True, exist_ok=True)
    with open(ctx.data_dir / "runs.log", "a") as handle:
        handle.write(f"{ctx.call_id} {os.getpid()}\n")
    time.sleep(float(arguments.get("sleep_s", 0)))
    return {"call_id": ctx.call_id}


def runs_of(data_dir: Path, tool: str = "count_runs") -> list[str]:
    path = data_dir / "tools" / tool / "runs.log"
    if not path.exists():
        return []
    return [line.split()[0] for line in path.read_text().splitlines()]
