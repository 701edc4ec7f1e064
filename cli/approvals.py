"""`toolgate approvals ...`: humans decide on calls that wait for approval.

    toolgate approvals list                        pending calls of your tenants, with arguments
    toolgate approvals show CALL                   one call's approval, any state
    toolgate approvals approve CALL --reason R     vote yes (on the arguments shown)
    toolgate approvals deny CALL --reason R        vote no: the call will not run
    toolgate approvals add-approver NAME --tenant T [--tenant T2 ...]
                                                   an approver: its token (shown once), its creds
    toolgate approvals inbox [--port N]            the web inbox
    (the approvals service itself is `toolgate serve approvals`)

CALL is a call key, TENANT.AGENT.CALL_ID, as `list` prints it (a call_id is
unique only per agent); a bare CALL_ID is accepted when just one call you
may see has it. Every command but add-approver and serve asks the approvals
service, with the approver's token (--token or $TOOLGATE_APPROVER_TOKEN),
over NATS as that approver (--creds: the creds add-approver wrote,
<data-dir>/creds/approvers/NAME.creds; default $TOOLGATE_NATS_CREDS). The
service takes who asks from those creds, and the token must be the same
approver's; only that approver can read the replies. The web inbox logs in
as its own user (the inbox creds `toolgate up` made) and speaks for each
approver by token. An approver sees and votes on the calls of their own
tenants only. Votes carry the SHA-256 of the arguments
the approver saw (--sha256; without it, the command shows the call and
votes on exactly the hash it shows).

Exit codes: 0 done, 1 the service said no (bad token, unknown call, wrong
hash, ...), 2 bad input (no token, a missing creds file or data dir), 3 no
NATS or no approvals service answered, or NATS refused the creds. A failure
is one line on stderr.
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
from toolgate.runtime import settings as env
from toolgate.runtime.creds import env_creds
from toolgate.runtime.outside_text import log_visibly, visible
from toolgate.services.approvals.approvers import ApproverError, add_approver
from toolgate.services.approvals.logic import VoteOutcome
from toolgate.services.approvals.render import as_text

ENV_TOKEN = "TOOLGATE_APPROVER_TOKEN"
ENV_CREDS = "TOOLGATE_NATS_CREDS"
INBOX_ROLE = "inbox"


def _nats(parser: argparse.ArgumentParser, creds_default: Path | None, creds_help: str) -> None:
    parser.add_argument(
        "--nats-url",
        default=env.env_nats_url(),
        help="NATS server URL (default: $TOOLGATE_NATS_URL, else what "
        "`toolgate up` recorded; now %(default)s)",
    )
    parser.add_argument("--creds", type=Path, default=creds_default, help=creds_help)


def _approver(parser: argparse.ArgumentParser) -> None:
    """Options of the commands that ask the approvals service as an approver."""
    _nats(
        parser,
        env_creds(),
        "the approver's own NATS credentials, as add-approver wrote them "
        f"(<data-dir>/creds/approvers/NAME.creds; default: ${ENV_CREDS}, now %(default)s)",
    )
    token = os.environ.get(ENV_TOKEN)
    parser.add_argument(
        "--token",
        default=token,
        help=f"the approver's token, as add-approver printed it (default: "
        f"${ENV_TOKEN}, now {'set' if token else 'unset'})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        help="seconds to wait for the service's answer (default %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for NATS before giving up (default %(default)s)",
    )


def _data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=env.env_data_dir(),
        help="state directory holding approvers.yaml "
        "(default: $TOOLGATE_DATA_DIR, else %(default)s)",
    )


def connect_options(args: argparse.Namespace) -> dict[str, Any]:
    """Log in to a locked bus with --creds; nothing otherwise (an open bus)."""
    if not getattr(args, "creds", None):
        return {}
    from toolgate.runtime.creds import connect_options as from_creds

    return from_creds(args.creds)


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add `approvals` and its subcommands to the `toolgate` parser."""
    approvals = subparsers.add_parser(
        "approvals",
        help="approve or deny calls that wait for a human",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = approvals.add_subparsers(dest="approvals_command", required=True)

    listing = commands.add_parser(
        "list", help="pending calls of your tenants, with arguments and hash"
    )
    _approver(listing)
    listing.set_defaults(func=cmd_list)

    show = commands.add_parser("show", help="one call's approval")
    show.add_argument("call", metavar="CALL", help="TENANT.AGENT.CALL_ID (or a CALL_ID)")
    _approver(show)
    show.set_defaults(func=cmd_show)

    for name, decision in (("approve", "approve"), ("deny", "deny")):
        vote = commands.add_parser(name, help=f"{name} a pending call")
        vote.add_argument("call", metavar="CALL", help="TENANT.AGENT.CALL_ID (or a CALL_ID)")
        vote.add_argument("--reason", required=True, help="why (kept in the audit; required)")
        vote.add_argument(
            "--sha256",
            default=None,
            help="the arguments hash you were shown (default: show the call "
            "now and vote on its hash)",
        )
        vote.add_argument(
            "--approver",
            default=None,
            help="your approver name; must own the token (default: the token's owner)",
        )
        _approver(vote)
        vote.set_defaults(func=cmd_vote, decision=decision)

    add = commands.add_parser("add-approver", help="create an approver and print its token")
    add.add_argument("name", help="the approver's name (letters, digits, . _ @ -)")
    add.add_argument(
        "--tenant",
        action="append",
        default=[],
        help="a tenant whose calls the approver sees and decides; repeatable "
        "(one is required, unless --all-tenants; default none)",
    )
    add.add_argument(
        "--all-tenants",
        action="store_true",
        help="an operator-wide approver: every tenant's calls (explicit only; default: off)",
    )
    add.add_argument(
        "--rotate",
        action="store_true",
        help="replace an existing approver's token (default: refuse an existing name)",
    )
    _data_dir(add)
    add.set_defaults(func=cmd_add_approver)

    inbox = commands.add_parser("inbox", help="serve the web inbox")
    inbox.add_argument("--port", type=int, default=8090, help="HTTP port (default %(default)s)")
    inbox.add_argument(
        "--host",
        default="127.0.0.1",
        help="interface to listen on (default %(default)s; put TLS in front before exposing it)",
    )
    inbox.add_argument(
        "--allow-host",
        action="append",
        default=[],
        help="a Host header to answer besides loopback and --host, as NAME (any port) or "
        "NAME:PORT (repeatable; e.g. inbox.example.com behind a proxy); others get 421",
    )
    inbox.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        help="an origin that may post to the inbox besides its own (repeatable; e.g. "
        "https://inbox.example.com when a proxy rewrites Host); others get 403",
    )
    # Each approver logs in with their own token; the inbox has none of its own.
    _nats(
        inbox,
        env.env_nats_creds(INBOX_ROLE),
        f"NATS credentials of the inbox (default: ${ENV_CREDS}, else the inbox creds "
        "`toolgate up` recorded; now %(default)s). An approver's own creds make an inbox "
        "of that approver only",
    )
    inbox.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for NATS at the start before giving up (default %(default)s; "
        "once up, it reconnects for as long as it runs)",
    )
    inbox.set_defaults(func=cmd_inbox)

    return approvals


