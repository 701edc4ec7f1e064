"""The MCP front door: MCP over Streamable HTTP onto the wire contract (see app.py)."""
