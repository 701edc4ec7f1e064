"""`toolgate serve mcp`, `toolgate agents token`, `toolgate tools import-mcp`: the MCP commands.

toolgate serve mcp [--port N]             the MCP front door (Streamable HTTP, bearer tokens)
toolgate agents token TENANT AGENT        print a new bearer token for that agent
toolgate tools import-mcp URL --prefix NAME --out DIR
toolgate tools import-mcp --prefix NAME --out DIR -- COMMAND [ARGS...]
                                          one registry file per upstream MCP tool, pinned
                                          (Streamable HTTP at URL, or a stdio server)
toolgate tools diff NAME                  the upstream's definition against the pinned one
toolgate tools accept NAME                pin the upstream's current definition (reviewed)
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
    from toolgate.cli.common import Failed

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
        from toolgate.cli.agents import not_told

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
    from toolgate.cli.agents import NEVER_UP, push_account
    from toolgate.stack import nats_auth

    if not (data_dir / nats_auth.AUTH_DIR).is_dir():
        return f"{NEVER_UP}: nothing in {data_dir / nats_auth.AUTH_DIR}"
    _, token = nats_auth.mcp_front_account_jwt(nats_auth.AuthKeys.load(data_dir), data_dir)
    return push_account(args, data_dir, token)


def registry_name(prefix: str, tool: str) -> str:
    """A registry tool name (subject-safe) for an upstream tool: PREFIX_TOOL, lower case."""
    slug = re.sub(r"[^a-z0-9_]+", "_", tool.lower()).strip("_") or "tool"
    return f"{prefix}_{slug}"[:64]


def registry_entry(
    upstream: dict[str, Any], server: str, prefix: str, tool: Any, agents: list[str]
) -> dict[str, Any]:
    """One registry file for one upstream tool: its schemas and description, pinned by hash
    (and the pinned definition itself, for `toolgate tools diff`), at risk high and
    requiring approval until an operator reviews and edits it. `upstream` holds the
    transport fields of `mcp:` (url and headers, or command, args, env, cwd)."""
    from toolgate.services.executor.upstream_mcp import definition_hash, definition_of

    return {
        "name": registry_name(prefix, tool.name),
        "description": tool.description or f"{tool.name} of the MCP server {server}",
        "input_schema": tool.input_schema,
        "output_schema": tool.output_schema or CONTENT_OUTPUT_SCHEMA,
        "mcp": {
            **upstream,
            "tool": tool.name,
            "definition_sha256": definition_hash(tool),
            "definition": definition_of(tool).model_dump(mode="json"),
            # An isError answer is the tool's verdict on these arguments: not retried.
            "error_results_retryable": False,
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


async def list_upstream(upstream: Any) -> list[Any]:
    """Every tool an upstream (an McpUpstream) lists, on a session of its own."""
    from mcp import Client

    from toolgate.services.executor.upstream_mcp import (
        list_upstream_tools,
        open_client,
        stdio_transport,
        upstream_headers,
    )

    if upstream.url is not None:
        client, http = open_client(upstream.url, upstream_headers(upstream))
        async with http, client:
            return await list_upstream_tools(client)
    async with Client(stdio_transport(upstream), cache=None) as client:
        return await list_upstream_tools(client)


def _root_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def upstream_fields(args: argparse.Namespace, what: str) -> dict[str, Any]:
    """The transport fields of `mcp:` from the command line: a URL, or a command after
    `--` with its environment (--env, --pass-env) and working directory (--cwd)."""
    target: list[str] = args.target
    if not target:
        raise _fail(f"{what}: name the upstream: URL, or -- COMMAND [ARGS...]", 2)
    if len(target) == 1 and re.match(r"^https?://", target[0]):
        headers_from_env: dict[str, str] = {}
        for pair in args.header_env:
            header, _, variable = pair.partition("=")
            if not header or not variable:
                raise _fail(f"{what}: --header-env {pair!r} is not HEADER=VAR", 2)
            headers_from_env[header] = variable
        if args.env or args.pass_env or args.cwd is not None:
            raise _fail(f"{what}: --env, --pass-env and --cwd are for a stdio command", 2)
        return {"url": target[0], "headers_from_env": headers_from_env}
    if args.header_env:
        raise _fail(f"{what}: --header-env is for an HTTP URL", 2)
    literal: dict[str, str] = {}
    for pair in args.env:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise _fail(f"{what}: --env {pair!r} is not NAME=VALUE", 2)
        literal[name] = value
    passed = list(dict.fromkeys(([] if args.no_path else ["PATH"]) + args.pass_env))
    fields: dict[str, Any] = {
        "command": target[0],
        "args": target[1:],
        "env": literal,
        "env_from_gateway": passed,
    }
    if args.cwd is not None:
        fields["cwd"] = str(args.cwd.resolve())
    return fields


def cmd_import_mcp(args: argparse.Namespace) -> int:
    from toolgate.contracts.calls import ErrorCode
    from toolgate.contracts.registry import McpUpstream, RegistryError, load_tool_file
    from toolgate.contracts.subjects import TOOL_NAME_PATTERN
    from toolgate.services.executor.upstream_mcp import duplicate_tool_names

    what = "toolgate tools import-mcp"
    if not TOOL_NAME_PATTERN.fullmatch(args.prefix) or len(args.prefix) > 40:
        raise _fail(
            f"{what}: --prefix {args.prefix!r} must be lower-case letters, "
            "digits and '_', starting with a letter (at most 40)",
            2,
        )
    fields = upstream_fields(args, what)
    try:
        upstream = McpUpstream(**fields, tool="-", definition_sha256="0" * 64)
    except Exception as exc:
        raise _fail(f"{what}: {_root_cause(exc)}", 2) from None
    server = upstream.server
    try:
        tools = asyncio.run(asyncio.wait_for(list_upstream(upstream), args.timeout))
    except Exception as exc:  # the SDK's, httpx's, the process's or a timeout: one line
        cause = _root_cause(exc)
        from toolgate.contracts.tooling import ToolRefused

        if isinstance(cause, ToolRefused):  # a header or variable not set here
            raise _fail(f"{what}: {cause}", 2) from None
        raise _fail(
            f"{what}: cannot list the tools of {server}: {type(cause).__name__}: {cause}",
            3,
        ) from None
    if not tools:
        raise _fail(f"{what}: {server} lists no tools", 1)
    twice = duplicate_tool_names(tools)
    if twice:  # which of two definitions would be "the" tool is the upstream's choice
        raise _fail(
            f"{what}: {server} lists the tool {twice[0]!r} more than "
            f"once ({ErrorCode.UPSTREAM_DUPLICATE_TOOL}): nothing written",
            1,
        )
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    agents = [a for a in args.agents.split(",") if a] or ["*"]
    names: set[str] = set()
    written: list[Path] = []
    for tool in tools:
        entry = registry_entry(fields, server, args.prefix, tool, agents)
        if entry["name"] in names:
            raise _fail(f"{what}: two upstream tools map to {entry['name']}", 1)
        names.add(entry["name"])
        path = out / f"{entry['name']}.yaml"
        header = (
            f"# Imported from {server} (tool {tool.name!r}) by `toolgate tools import-mcp` "
            f"on {time.strftime('%Y-%m-%d', time.gmtime())}.\n"
            "# Review before serving: the description is the upstream's own text (a model "
            "reads it).\n# risk/requires_approval/read_only/allowed_agents are safe defaults: "
            "edit them.\n# If the upstream changes this tool's definition, calls are refused "
            "(UPSTREAM_CHANGED)\n# until it is reviewed: toolgate tools diff NAME, toolgate tools "
            "accept NAME.\n"
        )
        path.write_text(header + yaml.safe_dump(entry, sort_keys=False, allow_unicode=True))
        try:
            load_tool_file(path)
        except RegistryError as exc:
            path.unlink()
            raise _fail(f"{what}: {tool.name!r} cannot be a tool: {exc}", 1) from None
        written.append(path)
    for path in written:
        print(path)
    print(
        f"{len(written)} tool(s) of {server} written to {out}: review them, then "
        f"toolgate up --registry {out} (beside the others: one --registry per directory)",
        file=sys.stderr,
    )
    return 0


# ---------------------------------------------------------------- tools diff / accept


def find_entry(dirs: list[Path], name: str, what: str) -> tuple[Path, Any]:
    """The registry file that declares tool `name` (an `mcp:` entry) in `dirs`."""
    from toolgate.contracts.registry import RegistryError, load_tool_file

    if not dirs:
        raise _fail(
            f"{what}: no registry directory (--registry DIR, $TOOLGATE_REGISTRY, or the "
            "directories toolgate up recorded)",
            2,
        )
    for directory in dirs:
        for path in sorted(Path(directory).glob("*.yaml")):
            try:
                spec = load_tool_file(path)
            except RegistryError:
                continue
            if spec.name == name:
                if spec.mcp is None:
                    raise _fail(f"{what}: {name} ({path}) is not an upstream MCP tool", 2)
                return path, spec
    raise _fail(f"{what}: no tool {name!r} in {', '.join(map(str, dirs))}", 2)


def served_tool(spec: Any, what: str, timeout: float) -> Any:
    """The upstream's current definition of the entry's tool (a session of its own)."""
    from toolgate.services.executor.upstream_mcp import duplicate_tool_names

    upstream = spec.mcp
    try:
        tools = asyncio.run(asyncio.wait_for(list_upstream(upstream), timeout))
    except Exception as exc:
        cause = _root_cause(exc)
        raise _fail(
            f"{what}: cannot list the tools of {upstream.server}: {type(cause).__name__}: {cause}",
            3,
        ) from None
    twice = duplicate_tool_names(tools)
    if twice:
        raise _fail(f"{what}: {upstream.server} lists the tool {twice[0]!r} more than once", 1)
    tool = next((t for t in tools if t.name == upstream.tool), None)
    if tool is None:
        raise _fail(f"{what}: {upstream.server} no longer lists the tool {upstream.tool!r}", 1)
    return tool


def _shown(value: Any) -> str:
    from toolgate.runtime.outside_text import visible_json

    return "(absent)" if value is _ABSENT else visible_json(value)


_ABSENT = object()


def _at(value: Any, pointer: str) -> Any:
    from toolgate.contracts.registry import pointer_steps

    for step in pointer_steps(pointer) if pointer else []:
        if isinstance(value, dict) and step in value:
            value = value[step]
        elif isinstance(value, list) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]
        else:
            return _ABSENT
    return value


def diff_lines(pinned: Any, served: Any) -> list[str]:
    """`toolgate tools diff`'s body: each change, the pinned value (-) and the served (+)."""
    from toolgate.runtime.outside_text import visible
    from toolgate.services.executor.upstream_mcp import json_changes

    lines: list[str] = []
    if pinned.description != served.description:
        lines += [
            "description:",
            f"- {visible(pinned.description)}",
            f"+ {visible(served.description)}",
        ]
    for field in ("input_schema", "output_schema"):
        old, new = getattr(pinned, field), getattr(served, field)
        for change in json_changes(old, new):
            pointer, _, kind = change.rpartition(" ")
            pointer = "" if pointer == "(the whole schema)" else pointer
            lines += [
                f"{field} {visible(pointer) or '(whole)'} {kind}:",
                f"- {_shown(_at(old, pointer) if old is not None else _ABSENT)}",
                f"+ {_shown(_at(new, pointer) if new is not None else _ABSENT)}",
            ]
    return lines


