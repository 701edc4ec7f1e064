"""`toolgate serve mcp`, `toolgate agents token`, `toolgate tools import-mcp`: the MCP commands.

toolgate serve mcp [--port N]             the MCP front door (Streamable HTTP, bearer tokens)
toolgate agents token TENANT AGENT        print a new bearer token for that agent
toolgate tools import-mcp URL --prefix NAME --out DIR
                                          one registry file per upstream MCP tool, pinned
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from toolgate.runtime import settings as env

IMPORT_TIMEOUT_S = 30.0
# The output_schema of an upstream tool that declares none: its content blocks.
CONTENT_OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"content": {"type": "array", "items": {"type": "object"}}},
    "required": ["content"],
    "additionalProperties": False,
}


def _fail(line: str, code: int) -> Any:
    from toolgate.cli.main import Failed

    return Failed(line, code)


# ---------------------------------------------------------------- serve mcp


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "--port",
        type=int,
        default=8940,
        help="mcp: the port of the front door (default %(default)s; 0: any free port)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="mcp: the address to bind (default %(default)s: loopback only)",
    )
    serve.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        help="mcp: an Origin a browser request may come from, besides loopback "
        "(repeatable; e.g. https://app.example.com)",
    )
    serve.add_argument(
        "--allow-host",
        action="append",
        default=[],
        help="mcp: a Host header to accept besides loopback and --host (repeatable; "
        "e.g. gateway.internal:8940)",
    )
    serve.add_argument(
        "--result-timeout",
        type=float,
        default=900.0,
        help="mcp: seconds a tools/call waits for its result, then answers 'pending' "
        "(a retry with the same _meta toolgate/call_id collects it; default %(default)s)",
    )


def serve_mcp(args: argparse.Namespace, settings: env.GatewaySettings) -> int:
    from toolgate.services.mcp_front.app import FrontDoorOptions, serve

    if not 0 <= args.port <= 65535:
        raise _fail(f"toolgate serve mcp: --port {args.port} is not a port", 2)
    if args.result_timeout <= 0:
        raise _fail("toolgate serve mcp: --result-timeout must be positive", 2)
    if args.port == 0:
        from toolgate.stack.supervisor import free_port

        args.port = free_port(args.host)
    serve(
        settings,
        FrontDoorOptions(
            host=args.host,
            port=args.port,
            allowed_origins=tuple(args.allow_origin),
            allowed_hosts=tuple(args.allow_host),
            result_timeout_s=args.result_timeout,
        ),
    )
    return 0


# ---------------------------------------------------------------- agents token


def cmd_agents_token(args: argparse.Namespace) -> int:
    from toolgate.services.mcp_front.tokens import TokenError, mint_token, token_path

    data_dir: Path = args.data_dir
    try:
        token = mint_token(data_dir, args.tenant, args.agent)
    except TokenError as exc:
        raise _fail(f"toolgate agents token: {exc}", 2) from None
    told = push_front_door_account(args, data_dir)
    print(token)
    if told is not None and not args.offline:
        from toolgate.cli.main import not_told

        raise not_told(f"a new token of agent {args.tenant}.{args.agent} was minted", told)
    mcp_url = env.read_context(data_dir).get("mcp_url") or "the MCP URL toolgate up printed"
    when = "active now" if told is None else f"active at the next toolgate up ({told})"
    print(
        f"bearer token of agent {args.tenant}.{args.agent} for {mcp_url}, {when} (shown once; "
        f"its SHA-256 is in {token_path(data_dir, args.tenant, args.agent)}; a new token "
        "replaces it; revoked with the agent)",
        file=sys.stderr,
    )
    return 0


def push_front_door_account(args: argparse.Namespace, data_dir: Path) -> str | None:
    """Tell the running server which agents the front door may act for (its account's
    imports): None once done, else why not (no server: its next start preloads it)."""
    from toolgate.cli.main import NEVER_UP, _push_account
    from toolgate.stack import nats_auth

    if not (data_dir / nats_auth.AUTH_DIR).is_dir():
        return f"{NEVER_UP}: nothing in {data_dir / nats_auth.AUTH_DIR}"
    _, token = nats_auth.mcp_front_account_jwt(nats_auth.AuthKeys.load(data_dir), data_dir)
    return _push_account(args, data_dir, token)


def registry_name(prefix: str, tool: str) -> str:
    """A registry tool name (subject-safe) for an upstream tool: PREFIX_TOOL, lower case."""
    slug = re.sub(r"[^a-z0-9_]+", "_", tool.lower()).strip("_") or "tool"
    return f"{prefix}_{slug}"[:64]


def registry_entry(
    url: str, prefix: str, tool: Any, headers_from_env: dict[str, str], agents: list[str]
) -> dict[str, Any]:
    """One registry file for one upstream tool: its schemas and description, pinned by hash,
    at risk high and requiring approval until an operator reviews and edits it."""
    from toolgate.services.executor.upstream_mcp import definition_hash

    return {
        "name": registry_name(prefix, tool.name),
        "description": tool.description or f"{tool.name} of the MCP server at {url}",
        "input_schema": tool.input_schema,
        "output_schema": tool.output_schema or CONTENT_OUTPUT_SCHEMA,
        "mcp": {
            "url": url,
            "tool": tool.name,
            "definition_sha256": definition_hash(tool),
            "headers_from_env": headers_from_env,
        },
        # The upstream's own hints are its word, not ours: nothing is read-only until
        # an operator says so.
        "read_only": False,
        "timeout_s": 30,
        "risk": "high",
        "requires_approval": True,
        "allowed_agents": agents,
        "audit": {"arguments": "full", "result": "full"},
    }


async def list_upstream(url: str, headers: dict[str, str]) -> list[Any]:
    from toolgate.services.executor.upstream_mcp import list_upstream_tools, open_client

    client, http = open_client(url, headers)
    async with http, client:
        return await list_upstream_tools(client)


def cmd_import_mcp(args: argparse.Namespace) -> int:
    from toolgate.contracts.registry import RegistryError, load_tool_file
    from toolgate.contracts.subjects import TOOL_NAME_PATTERN

    if not TOOL_NAME_PATTERN.fullmatch(args.prefix) or len(args.prefix) > 40:
        raise _fail(
            f"toolgate tools import-mcp: --prefix {args.prefix!r} must be lower-case letters, "
            "digits and '_', starting with a letter (at most 40)",
            2,
        )
    headers_from_env: dict[str, str] = {}
    for pair in args.header_env:
        header, _, variable = pair.partition("=")
        if not header or not variable:
            raise _fail(f"toolgate tools import-mcp: --header-env {pair!r} is not HEADER=VAR", 2)
        headers_from_env[header] = variable
    from toolgate.contracts.calls import ErrorCode
    from toolgate.contracts.registry import McpUpstream
    from toolgate.services.executor.upstream_mcp import duplicate_tool_names, upstream_headers

    try:
        pinned = McpUpstream(
            url=args.url, tool="-", definition_sha256="0" * 64, headers_from_env=headers_from_env
        )
        headers = upstream_headers(pinned)
    except Exception as exc:
        raise _fail(f"toolgate tools import-mcp: {exc}", 2) from None
    try:
        tools = asyncio.run(asyncio.wait_for(list_upstream(args.url, headers), args.timeout))
    except Exception as exc:  # the SDK's, httpx's or a timeout: one line
        cause = exc
        while isinstance(cause, BaseExceptionGroup) and cause.exceptions:
            cause = cause.exceptions[0]  # type: ignore[assignment]
        raise _fail(
            f"toolgate tools import-mcp: cannot list the tools of {args.url}: "
            f"{type(cause).__name__}: {cause}",
            3,
        ) from None
    if not tools:
        raise _fail(f"toolgate tools import-mcp: {args.url} lists no tools", 1)
    twice = duplicate_tool_names(tools)
    if twice:  # which of two definitions would be "the" tool is the upstream's choice
        raise _fail(
            f"toolgate tools import-mcp: {args.url} lists the tool {twice[0]!r} more than "
            f"once ({ErrorCode.UPSTREAM_DUPLICATE_TOOL}): nothing written",
            1,
        )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    agents = [a for a in args.agents.split(",") if a] or ["*"]
    names: set[str] = set()
    written: list[Path] = []
    for tool in tools:
        entry = registry_entry(args.url, args.prefix, tool, headers_from_env, agents)
        if entry["name"] in names:
            raise _fail(f"toolgate tools import-mcp: two upstream tools map to {entry['name']}", 1)
        names.add(entry["name"])
        path = out / f"{entry['name']}.yaml"
        header = (
            f"# Imported from {args.url} (tool {tool.name!r}) by `toolgate tools import-mcp` "
            f"on {time.strftime('%Y-%m-%d', time.gmtime())}.\n"
            "# Review before serving: the description is the upstream's own text (a model "
            "reads it).\n# risk/requires_approval/read_only/allowed_agents are safe defaults: "
            "edit them.\n# If the upstream changes this tool's definition, calls are refused "
            "(UPSTREAM_CHANGED)\n# until it is imported and reviewed again.\n"
        )
        path.write_text(header + yaml.safe_dump(entry, sort_keys=False, allow_unicode=True))
        try:
            load_tool_file(path)
        except RegistryError as exc:
            path.unlink()
            raise _fail(
                f"toolgate tools import-mcp: {tool.name!r} cannot be a tool: {exc}", 1
            ) from None
        written.append(path)
    for path in written:
        print(path)
    print(
        f"{len(written)} tool(s) of {args.url} written to {out}: review them, then "
        f"toolgate up --registry {out} (beside the others: one --registry per directory)",
        file=sys.stderr,
    )
    return 0


def register(commands: Any) -> None:
    tools = commands.add_parser("tools", help="bring tools into the registry")
    actions = tools.add_subparsers(dest="action", required=True)
    importer = actions.add_parser(
        "import-mcp",
        help="write one registry file per tool of an upstream MCP server (Streamable HTTP)",
    )
    importer.add_argument("url", help="the upstream's MCP endpoint, e.g. http://127.0.0.1:9000/mcp")
    importer.add_argument(
        "--prefix", required=True, help="registry names become PREFIX_<tool> (lower case)"
    )
    importer.add_argument("--out", type=Path, required=True, help="directory to write into")
    importer.add_argument(
        "--header-env",
        action="append",
        default=[],
        help="HEADER=VAR: send header HEADER with the value of $VAR (to list now, and from "
        "the executor's environment at each call); repeatable",
    )
    importer.add_argument(
        "--agents",
        default="*",
        help="comma-separated allowed_agents of the written entries (default %(default)s)",
    )
    importer.add_argument(
        "--timeout",
        type=float,
        default=IMPORT_TIMEOUT_S,
        help="seconds to wait for the upstream (default %(default)s)",
    )
    importer.set_defaults(func=cmd_import_mcp)
    from toolgate.cli.openapi import register as register_openapi  # import-openapi

    register_openapi(actions)
