"""A tool whose arguments and results are secrets (audited as `hash`). Test only."""

from __future__ import annotations

from typing import Any

from toolgate.contracts.tooling import ToolContext


def vault_lookup(arguments: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    mode = arguments.get("mode", "ok")
    if mode == "raise":
        raise RuntimeError(f"vault refused token {arguments['token']}")
    if mode == "broken":  # breaks output_schema, quoting its input
        return {"balance": f"unknown for {arguments['token']}"}
    return {"balance": 42, "echo": arguments["token"]}