def cmd_tools_diff(args: argparse.Namespace) -> int:
    from toolgate.services.executor.upstream_mcp import definition_hash, definition_of

    what = "toolgate tools diff"
    path, spec = find_entry(_registry_dirs(args), args.name, what)
    tool = served_tool(spec, what, args.timeout)
    served = definition_of(tool)
    if definition_hash(tool) == spec.mcp.definition_sha256:
        print(f"{args.name}: {spec.mcp.server} serves the pinned definition ({path})")
        return 0
    if spec.mcp.definition is None:
        print(
            f"{args.name}: {spec.mcp.server} serves another definition than the pinned one; "
            f"{path} keeps only its hash, so here is the served one (accept pins it):"
        )
        from toolgate.runtime.outside_text import visible_json

        print(visible_json(served.model_dump(mode="json"), indent=2))
        return 0
    print(f"{args.name}: {spec.mcp.server} serves another definition than the pinned one ({path})")
    for line in diff_lines(spec.mcp.definition, served):
        print(line)
    print(
        f"(- pinned, + served {definition_hash(tool)[:16]}; after review: toolgate tools "
        f"accept {args.name} --expect {definition_hash(tool)[:16]})"
    )
    return 0


def accepted_entry(raw: dict[str, Any], tool: Any) -> tuple[dict[str, Any], list[str]]:
    """The registry entry with the served definition pinned; the top-level description and
    schemas follow it where they were still the pinned upstream's (an operator's own edit
    is kept). Returns the entry and the top-level fields it changed."""
    from toolgate.services.executor.upstream_mcp import definition_hash, definition_of

    entry = dict(raw)
    upstream = dict(entry["mcp"])
    old = upstream.get("definition")
    new = definition_of(tool).model_dump(mode="json")
    changed: list[str] = []
    if isinstance(old, dict):
        followed = {
            "description": (old.get("description"), new["description"]),
            "input_schema": (old.get("input_schema"), new["input_schema"]),
            "output_schema": (
                old.get("output_schema") or CONTENT_OUTPUT_SCHEMA,
                new["output_schema"] or CONTENT_OUTPUT_SCHEMA,
            ),
        }
        for field, (before, after) in followed.items():
            if entry.get(field) == before and before != after:
                entry[field] = after
                changed.append(field)
    upstream["definition_sha256"] = definition_hash(tool)
    upstream["definition"] = new
    entry["mcp"] = upstream
    return entry, changed


