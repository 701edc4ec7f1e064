"""`toolgate approvals ...`: humans decide on calls that wait for approval.

    toolgate approvals list                         pending calls, with their arguments
    toolgate approvals show CALL_ID                 one call's approval, any state
    toolgate approvals approve CALL_ID --reason R   vote yes (on the arguments shown)
    toolgate approvals deny CALL_ID --reason R      vote no: the call will not run
    toolgate approvals add-approver NAME            create an approver; prints its token once
    toolgate approvals inbox [--port N]             the web inbox
    toolgate approvals serve                        the approvals service itself

Votes carry the approver's token (--token or $TOOLGATE_APPROVER_TOKEN) and
the SHA-256 of the arguments the approver saw (--sha256; without it, the
command shows the call and votes on exactly the hash it shows).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import Any

from toolgate.contracts.events import utc_now
from toolgate.services import settings as env
from toolgate.services.approvals.approvers import ApproverError, add_approver
from toolgate.services.approvals.logic import VoteOutcome
from toolgate.services.approvals.render import as_text

ENV_TOKEN = "TOOLGATE_APPROVER_TOKEN"
ENV_CREDS = "TOOLGATE_NATS_CREDS"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nats-url", default=env.env_nats_url(),
                        help="NATS server URL (default: $TOOLGATE_NATS_URL or %(default)s)")
    parser.add_argument("--token", default=os.environ.get(ENV_TOKEN),
                        help=f"the approver's token (default: ${ENV_TOKEN})")
    parser.add_argument("--data-dir", type=Path, default=env.env_data_dir(),
                        help="state directory holding approvers.yaml "
                             "(default: $TOOLGATE_DATA_DIR or .toolgate)")
    parser.add_argument("--creds", type=Path, default=os.environ.get(ENV_CREDS) or None,
                        help=f"NATS credentials file of a locked bus (default: ${ENV_CREDS})")


def connect_options(args: argparse.Namespace) -> dict[str, Any]:
    """Log in to a locked bus with --creds (the `approver` role); nothing otherwise."""
    if not getattr(args, "creds", None):
        return {}
    from toolgate.services.stack.nats_auth import connect_options as from_creds

    return from_creds(args.creds)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `approvals` and its subcommands to the `toolgate` parser."""
    approvals = subparsers.add_parser(
        "approvals", help="approve or deny calls that wait for a human",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = approvals.add_subparsers(dest="approvals_command", required=True)

    listing = commands.add_parser("list", help="pending calls, with arguments and hash")
    _common(listing)
    listing.set_defaults(func=cmd_list)

    show = commands.add_parser("show", help="one call's approval")
    show.add_argument("call_id")
    _common(show)
    show.set_defaults(func=cmd_show)

    for name, decision in (("approve", "approve"), ("deny", "deny")):
        vote = commands.add_parser(name, help=f"{name} a pending call")
        vote.add_argument("call_id")
        vote.add_argument("--reason", required=True, help="why (kept in the audit)")
        vote.add_argument("--sha256", default=None,
                          help="the arguments hash you were shown (default: show the call "
                               "now and vote on its hash)")
        vote.add_argument("--approver", default=None,
                          help="your approver name; must own the token")
        vote.add_argument("--timeout", type=float, default=5.0)
        _common(vote)
        vote.set_defaults(func=cmd_vote, decision=decision)

    add = commands.add_parser("add-approver", help="create an approver and print its token")
    add.add_argument("name")
    add.add_argument("--tenant", action="append", default=[],
                     help="limit the approver to this tenant; repeatable (default: all)")
    add.add_argument("--rotate", action="store_true", help="replace an existing approver's token")
    _common(add)
    add.set_defaults(func=cmd_add_approver)

    inbox = commands.add_parser("inbox", help="serve the web inbox")
    inbox.add_argument("--port", type=int, default=8090)
    inbox.add_argument("--host", default="127.0.0.1",
                       help="interface to listen on (default loopback; put TLS in front "
                            "before exposing it)")
    _common(inbox)
    inbox.set_defaults(func=cmd_inbox)

    serve = commands.add_parser("serve", help="run the approvals service")
    serve.add_argument("--sweep-interval", type=float, default=5.0,
                       help="seconds between expiry sweeps")
    _common(serve)
    serve.set_defaults(func=cmd_serve)
    return approvals


async def _client(args: argparse.Namespace) -> Any:
    from toolgate.services.approvals.client import ApprovalsClient

    return await ApprovalsClient.connect(args.nats_url, **connect_options(args))


def cmd_list(args: argparse.Namespace) -> int:
    async def run() -> list[Any]:
        async with await _client(args) as client:
            return list(await client.pending())

    states = asyncio.run(run())
    if not states:
        print("no calls are waiting for approval")
        return 0
    now = utc_now()
    print("\n\n".join(as_text(s, now) for s in states))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    async def run() -> Any:
        async with await _client(args) as client:
            return await client.get(args.call_id)

    state = asyncio.run(run())
    if state is None:
        print(f"no approval was requested for {args.call_id}", file=sys.stderr)
        return 1
    print(as_text(state, utc_now()))
    return 0


def cmd_vote(args: argparse.Namespace) -> int:
    from toolgate.services.approvals.client import ServiceUnavailable

    if not args.token:
        print(f"an approver token is needed: --token or ${ENV_TOKEN}", file=sys.stderr)
        return 2

    async def run() -> VoteOutcome | None:
        async with await _client(args) as client:
            sha = args.sha256
            if sha is None:
                state = await client.get(args.call_id)
                if state is None:
                    print(f"no approval was requested for {args.call_id}", file=sys.stderr)
                    return None
                print(as_text(state, utc_now()))
                print(f"\n{args.decision} on arguments sha256 {state.arguments_sha256}")
                sha = state.arguments_sha256
            return await client.vote(args.call_id, args.decision, arguments_sha256=sha,
                                     reason=args.reason, token=args.token,
                                     approver=args.approver, timeout=args.timeout)

    try:
        outcome = asyncio.run(run())
    except ServiceUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return 3
    if outcome is None:
        return 1
    if not outcome.accepted:
        print(f"refused ({outcome.code}): {outcome.message}", file=sys.stderr)
        return 1
    print(outcome.message)
    return 0


def cmd_add_approver(args: argparse.Namespace) -> int:
    try:
        token = add_approver(args.data_dir, args.name, tenants=args.tenant, rotate=args.rotate)
    except ApproverError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(token)
    print(f"approver {args.name} added to {args.data_dir / 'approvers.yaml'}; the token is "
          f"shown only now (set it as ${ENV_TOKEN})", file=sys.stderr)
    return 0


def cmd_inbox(args: argparse.Namespace) -> int:
    from toolgate.services.approvals.inbox import serve_inbox

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s inbox %(levelname)s %(message)s")
    return serve_inbox(args.nats_url, args.data_dir, args.host, args.port,
                       connect_options(args))


def cmd_serve(args: argparse.Namespace) -> int:
    from toolgate.services.approvals.app import build_app
    from toolgate.services.stack.topology import apply_topology

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s approvals %(levelname)s %(message)s")
    settings = env.GatewaySettings(nats_url=args.nats_url, nats_creds=args.creds,
                                   data_dir=args.data_dir)
    if settings.nats_creds is None:  # on a locked bus the operator (admin) applied it
        asyncio.run(apply_topology(settings.nats_url))
    app = build_app(settings, sweep_interval_s=args.sweep_interval)
    asyncio.run(app.run())
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m toolgate.services.approvals SUBCOMMAND ...` (same as `toolgate approvals`)."""
    parser = argparse.ArgumentParser(prog="toolgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["approvals", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
