"""`toolgate call TOOL 'JSON-ARGS'` and `toolgate result CALL_ID`: the agent's side of
the wire contract, as the agent of --creds (client/gateway_client.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from toolgate.cli.common import (
    Failed,
    check_call_id,
    check_creds,
    check_nats_url,
    connect_failure,
    connect_nats,
)
from toolgate.contracts.calls import Principal, ToolCall, ToolResult
from toolgate.runtime import settings as env
from toolgate.runtime.outside_text import visible, visible_json


def _add_nats(parser: argparse.ArgumentParser, role: str = "agent") -> None:
    parser.add_argument(
        "--nats-url",
        default=env.env_nats_url(),
        help="NATS server URL (default: $TOOLGATE_NATS_URL, else the one "
        "`toolgate up` recorded in DATA_DIR; now %(default)s)",
    )
    parser.add_argument(
        "--creds",
        type=Path,
        default=env.env_nats_creds(role),
        help=f"NATS creds file (default: $TOOLGATE_NATS_CREDS, else the {role} "
        "creds `toolgate up` recorded; now %(default)s)",
    )


def _add_connect_timeout(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for NATS before giving up (default %(default)s)",
    )


def _connect_client(args: argparse.Namespace, command: str) -> Any:
    """A GatewayClient as the agent of --creds within --connect-timeout (then it reconnects
    for as long as the command runs), or Failed in one line."""
    from toolgate.client.gateway_client import GatewayClient
    from toolgate.runtime.creds import identity_of_creds

    check_nats_url(args.nats_url)
    check_creds(args.creds)

    async def connect() -> Any:
        nc = await connect_nats(
            args.nats_url,
            args.creds,
            args.connect_timeout,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
        )
        identity = identity_of_creds(args.creds) if args.creds is not None else None
        if identity is None and args.creds is not None:
            await nc.close()
            raise Failed(
                f"{args.creds} is not an agent's creds (no tenant and agent in it): "
                "use one `toolgate agents add TENANT AGENT` printed (--creds)",
                2,
            )
        return GatewayClient(nc, identity)

    return connect


def _call_problem(exc: BaseException, url: str, what: str) -> Failed | None:
    """A NATS error while a connected command works, as one line (None: not one of those)."""
    import nats.errors
    from nats.js.errors import APIError

    if isinstance(exc, (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError)):
        return Failed(
            f"{what} at {url}: no answer from the gateway's streams (is toolgate up "
            "complete? may these creds do this?)",
            3,
        )
    if isinstance(exc, APIError):
        return Failed(
            f"{what} at {url}: the server said {exc.description or exc} (code {exc.err_code})", 3
        )
    if isinstance(exc, (nats.errors.Error, OSError)):
        return connect_failure(url, exc)
    return None


def cmd_call(args: argparse.Namespace) -> int:
    from toolgate.client.gateway_client import ResultTimeout, new_call_id
    from toolgate.contracts.calls import PendingNotice

    try:
        arguments = json.loads(args.arguments)
    except json.JSONDecodeError as exc:
        raise Failed(f"toolgate call: arguments are not JSON: {exc}", 2) from None
    if not isinstance(arguments, dict):
        raise Failed("toolgate call: arguments must be a JSON object", 2)
    if args.call_id is not None:
        check_call_id(args.call_id, "toolgate call", "--call-id")
    user_token = None
    if args.user_token_file is not None:
        try:
            user_token = args.user_token_file.read_text().strip()
        except OSError as exc:
            raise Failed(
                f"toolgate call: cannot read {args.user_token_file}: {exc.strerror or exc} "
                "(--user-token-file)",
                2,
            ) from None
        if not user_token:
            raise Failed(f"toolgate call: {args.user_token_file} is empty (--user-token-file)", 2)
    if args.user is None:  # with a user token, the gateway takes the user from its sub
        args.user = "" if user_token else "u-cli"
    connect = _connect_client(args, "call")
    # On a locked bus the creds say which tenant and agent this is; --tenant and
    # --agent only matter on an unlocked one.
    call = ToolCall(
        call_id=args.call_id or new_call_id(),
        tool=args.tool,
        arguments=arguments,
        principal=Principal(
            tenant=args.tenant, user=args.user, agent=args.agent, session=args.session
        ),
        task_id=args.task,
    )

    async def run() -> ToolResult:
        client = await connect()
        async with client:
            principal = (
                client.principal(args.user, args.session) if client.identity else call.principal
            )

            def waiting(notice: PendingNotice) -> None:
                key = f"{principal.tenant}.{principal.agent}.{call.call_id}"
                expires = f", until {notice.expires_at}" if notice.expires_at else ""
                print(
                    visible(
                        f"toolgate call: {call.call_id} waits for a human: {notice.message}"
                        f"{expires} (an approver: toolgate approvals approve {key})"
                    ),
                    file=sys.stderr,
                    flush=True,
                )

            try:
                return await client.submit(
                    msgspec.structs.replace(call, principal=principal),
                    timeout=args.timeout,
                    on_pending=waiting,
                    user_token=user_token,
                )
            except ResultTimeout:
                raise Failed(
                    f"toolgate call: no result for {call.call_id} within "
                    f"{args.timeout:g}s (it may still finish; fetch it with "
                    f"`toolgate result {call.call_id}`, or wait longer: --timeout)",
                    3,
                ) from None
            except Exception as exc:
                problem = _call_problem(exc, args.nats_url, f"cannot publish {call.call_id}")
                if problem is None:
                    raise
                raise problem from None

    result = asyncio.run(run())
    print(visible_json(msgspec.to_builtins(result), indent=2))
    return 0 if result.ok else 1


def cmd_result(args: argparse.Namespace) -> int:
    check_call_id(args.call_id, "toolgate result", "CALL_ID")
    connect = _connect_client(args, "result")

    async def run() -> ToolResult | None:
        client = await connect()
        async with client:
            try:
                return await client.result(args.call_id)
            except Exception as exc:
                problem = _call_problem(
                    exc, args.nats_url, f"cannot read the result of {args.call_id}"
                )
                if problem is None:
                    raise
                raise problem from None

    result = asyncio.run(run())
    if result is None:
        print(
            f"toolgate result: no result stored for {args.call_id} (yet) for this agent",
            file=sys.stderr,
        )
        return 1
    print(visible_json(msgspec.to_builtins(result), indent=2))
    return 0


def register(commands: Any) -> None:
    call = commands.add_parser("call", help="publish one call and print its ToolResult")
    call.add_argument("tool", help="a tool name from the registry")
    call.add_argument("arguments", help="the arguments as a JSON object")
    call.add_argument(
        "--user",
        default=None,
        help="the end user (default: u-cli; with --user-token-file, the token's sub)",
    )
    call.add_argument(
        "--user-token-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="a file holding the end user's access token, sent as `Authorization: Bearer` "
        "(a gateway with --oidc-issuer needs it; a file, so it is not on the command line)",
    )
    call.add_argument("--session", default="s-cli", help="the session (default %(default)s)")
    call.add_argument(
        "--agent",
        default="researcher",
        help="unlocked bus only: the agent (on a locked bus the creds say; default %(default)s)",
    )
    call.add_argument(
        "--tenant",
        default="default",
        help="unlocked bus only: the tenant (on a locked bus the creds say; default %(default)s)",
    )
    call.add_argument("--task", default=None, help="the task id (default %(default)s)")
    call.add_argument(
        "--call-id",
        default=None,
        help="the call's id, a subject-safe token (default: a new unique id)",
    )
    call.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to wait for the result (default %(default)s)",
    )
    _add_nats(call)
    _add_connect_timeout(call)
    call.set_defaults(func=cmd_call)

    result = commands.add_parser("result", help="fetch the stored result of a call")
    result.add_argument("call_id", help="the call_id of one of this agent's calls")
    _add_nats(result)
    _add_connect_timeout(result)
    result.set_defaults(func=cmd_result)
