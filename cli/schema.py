"""`toolgate schema`: the JSON Schema of the wire contract (ToolCall, ToolResult,
PendingNotice), printed."""

from __future__ import annotations

import argparse
import json
from typing import Any

import msgspec

from toolgate.contracts.calls import ToolCall, ToolResult


def cmd_schema(args: argparse.Namespace) -> int:
    from toolgate.contracts.calls import PendingNotice

    _, components = msgspec.json.schema_components(
        [ToolCall, ToolResult, PendingNotice], ref_template="#/$defs/{name}"
    )
    document = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "toolgate wire contract",
        "description": "Publish a ToolCall to toolgate.calls.<tenant>.<agent> with that agent's "
        "own NATS identity; read the ToolResult from "
        "toolgate.results.<tenant>.<agent>.<call_id> (stored once; a "
        "PendingNotice on <that>.pending while a human decides).",
        "$defs": components,
    }
    call_schema = components["ToolCall"]["properties"]["call_id"]
    call_schema.update({"pattern": "^[A-Za-z0-9_-]{1,128}$"})
    print(json.dumps(document, indent=2))
    return 0


def register(commands: Any) -> None:
    schema = commands.add_parser("schema", help="print the JSON Schema of the wire contract")
    schema.set_defaults(func=cmd_schema)
