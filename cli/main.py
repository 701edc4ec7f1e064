"""The `toolgate` command: parse, build a contract, call the library.

    toolgate up                        the whole gateway on the embedded default
    toolgate serve NAME                one service (validator|policy|executor|attacher|
                                       approvals|audit)
    toolgate agents add|list|revoke    one NATS identity per agent of each tenant
    toolgate call TOOL 'JSON-ARGS'     publish one call, print its ToolResult
    toolgate result CALL_ID            fetch a stored result again
    toolgate approvals list|show|approve|deny|add-approver|inbox   humans decide
    toolgate policy check|push|test    Cedar policy bundles
    toolgate audit trace|sql|replay|verify   the audit trail in ClickHouse
    toolgate schema                    JSON Schema of the wire contract
    toolgate bench [pipeline|policy|audit]   figures, printed

After `toolgate up` in a folder, every command there finds the gateway through
.toolgate/context.json; flags and TOOLGATE_* variables win.
Exit codes: 0 done (for `call`: result ok), 1 a clear failure (for `call`: the
result is an error), 2 bad input or configuration, 3 could not reach or wait
for the gateway.
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
from toolgate.runtime import settings as env
from toolgate.runtime.creds import CredentialsError
from toolgate.runtime.topology import DEFAULT_MAX_CALLS_PER_AGENT

SERVICE_NAMES = ("validator", "policy", "executor", "attacher", "approvals", "audit")


def _add_nats(parser: argparse.ArgumentParser, role: str = "agent") -> None:
    parser.add_argument("--nats-url", default=env.env_nats_url(),
                        help="NATS server URL (default: $TOOLGATE_NATS_URL, else the one "
                             "`toolgate up` recorded in DATA_DIR, else %(default)s)")
    parser.add_argument("--creds", type=Path, default=env.env_nats_creds(role),
                        help=f"NATS creds file (default: $TOOLGATE_NATS_CREDS, else the {role} "
                             "creds `toolgate up` recorded; now %(default)s)")


def _add_connect_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connect-timeout", type=float, default=5.0,
                        help="seconds to wait for NATS before giving up (default %(default)s)")


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
    from toolgate.stack.supervisor import Stack, run_until_signalled

    executor_args = ["--concurrency", str(args.concurrency)]
    from toolgate.runtime.topology import Topology

    stack = Stack(data_dir=args.data_dir, nats_url=args.nats_url_given, nats_port=args.nats_port,
                  registry_dirs=list(args.registry or env.env_registry_dirs()),
                  executor_args=executor_args, clickhouse_url=args.clickhouse_url_given,
                  clickhouse_port=args.clickhouse_port, with_audit=not args.no_audit,
                  topology=Topology(max_calls_per_agent=args.max_calls_per_agent),
                  example=args.example)
    return run_until_signalled(stack)


def cmd_serve(args: argparse.Namespace) -> int:
    from toolgate.runtime.topology import apply_topology

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
        app = build_approvals(settings, sweep_interval_s=args.sweep_interval)
    else:
        from toolgate.services.attacher.app import build_app as build_attacher
        app = build_attacher(settings)
    asyncio.run(app.run())
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from toolgate.client.gateway_client import (
        ConnectFailed,
        GatewayClient,
        IdentityUnknown,
        ResultTimeout,
        new_call_id,
    )

    try:
        arguments = json.loads(args.arguments)
    except json.JSONDecodeError as exc:
        print(f"arguments are not JSON: {exc}", file=sys.stderr)
        return 2
    if not isinstance(arguments, dict):
        print("arguments must be a JSON object", file=sys.stderr)
        return 2
    # On a locked bus the creds say which tenant and agent this is; --tenant and
    # --agent only matter on an unlocked one.
    call = ToolCall(call_id=args.call_id or new_call_id(), tool=args.tool, arguments=arguments,
                    principal=Principal(tenant=args.tenant, user=args.user, agent=args.agent,
                                        session=args.session),
                    task_id=args.task)

    async def run() -> ToolResult:
        client = await GatewayClient.connect(args.nats_url, args.creds,
                                             connect_timeout=args.connect_timeout)
        async with client:
            principal = client.principal(args.user, args.session) if client.identity else \
                call.principal
            return await client.submit(msgspec.structs.replace(call, principal=principal),
                                       timeout=args.timeout)

    try:
        result = asyncio.run(run())
    except (ResultTimeout, ConnectFailed, IdentityUnknown) as exc:
        print(f"toolgate call: {exc}", file=sys.stderr)
        return 3
    print(json.dumps(msgspec.to_builtins(result), indent=2, ensure_ascii=False))
    return 0 if result.ok else 1


def cmd_result(args: argparse.Namespace) -> int:
    from toolgate.client.gateway_client import (
        ConnectFailed,
        GatewayClient,
        IdentityUnknown,
    )

    async def run() -> ToolResult | None:
        client = await GatewayClient.connect(args.nats_url, args.creds,
                                             connect_timeout=args.connect_timeout)
        async with client:
            return await client.result(args.call_id)

    try:
        result = asyncio.run(run())
    except (ConnectFailed, IdentityUnknown) as exc:
        print(f"toolgate result: {exc}", file=sys.stderr)
        return 3
    if result is None:
        print(f"no result stored for {args.call_id}", file=sys.stderr)
        return 1
    print(json.dumps(msgspec.to_builtins(result), indent=2, ensure_ascii=False))
    return 0


def cmd_agents(args: argparse.Namespace) -> int:
    from toolgate.stack import nats_auth

    data_dir: Path = args.data_dir
    if args.action == "list":
        records = nats_auth.list_agents(data_dir)
        if not records:
            print(f"no agents in {data_dir} (toolgate agents add TENANT AGENT)")
        for record in records:
            state = f"revoked {record.revoked_at}" if record.revoked_at else "active"
            creds = nats_auth.agent_creds_path(data_dir, record.tenant, record.agent)
            print(f"{record.tenant:<20} {record.agent:<20} {state:<28} "
                  f"{creds if not record.revoked_at else '-'}")
        return 0
    try:
        if args.action == "add":
            creds, token = nats_auth.add_agent(data_dir, args.tenant, args.agent)
        else:
            token = nats_auth.revoke_agent(data_dir, args.tenant, args.agent)
    except nats_auth.AgentError as exc:
        print(f"toolgate agents: {exc}", file=sys.stderr)
        return 2
    pushed = _push_account(args, data_dir, token)
    if args.action == "add":
        print(creds)
        print(f"agent {args.tenant}.{args.agent}: publishes only to "
              f"toolgate.calls.{args.tenant}.{args.agent}, reads only "
              f"toolgate.results.{args.tenant}.{args.agent}.>; "
              + ("active now" if pushed else "active at the next `toolgate up`"),
              file=sys.stderr)
        return 0
    print(f"agent {args.tenant}.{args.agent} revoked: creds deleted; "
          + ("the server refuses it and has cut its connections" if pushed else
             "the server refuses it from its next start (it is not running here)"))
    return 0 if pushed or args.offline else 1


def _push_account(args: argparse.Namespace, data_dir: Path, token: str) -> bool:
    """Hand the account JWT to the running server; False if there is none to reach."""
    from toolgate.stack import nats_auth

    if args.offline:
        return False
    if not nats_auth.creds_path(data_dir / nats_auth.CREDS_DIR, nats_auth.SYSTEM_ROLE).exists():
        return False  # no `toolgate up` ran here yet: its start will preload the account
    try:
        nats_auth.push_account_jwts_sync(args.nats_url, data_dir, [token])
    except nats_auth.AgentError:
        raise
    except Exception as exc:  # no server: it loads the account when it starts
        print(f"toolgate agents: no NATS answered at {args.nats_url} ({exc!r})",
              file=sys.stderr)
        return False
    return True


def cmd_schema(args: argparse.Namespace) -> int:
    from toolgate.contracts.calls import PendingNotice

    _, components = msgspec.json.schema_components([ToolCall, ToolResult, PendingNotice],
                                                   ref_template="#/$defs/{name}")
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


def cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "audit":
        from toolgate.bench.audit import cmd_bench_audit

        return cmd_bench_audit(args)
    if args.target == "policy":
        from toolgate.bench.policy import run_policy_bench

        run_policy_bench(args.calls)
        return 0
    if args.rate is not None and args.rate <= 0 or args.duration <= 0 or args.calls < 0 \
            or args.burst < 1 or args.rounds < 1:
        print("toolgate bench: --rate, --duration, --burst and --rounds must be positive, "
              "-n not negative", file=sys.stderr)
        return 2
    if args.rate is not None and args.curve:
        print("toolgate bench: --rate or --curve, not both", file=sys.stderr)
        return 2
    from toolgate.bench.pipeline import run_bench

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
    up.add_argument("--max-calls-per-agent", type=int, default=DEFAULT_MAX_CALLS_PER_AGENT,
                    help="storage quota: calls each agent may have stored within the 7-day "
                         "retention; over it a call is refused before storage "
                         "(default %(default)s)")
    up.add_argument("--example", choices=("orders",), default=None,  # supervisor.EXAMPLES
                    help="also run a worked example beside the built-in tools: its tools, "
                         "data and policy bundle (orders: README 'Worked example 3')")
    _add_runtime(up)
    up.set_defaults(func=cmd_up)

    serve = commands.add_parser("serve", help="run one service")
    serve.add_argument("name", choices=SERVICE_NAMES)
    serve.add_argument("--tools", default="", help="executor: comma-separated tools (default all)")
    serve.add_argument("--concurrency", type=int, default=8,
                       help="executor: calls in flight per tool")
    serve.add_argument("--sweep-interval", type=float, default=5.0,
                       help="approvals: seconds between expiry sweeps (default %(default)s)")
    serve.add_argument("--policy", type=Path, default=None,
                       help="policy: bundle directory to start with (default: the pushed "
                            "bundle, else the built-in one)")
    _add_nats(serve, role="service")
    _add_runtime(serve)
    serve.set_defaults(func=cmd_serve)

    from toolgate.cli.audit import add_clickhouse_url
    from toolgate.cli.audit import register as register_audit
    add_clickhouse_url(serve)  # audit: where to write
    register_audit(commands)

    from toolgate.cli.approvals import register as register_approvals
    from toolgate.cli.policy import register as register_policy
    register_approvals(commands)
    register_policy(commands)

    agents = commands.add_parser("agents", help="mint, list and revoke agent identities")
    agent_actions = agents.add_subparsers(dest="action", required=True)
    for action, text in (("add", "mint one agent's NATS identity; prints its creds path"),
                         ("revoke", "refuse an agent's creds and cut its connections")):
        command = agent_actions.add_parser(action, help=text)
        command.add_argument("tenant", help="tenant name (letters, digits, - _; at most 64)")
        command.add_argument("agent", help="agent name (letters, digits, - _; at most 64)")
        command.add_argument("--offline", action="store_true",
                             help="only write the files; do not tell a running server")
        command.add_argument("--nats-url", default=env.env_nats_url(),
                             help="the running server to tell (default: $TOOLGATE_NATS_URL, "
                                  "else the one `toolgate up` recorded; now %(default)s)")
    agent_actions.add_parser("list", help="every agent, active or revoked")
    for command in agent_actions.choices.values():
        command.add_argument("--data-dir", type=Path, default=env.env_data_dir(),
                             help="the gateway's state directory (default: "
                                  "$TOOLGATE_DATA_DIR or .toolgate)")
    agents.set_defaults(func=cmd_agents)

    call = commands.add_parser("call", help="publish one call and print its ToolResult")
    call.add_argument("tool", help="a tool name from the registry")
    call.add_argument("arguments", help="the arguments as a JSON object")
    call.add_argument("--user", default="u-cli", help="the end user (default %(default)s)")
    call.add_argument("--session", default="s-cli", help="the session (default %(default)s)")
    call.add_argument("--agent", default="researcher",
                      help="unlocked bus only: the agent (on a locked bus the creds say)")
    call.add_argument("--tenant", default="default",
                      help="unlocked bus only: the tenant (on a locked bus the creds say)")
    call.add_argument("--task", default=None, help="the task id (default none)")
    call.add_argument("--call-id", default=None, help="default: a new unique id")
    call.add_argument("--timeout", type=float, default=30.0,
                      help="seconds to wait for the result (default %(default)s)")
    _add_nats(call)
    _add_connect_timeout(call)
    call.set_defaults(func=cmd_call)

    result = commands.add_parser("result", help="fetch the stored result of a call")
    result.add_argument("call_id")
    _add_nats(result)
    _add_connect_timeout(result)
    result.set_defaults(func=cmd_result)

    schema = commands.add_parser("schema", help="print the JSON Schema of the wire contract")
    schema.set_defaults(func=cmd_schema)

    bench = commands.add_parser(
        "bench", help="measure the gateway as an agent sees it, next to the raw bus")
    bench.add_argument("target", nargs="?", choices=["pipeline", "policy", "audit"],
                       default="pipeline")
    bench.add_argument("-n", "--calls", type=int, default=500,
                       help="calls sent one at a time, per client (default %(default)s)")
    bench.add_argument("--burst", type=int, default=1000,
                       help="calls published at once, per client (default %(default)s)")
    bench.add_argument("--rounds", type=int, default=1,
                       help="repeat the clients and the floor this many times, interleaved, "
                            "and print medians (a shared machine drifts; default %(default)s)")
    bench.add_argument("--rate", type=float, default=None,
                       help="open loop instead: publish this many calls/s on a fixed schedule "
                            "for --duration seconds, whatever earlier calls do")
    bench.add_argument("--duration", type=float, default=10.0,
                       help="seconds of each open-loop run (default %(default)s)")
    bench.add_argument("--curve", action="store_true",
                       help="measure the burst throughput, then hold 25/50/75/90%% of it "
                            "open loop (--duration each) and print a table")
    bench.add_argument("--nats-url", default=env.env_nats_url_or_none(),
                       help="a running gateway (default: $TOOLGATE_NATS_URL, else the one "
                            "`toolgate up` recorded here, else start a private one in a temp "
                            "dir as `toolgate up` runs it)")
    bench.add_argument("--creds", type=Path, default=env.env_nats_creds("admin"),
                       help="with --nats-url on a locked bus: the operator's (admin) "
                            "credentials, for the floor and drain checks (default: "
                            "$TOOLGATE_NATS_CREDS, else the admin creds `toolgate up` recorded)")
    bench.add_argument("--agent-creds", type=Path, default=None,
                       help="with --nats-url: the agent the calls come from (default: the "
                            "agent creds `toolgate up` recorded, else --creds)")
    from toolgate.bench.audit import add_bench_arguments
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
    except CredentialsError as exc:
        print(f"toolgate: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