async def _client(args: argparse.Namespace) -> Any:
    """The approvals client over one connection made within --connect-timeout, or Failed."""
    from toolgate.cli.common import connect_nats
    from toolgate.services.approvals.client import ApprovalsClient

    nc = await connect_nats(args.nats_url, args.creds, args.connect_timeout)
    return ApprovalsClient(nc, args.token)


def _needs_token(args: argparse.Namespace) -> bool:
    if args.token:
        return True
    print(f"an approver token is needed: --token or ${ENV_TOKEN}", file=sys.stderr)
    return False


def _run(args: argparse.Namespace, work: Any) -> int:
    """Run `work(client)`; report a refusal or a missing service as the exit code."""
    from toolgate.cli.common import check_creds, check_nats_url
    from toolgate.services.approvals.client import Refused, ServiceUnavailable

    check_nats_url(args.nats_url)
    check_creds(args.creds)

    async def run() -> int:
        async with await _client(args) as client:
            return int(await work(client))

    try:
        return asyncio.run(run())
    except Refused as exc:
        print(visible(str(exc)), file=sys.stderr)
        return 1
    except ServiceUnavailable:
        print(
            f"no approvals service answered at {args.nats_url} within {args.timeout:g}s: "
            "is toolgate up running (or `toolgate serve approvals`), and are --creds the "
            "approver's? (--nats-url, --creds, --timeout)",
            file=sys.stderr,
        )
        return 3


def cmd_list(args: argparse.Namespace) -> int:
    if not _needs_token(args):
        return 2

    async def work(client: Any) -> int:
        reply = await client.list_pending(timeout=args.timeout)
        who = reply.approver
        scope = "every tenant" if who.all_tenants else "tenants " + ", ".join(who.tenants)
        print(visible(f"approver {who.name} ({scope})"), file=sys.stderr)
        if not reply.calls:
            print("no calls are waiting for approval")
            return 0
        now = utc_now()
        print("\n\n".join(as_text(view, now) for view in reply.calls))
        if reply.omitted:
            print(f"\n{visible(reply.message)}", file=sys.stderr)
        return 0

    return _run(args, work)