def cmd_tools_accept(args: argparse.Namespace) -> int:
    import getpass

    from toolgate.contracts.registry import RegistryError, load_tool_file
    from toolgate.services.executor.upstream_mcp import definition_hash

    what = "toolgate tools accept"
    path, spec = find_entry(_registry_dirs(args), args.name, what)
    tool = served_tool(spec, what, args.timeout)
    new_sha = definition_hash(tool)
    if new_sha == spec.mcp.definition_sha256:
        print(f"{args.name}: already pinned to what {spec.mcp.server} serves; nothing to accept")
        return 0
    if args.expect and not new_sha.startswith(args.expect):
        raise _fail(
            f"{what}: {spec.mcp.server} now serves definition {new_sha[:16]}, not the "
            f"{args.expect} you reviewed: run toolgate tools diff {args.name} again",
            1,
        )
    who = args.by or getpass.getuser()
    text = path.read_text()
    comments = [line for line in text.splitlines() if line.startswith("#")]
    raw = yaml.safe_load(text)
    entry, changed = accepted_entry(raw, tool)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    comments.append(
        f"# {stamp}: {who} accepted definition {new_sha[:16]} "
        f"(was {spec.mcp.definition_sha256[:16]}) with toolgate tools accept"
    )
    staged = path.with_suffix(".accepting")
    staged.write_text(
        "\n".join(comments) + "\n" + yaml.safe_dump(entry, sort_keys=False, allow_unicode=True)
    )
    try:
        load_tool_file(staged)
    except RegistryError as exc:
        staged.unlink()
        raise _fail(f"{what}: the served definition cannot be a tool: {exc}", 1) from None
    from toolgate.cli.tools_registry import AcceptanceNotRecorded, record_acceptance

    try:  # audited first (the gateway's events, into ClickHouse): no pin changes unrecorded
        where = record_acceptance(
            args.data_dir, args.name, spec.mcp, new_sha, who, changed, path, stamp
        )
    except AcceptanceNotRecorded as exc:
        staged.unlink()
        raise _fail(f"{what}: {exc}", 3) from None
    staged.replace(path)
    print(
        f"{args.name}: pinned definition {new_sha[:16]} in {path}"
        + (f" (updated {', '.join(changed)})" if changed else "")
        + f"; accepted by {who}, recorded in {where}. Serve it with `toolgate tools push "
        f"{path.parent}` (or executors pick it up at their next start)"
    )
    return 0


