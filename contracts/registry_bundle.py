"""The served registry as data: a pushed bundle's files, and an agent's own tool listing.

`toolgate tools push DIR` pushes the `*.yaml` files of DIR (the same files a
`--registry DIR` holds) as one signed bundle (runtime/served_registry.py). Every
service builds its registry from the bundle's files plus the built-in tools (unless
it runs with `--no-builtin-tools`), exactly as it would from the directory.

An agent asks for the tools it may call with a request on
`toolgate.tools.<tenant>.<agent>` (subjects.tools_listing_subject); the answer is a
`ToolListing`: the served version and each tool the agent may call, with what a
model and a framework need (name, description, schemas, risk, approval), never how
it is implemented (no function, upstream, URL, command or settings).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from toolgate.contracts.registry import (
    BUILTIN_TOOLS_DIR,
    Registry,
    RegistryError,
    ToolSpec,
    load_registry,
    load_tool_text,
)

# The largest registry bundle a push writes (the bucket's values are NATS messages).
MAX_BUNDLE_BYTES = 1024 * 1024
# The function a tool rebuilt from a listing names: it has no implementation here.
LISTED_FUNCTION = "toolgate.contracts.registry_bundle:served_by_the_gateway"


def read_registry_dir(directory: Path) -> dict[str, str]:
    """The `*.yaml` files of a registry directory, by file name (RegistryError if none)."""
    if not directory.is_dir():
        raise RegistryError(f"{directory}: not a directory")
    files = {path.name: path.read_text() for path in sorted(directory.glob("*.yaml"))}
    if not files:
        raise RegistryError(f"{directory}: no tool files (*.yaml) in it")
    return files


def registry_from_files(files: Mapping[str, str], builtin_tools: bool) -> Registry:
    """The registry a service serves from a pushed bundle: the built-in tools (unless
    `builtin_tools` is false), then the bundle's files; a name declared twice is refused."""
    base = load_registry(BUILTIN_TOOLS_DIR) if builtin_tools else Registry({})
    tools = {spec.name: spec for spec in base}
    declared_in = {name: "the built-in tools" for name in tools}
    for file_name in sorted(files):
        if not file_name.endswith(".yaml") or "/" in file_name:
            raise RegistryError(f"{file_name}: a registry bundle holds only *.yaml files")
        spec = load_tool_text(files[file_name], file_name)
        if spec.name in tools:
            raise RegistryError(
                f"{file_name}: tool '{spec.name}' is declared twice, also in "
                f"{declared_in[spec.name]}"
            )
        tools[spec.name] = spec
        declared_in[spec.name] = file_name
    if not tools:
        raise RegistryError("the bundle declares no tool")
    return Registry(tools)


class ListedTool(msgspec.Struct, frozen=True, kw_only=True):
    """One tool as an agent sees it in its listing."""

    name: str
    description: str
    input_schema: dict[str, Any]
    output_schema: dict[str, Any]
    read_only: bool
    risk: str
    requires_approval: bool
    action: str
    timeout_s: float
    idempotent: bool = False
    # It reaches outside the gateway (an upstream MCP server, an HTTP API, a send or
    # publish): MCP's openWorldHint.
    open_world: bool = False
    # Its result is an upstream's MCP content, passed through as it came (`passes_content`).
    content_passthrough: bool = False


class ToolListing(msgspec.Struct, frozen=True, kw_only=True):
    """The answer on an agent's tools subject: the tools it may call, as served now."""

    tenant: str
    agent: str
    # The registry's content hash, and the pushed version number (0: nothing pushed,
    # the gateway's local registry).
    version: str
    number: int
    tools: list[ListedTool]
    # Set instead of tools when the request cannot be answered (the subject is no agent's).
    error: str | None = None


def passes_content(spec: ToolSpec) -> bool:
    """Whether the tool's result is an upstream's MCP content, passed through as it came:
    an upstream (`mcp:`) tool that declares no output schema of its own, so the import gave
    it the content-blocks one (`{"content": [...]}`, the executor's `output_of`)."""
    if spec.mcp is None:
        return False
    schema = spec.output_schema
    properties = schema.get("properties")
    return (
        schema.get("type") == "object"
        and isinstance(properties, dict)
        and list(properties) == ["content"]
        and schema.get("required") == ["content"]
    )


def listed_tool(spec: ToolSpec) -> ListedTool:
    """What an agent's listing says of one tool."""
    return ListedTool(
        name=spec.name,
        description=spec.description,
        input_schema=spec.input_schema,
        output_schema=spec.output_schema,
        read_only=spec.read_only,
        risk=spec.risk,
        requires_approval=spec.requires_approval,
        action=spec.action_class,
        timeout_s=spec.timeout_s,
        idempotent=spec.idempotent,
        open_world=spec.mcp is not None
        or spec.http is not None
        or spec.action_class in ("send", "publish"),
        content_passthrough=passes_content(spec),
    )


def listing_for(registry: Registry, tenant: str, agent: str, number: int) -> ToolListing:
    return ToolListing(
        tenant=tenant,
        agent=agent,
        version=registry.version,
        number=number,
        tools=[listed_tool(spec) for spec in registry.visible_to(agent)],
    )


def registry_of_listing(listing: ToolListing) -> Registry:
    """The listing as a Registry a client library can show a model (each tool allowed to
    the listing's agent; none can run here: they name no implementation)."""
    tools: dict[str, ToolSpec] = {}
    for tool in listing.tools:
        tools[tool.name] = ToolSpec(
            name=tool.name,
            description=tool.description,
            input_schema=tool.input_schema,
            output_schema=tool.output_schema,
            function=LISTED_FUNCTION,
            read_only=tool.read_only,
            timeout_s=tool.timeout_s,
            risk=tool.risk,  # type: ignore[arg-type]
            requires_approval=tool.requires_approval,
            idempotent=tool.idempotent,
            action=tool.action,  # type: ignore[arg-type]
            allowed_agents=[listing.agent],
        )
    return Registry(tools)


def served_by_the_gateway(*_: Any) -> Any:
    """What a tool rebuilt from a listing runs here: nothing (the gateway runs it)."""
    raise RuntimeError("this tool runs in the gateway: publish a call instead")