def cmd_show(args: argparse.Namespace) -> int:
    if not _needs_token(args):
        return 2

    async def work(client: Any) -> int:
        reply = await client.show(args.call, timeout=args.timeout)
        if not reply.ok:
            print(visible(f"refused ({reply.code}): {reply.message}"), file=sys.stderr)
            return 1
        print(as_text(reply.approval, utc_now()))
        return 0

    return _run(args, work)


def cmd_vote(args: argparse.Namespace) -> int:
    if not _needs_token(args):
        return 2

    async def work(client: Any) -> int:
        call, sha = args.call, args.sha256
        if sha is None:
            reply = await client.show(call, timeout=args.timeout)
            if not reply.ok:
                print(visible(f"refused ({reply.code}): {reply.message}"), file=sys.stderr)
                return 1
            print(as_text(reply.approval, utc_now()))
            call, sha = reply.approval.key, reply.approval.arguments_sha256
            print(f"\n{args.decision} on arguments sha256 {sha}")
        outcome: VoteOutcome = await client.vote(
            call,
            args.decision,
            arguments_sha256=sha,
            reason=args.reason,
            approver=args.approver,
            timeout=args.timeout,
        )
        if not outcome.accepted:
            print(visible(f"refused ({outcome.code}): {outcome.message}"), file=sys.stderr)
            return 1
        print(visible(f"{outcome.call}: {outcome.message}"))
        return 0

    return _run(args, work)


def cmd_add_approver(args: argparse.Namespace) -> int:
    if not args.data_dir.is_dir():
        print(
            f"no gateway data dir at {args.data_dir} (`toolgate up` has not run here): run "
            "toolgate up first, or give --data-dir (the approvals service reads "
            "approvers.yaml there)",
            file=sys.stderr,
        )
        return 2
    from toolgate.stack import nats_auth

    minted: list[Path] = []

    def mint(name: str) -> str:
        creds, user_key = nats_auth.mint_approver(args.data_dir, name)
        minted.append(creds)
        return user_key

    try:
        token = add_approver(
            args.data_dir,
            args.name,
            tenants=args.tenant,
            all_tenants=args.all_tenants,
            rotate=args.rotate,
            mint_nats_user=mint,
        )
    except ApproverError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(token)
    scope = "every tenant" if args.all_tenants else "tenants " + ", ".join(sorted(set(args.tenant)))
    print(
        f"approver {args.name} ({scope}) added to {args.data_dir / 'approvers.yaml'}; "
        f"the token is shown only now (set it as ${ENV_TOKEN}); NATS creds of this "
        f"approver alone: {minted[0]} (--creds)",
        file=sys.stderr,
    )
    return 0


def cmd_inbox(args: argparse.Namespace) -> int:
    from toolgate.cli.common import (
        Failed,
        check_creds,
        check_nats_url,
        connect_nats,
        quiet_nats_tracebacks,
    )
    from toolgate.services.approvals.inbox import serve_inbox

    check_nats_url(args.nats_url)
    check_creds(args.creds)
    # NATS first, within --connect-timeout (one line and exit 3 if not; Ctrl-C ends the
    # wait): an inbox that opened its port with no gateway behind it would only fail later.

    async def reachable() -> None:
        # Said once the loop runs, so a Ctrl-C from then on ends the wait cleanly.
        print(
            f"approvals inbox: waiting for NATS at {args.nats_url} (up to "
            f"{args.connect_timeout:g} s; Ctrl-C stops)",
            flush=True,
        )
        nc = await connect_nats(args.nats_url, args.creds, args.connect_timeout)
        await nc.close()

    asyncio.run(reachable())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s inbox %(levelname)s %(message)s")
    log_visibly()
    # Once up, it reconnects as long as it takes, one line at a time (a service).
    quiet_nats_tracebacks(args.nats_url)
    try:
        return serve_inbox(
            args.nats_url,
            args.host,
            args.port,
            connect_options(args),
            allowed_hosts=tuple(args.allow_host),
            allowed_origins=tuple(args.allow_origin),
        )
    except OSError as exc:
        if exc.errno is not None and "address" in (exc.strerror or "").lower():
            raise Failed(
                f"toolgate approvals inbox: cannot listen on {args.host}:{args.port} "
                f"({exc.strerror}): choose another --port or --host",
                2,
            ) from None
        raise
