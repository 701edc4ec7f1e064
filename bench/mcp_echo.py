"""A no-op upstream MCP server for `toolgate bench mcp`: one tool, `echo`, answering its
payload at once (built with the official SDK's low-level server).

    python -m toolgate.bench.mcp_echo --stdio        over stdin/stdout
    python -m toolgate.bench.mcp_echo --port N       Streamable HTTP on 127.0.0.1:N/mcp
"""

from __future__ import annotations

import argparse
from typing import Any

PAYLOAD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"payload": {}},
    "required": ["payload"],
    "additionalProperties": False,
}


def build() -> Any:
    import mcp_types as types
    from mcp.server.lowlevel import Server

    tool = types.Tool(
        name="echo",
        description="Return the given payload unchanged.",
        input_schema=PAYLOAD_SCHEMA,
        output_schema=PAYLOAD_SCHEMA,
    )

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[tool])

    async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        payload = {"payload": (params.arguments or {}).get("payload")}
        return types.CallToolResult(content=[], structured_content=payload)

    return Server("toolgate-bench-echo", on_list_tools=list_tools, on_call_tool=call_tool)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stdio", action="store_true")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = build()
    if args.stdio:
        import anyio
        from mcp.server.stdio import stdio_server

        async def run() -> None:
            async with stdio_server() as (read, write):
                await server.run(read, write, server.create_initialization_options())

        anyio.run(run)
        return
    import uvicorn

    app = server.streamable_http_app(host="127.0.0.1")
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=args.port,
        log_level="warning",
        # A kept client holds a listen stream open: do not wait on it to stop.
        timeout_graceful_shutdown=1,
    )


if __name__ == "__main__":
    main()
