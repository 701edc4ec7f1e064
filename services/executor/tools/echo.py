"""echo: return the payload unchanged (health checks and gateway benchmarks)."""

from __future__ import annotations

from typing import Any

from toolgate.contracts.tooling import ToolContext, runs_inline


@runs_inline  # a dict lookup: a thread hop would cost more than the tool
def echo(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    # An absent payload is returned as an empty object, not {"payload": None}:
    # the output then says exactly what the input said.
    if "payload" in arguments:
        return {"payload": arguments["payload"]}
    return {}
