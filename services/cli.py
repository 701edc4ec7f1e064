"""The `toolgate` command: parse, build a contract, call the library.

    toolgate up                      the whole gateway on the embedded default
    toolgate serve NAME              one service (validator|policy|executor|attacher)
    toolgate call TOOL 'JSON-ARGS'   publish one call, print its ToolResult
    toolgate result CALL_ID          fetch a stored result again
    toolgate schema                  JSON Schema of ToolCall and ToolResult
    toolgate bench                   full pipeline vs. a pass-through floor
    toolgate audit trace|sql|replay|verify   the audit trail in ClickHouse
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

import msgspec

from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.contracts.registry import RegistryError
from toolgate.services import settings as env

SERVICE_NAMES = ("validator", "policy", "executor", "attacher", "approvals", "audit")


def _add_nats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=env.env_nats_url(),
                        help="NATS server URL (default: $TOOLGATE_NATS_URL or %(default)s)")
    parser.add_argument("--creds", type=Path, default=env.env_nats_creds(),
                        help="your role's credentials on a locked bus, e.g. "
                             "DATA_DIR/creds/agent.creds (default: $TOOLGATE_NATS_CREDS)")


def _add_runtime(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", type=Path, default=env.env_data_dir(),
                        help="state directory: keys, tool data, embedded servers "
                             "(default: $TOOLGATE_DATA_DIR or .toolgate)")
    parser.add_argument("--registry", type=Path, action="append", default=None,
                        help="directory of tool YAML files; repeatable "
                             "(default: $TOOLGATE_REGISTRY or the built-in tools)")


def _settings(args: argparse.Namespace) -> env.GatewaySettings:
    return env.GatewaySettings(
        nats_url=args.nats_url, nats_creds=args.creds, data_dir=args.data_dir,
        registry_dirs=tuple(args.registry or env.env_registry_dirs()))


def cmd_up(args: argparse.Namespace) -> int:
    from toolgate.services.stack.supervisor import Stack, run_until_signalled

    executor_args = ["--concurrency", str(args.concurrency)]
    stack = Stack(data_dir=args.data_dir, nats_url=args.nats_url_given, nats_port=args.nats_port,
                  registry_dirs=list(args.registry or env.env_registry_dirs()),
                  executor_args=executor_args, clickhouse_url=args.clickhouse_url_given,
                  clickhouse_port=args.clickhouse_port, with_audit=not args.no_audit)
    return run_until_signalled(stack)


def cmd_serve(args: argparse.Namespace) -> int:
    from toolgate.services.stack.topology import apply_topology

    settings = _settings(args)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s {args.name} %(levelname)s %(message)s")
    if settings.nats_creds is None:  # on a locked bus the operator (admin) applied it
        asyncio.run(apply_topology(settings.nats_url))
    if args.name == "validator":
        from toolgate.services.validator.app import build_app
        app = build_app(settings)
    elif args.name == "policy":
        from toolgate.services.policy.app import build_app as build_policy
        app = build_policy(settings, policy_dir=args.policy)
    elif args.name == "executor":
        from toolgate.services.executor.app import build_app as build_executor
        tools = [t for t in (args.tools or "").split(",") if t]
        app = build_executor(settings, tools=tools or None, concurrency=args.concurrency)
    elif args.name == "audit":
        from toolgate.services.audit.app import build_app as build_audit
        app = build_audit(settings, args.clickhouse_url)
    elif args.name == "approvals":
        from toolgate.services.approvals.app import build_app as build_approvals
        app = build_approvals(settings)
    else:
        from toolgate.services.attacher.app import build_app as build_attacher
        app = build_attacher(settings)
    asyncio.run(app.run())
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from toolgate.services.client.gateway_client import GatewayClient, ResultTimeout, new_call_id

    try:
        arguments = json.loads(args.arguments)
    except json.JSONDecodeError as exc:
        print(f"arguments are not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(arguments, dict):
        print("arguments must be a JSON object", file=sys.stderr)
        return 2
    call = ToolCall(call_id=args.call_id or new_call_id(), tool=args.tool, arguments=arguments,
                    principal=Principal(tenant=args.tenant, user=args.user, agent=args.agent,
                                        session=args.session),
                    task_id=args.task)

    async def run() -> ToolResult:
        client = await GatewayClient.connect(args.nats_url, args.creds)
        async with client:
            return await client.submit(call, timeout=args.timeout)

    try:
        result = asyncio.run(run())
    except ResultTimeout as exc:
        print(str(exc), file=sys.stderr)
        return 3
    print(json.dumps(msgspec.to_builtins(result), indent=2, ensure_ascii=False))
    return 0 if result.ok else 1


def cmd_result(args: argparse.Namespace) -> int:
    from toolgate.services.client.gateway_client import GatewayClient

    async def run() -> ToolResult | None:
        client = await GatewayClient.connect(args.nats_url, args.creds)
        async with client:
            return await client.result(args.call_id)

    result = asyncio.run(run())
    if result is None:
        print(f"no result stored for {args.call_id}", file=sys.stderr)
        return 1
    print(json.dumps(msgspec.to_builtins(result), indent=2, ensure_ascii=False))
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from toolgate.contracts.calls import PendingNotice

    _, components = msgspec.json.schema_components([ToolCall, ToolResult, PendingNotice],
                                                   ref_template="#/$defs/{name}")
    document = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "toolgate wire contract",
        "description": "Publish a ToolCall to toolgate.calls with header Nats-Msg-Id: <call_id>; "
                       "read the ToolResult from toolgate.results.<call_id>.",
        "$defs": components,
    }
    call_schema = components["ToolCall"]["properties"]["call_id"]
    call_schema.update({"pattern": "^[A-Za-z0-9_-]{1,128}$"})
    print(json.dumps(document, indent=2))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "audit":
        from toolgate.services.audit.bench import cmd_bench_audit

        return cmd_bench_audit(args)
    if args.target == "policy":
        from toolgate.services.policy.bench import run_policy_bench

        run_policy_bench(args.calls)
        return 0
    from toolgate.services.bench.pipeline import run_bench

    return run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="toolgate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    up = commands.add_parser("up", help="start the gateway on its embedded default")
    up.add_argument("--nats-url", dest="nats_url_given", default=env.env_nats_url_or_none(),
                    help="use this NATS instead of starting one (default: $TOOLGATE_NATS_URL, "
                         "else start the embedded nats-server)")
    up.add_argument("--nats-port", type=int, default=4222,
                    help="port of the embedded NATS (default %(default)s; 0: any free port)")
    up.add_argument("--concurrency", type=int, default=8, help="executor calls in flight per tool")
    up.add_argument("--clickhouse-url", dest="clickhouse_url_given", default=None,
                    help="audit into this ClickHouse (http://host:port/database) instead of "
                         "starting the embedded one")
    up.add_argument("--clickhouse-port", type=int, default=0,
                    help="port of the embedded ClickHouse (0: any)")
    up.add_argument("--no-audit", action="store_true", help="run without ClickHouse and audit")
    _add_runtime(up)
    up.set_defaults(func=cmd_up)

    serve = commands.add_parser("serve", help="run one service")
    serve.add_argument("name", choices=SERVICE_NAMES)
    serve.add_argument("--tools", default="", help="executor: comma-separated tools (default all)")
    serve.add_argument("--concurrency", type=int, default=8,
                       help="executor: calls in flight per tool")
    serve.add_argument("--policy", type=Path, default=None,
                       help="policy: bundle directory to start with (default: the pushed "
                            "bundle, else the built-in one)")
    _add_nats(serve)
    _add_runtime(serve)
    serve.set_defaults(func=cmd_serve)

    from toolgate.services.audit.cli import add_clickhouse_url
    from toolgate.services.audit.cli import register as register_audit
    add_clickhouse_url(serve)  # audit: where to write
    register_audit(commands)

    from toolgate.services.approvals.cli import register as register_approvals
    from toolgate.services.policy.cli import register as register_policy
    register_approvals(commands)
    register_policy(commands)

    call = commands.add_parser("call", help="publish one call and print its ToolResult")
    call.add_argument("tool")
    call.add_argument("arguments", help="the arguments as a JSON object")
    call.add_argument("--user", default="u-cli")
    call.add_argument("--agent", default="researcher")
    call.add_argument("--session", default="s-cli")
    call.add_argument("--tenant", default="default")
    call.add_argument("--task", default=None)
    call.add_argument("--call-id", default=None)
    call.add_argument("--timeout", type=float, default=30.0)
    _add_nats(call)
    call.set_defaults(func=cmd_call)

    result = commands.add_parser("result", help="fetch the stored result of a call")
    result.add_argument("call_id")
    _add_nats(result)
    result.set_defaults(func=cmd_result)

    schema = commands.add_parser("schema", help="print the JSON Schema of the wire contract")
    schema.set_defaults(func=cmd_schema)

    bench = commands.add_parser("bench", help="measure the pipeline against a pass-through floor")
    bench.add_argument("target", nargs="?", choices=["pipeline", "policy", "audit"],
                       default="pipeline")
    bench.add_argument("-n", "--calls", type=int, default=500)
    bench.add_argument("--burst", type=int, default=1000)
    bench.add_argument("--nats-url", default=env.env_nats_url_or_none(),
                       help="a running gateway (default: $TOOLGATE_NATS_URL, else start a "
                            "private one in a temp dir)")
    bench.add_argument("--creds", type=Path, default=env.env_nats_creds(),
                       help="with --nats-url on a locked bus: the operator's (admin) credentials")
    from toolgate.services.audit.bench import add_bench_arguments
    add_bench_arguments(bench)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except RegistryError as exc:
        print(f"toolgate: registry error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
