"""`toolgate bench [pipeline|policy|audit|audit-queries|mcp|fairness]`: the gateway
measured as an agent sees it, next to the raw bus; the figures are printed (bench/)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from toolgate.cli.common import CONNECT_TIMEOUT_S, check_creds, check_nats_url, connect_nats
from toolgate.runtime import settings as env


def cmd_bench(args: argparse.Namespace) -> int:
    if args.target == "soak" or args.soak is not None:
        from toolgate.bench.soak import cmd_bench_soak

        def reachable() -> None:  # --nats-url: one line and exit 3 if it is not there
            asyncio.run(_probe(check_nats_url(args.nats_url), check_creds(args.creds)))

        return cmd_bench_soak(args, reachable)
    args.calls = 500 if args.calls is None else args.calls
    if args.target == "mcp":
        from toolgate.bench.mcp import cmd_bench_mcp

        return cmd_bench_mcp(args)
    if args.target == "audit":
        from toolgate.bench.audit import cmd_bench_audit

        return cmd_bench_audit(args)
    if args.target == "audit-queries":
        from toolgate.bench.audit_queries import cmd_bench_audit_queries

        return cmd_bench_audit_queries(args)
    if args.target == "fairness":
        from toolgate.bench.fairness import run_fairness

        return run_fairness(args)
    if args.target == "trips":
        from toolgate.bench.trips import cmd_bench_trips

        return cmd_bench_trips(args)
    if args.target == "policy":
        from toolgate.bench.policy import run_policy_bench

        run_policy_bench(args.calls)
        return 0
    if (
        args.rate is not None
        and args.rate <= 0
        or args.duration <= 0
        or args.calls < 0
        or args.burst < 1
        or args.rounds < 1
    ):
        print(
            "toolgate bench: --rate, --duration, --burst and --rounds must be positive, "
            "-n not negative",
            file=sys.stderr,
        )
        return 2
    if args.rate is not None and args.curve:
        print("toolgate bench: --rate or --curve, not both", file=sys.stderr)
        return 2
    if args.nats_url:  # a running gateway: is it there at all? (one line, exit 3, if not)
        check_nats_url(args.nats_url)
        check_creds(args.creds)
        asyncio.run(_probe(args.nats_url, args.creds))
    from toolgate.bench.pipeline import run_bench

    return run_bench(args)


async def _probe(url: str, creds: Path | None) -> None:
    nc = await connect_nats(url, creds, CONNECT_TIMEOUT_S)
    await nc.close()


def register(commands: Any) -> None:
    bench = commands.add_parser(
        "bench", help="measure the gateway as an agent sees it, next to the raw bus"
    )
    bench.add_argument(
        "target",
        nargs="?",
        choices=[
            "pipeline",
            "policy",
            "audit",
            "audit-queries",
            "mcp",
            "fairness",
            "soak",
            "trips",
        ],
        default="pipeline",
    )
    bench.add_argument(
        "-n",
        "--calls",
        type=int,
        default=None,
        help="calls sent one at a time, per client (default 500); "
        "soak: calls in all (default 100,000)",
    )
    bench.add_argument(
        "--burst",
        type=int,
        default=1000,
        help="calls published at once, per client (default %(default)s)",
    )
    bench.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the clients and the floor this many times, interleaved, "
        "and print medians (a shared machine drifts; default %(default)s)",
    )
    bench.add_argument(
        "--rate",
        type=float,
        default=None,
        help="open loop instead: publish this many calls/s on a fixed schedule "
        "for --duration seconds, whatever earlier calls do",
    )
    bench.add_argument(
        "--duration",
        type=float,
        default=10.0,
        help="seconds of each open-loop run (default %(default)s)",
    )
    bench.add_argument(
        "--curve",
        action="store_true",
        help="measure the burst throughput, then hold 25/50/75/90%% of it "
        "open loop (--duration each) and print a table",
    )
    bench.add_argument(
        "--soak",
        type=int,
        default=None,
        metavar="CALLS",
        help="the same as `toolgate bench soak -n CALLS`",
    )
    bench.add_argument(
        "--nats-url",
        default=env.env_nats_url_or_none(),
        help="a running gateway (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded here, else start a private one in a temp "
        "dir as `toolgate up` runs it)",
    )
    bench.add_argument(
        "--creds",
        type=Path,
        default=env.env_nats_creds("admin"),
        help="with --nats-url on a locked bus: the operator's (admin) "
        "credentials, for the floor and drain checks (default: "
        "$TOOLGATE_NATS_CREDS, else the admin creds `toolgate up` recorded)",
    )
    bench.add_argument(
        "--agent-creds",
        type=Path,
        default=None,
        help="with --nats-url: the agent the calls come from (default: the "
        "agent creds `toolgate up` recorded, else --creds)",
    )
    from toolgate.bench.audit import add_bench_arguments

    add_bench_arguments(bench)
    from toolgate.bench.results import add_save_arguments, saving

    add_save_arguments(bench)
    bench.set_defaults(func=saving(cmd_bench))