def _registry_dirs(args: argparse.Namespace) -> list[Path]:
    if args.registry:
        return list(args.registry)
    return env.recorded_registry(args.data_dir)[0]


def _add_upstream_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=IMPORT_TIMEOUT_S,
        help="seconds to wait for the upstream (default %(default)s)",
    )


def register(commands: Any) -> None:
    tools = commands.add_parser("tools", help="bring tools into the registry")
    actions = tools.add_subparsers(dest="action", required=True)
    importer = actions.add_parser(
        "import-mcp",
        help="write one registry file per tool of an upstream MCP server (Streamable HTTP "
        "at URL, or a stdio server: -- COMMAND [ARGS...])",
    )
    importer.add_argument(
        "target",
        nargs="*",
        metavar="URL | -- COMMAND [ARGS...]",
        help="the upstream's MCP endpoint (e.g. http://127.0.0.1:9000/mcp), or after `--` "
        "the command that starts a stdio server (e.g. -- mcp-server-time)",
    )
    importer.add_argument(
        "--prefix", required=True, help="registry names become PREFIX_<tool> (lower case)"
    )
    importer.add_argument("--out", type=Path, required=True, help="directory to write into")
    importer.add_argument(
        "--header-env",
        action="append",
        default=[],
        help="HTTP: HEADER=VAR: send header HEADER with the value of $VAR (to list now, and "
        "from the executor's environment at each call); repeatable",
    )
    importer.add_argument(
        "--env",
        action="append",
        default=[],
        help="stdio: NAME=VALUE in the server's environment (written into the entry: no "
        "secrets); repeatable",
    )
    importer.add_argument(
        "--pass-env",
        action="append",
        default=[],
        help="stdio: NAME: pass $NAME from the executor's environment (a secret stays out of "
        "the file); repeatable. PATH is passed unless --no-path",
    )
    importer.add_argument(
        "--no-path",
        action="store_true",
        help="stdio: do not pass PATH (the server then gets only --env and --pass-env)",
    )
    importer.add_argument(
        "--cwd", type=Path, default=None, help="stdio: the server's working directory"
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
    from toolgate.cli.tools_registry import register as register_served  # push, list

    register_served(actions)
    for action, helptext in (
        ("diff", "show an upstream tool's served definition against the pinned one"),
        ("accept", "pin an upstream tool's served definition, after review"),
    ):
        sub = actions.add_parser(action, help=helptext)
        sub.add_argument("name", help="the registry name of the tool, e.g. time_get_current_time")
        sub.add_argument(
            "--registry",
            type=Path,
            action="append",
            default=None,
            help="directory of tool files to look in; repeatable (default: $TOOLGATE_REGISTRY, "
            "else what toolgate up recorded)",
        )
        sub.add_argument(
            "--data-dir",
            type=Path,
            default=env.env_data_dir(),
            help="state directory (default: $TOOLGATE_DATA_DIR, else %(default)s)",
        )
        _add_upstream_flags(sub)
        if action == "accept":
            sub.add_argument(
                "--by",
                default=None,
                help="who accepts, for the record (default: the login name)",
            )
            sub.add_argument(
                "--expect",
                default=None,
                help="the served definition's sha256 (a prefix) as `tools diff` showed it: "
                "refused if the upstream changed again since",
            )
        sub.set_defaults(func=cmd_tools_diff if action == "diff" else cmd_tools_accept)
