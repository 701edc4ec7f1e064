"""`toolgate agents add|list|revoke|token`: one NATS identity per agent of each tenant,
minted into the data dir and, unless --offline, told to the running server at once."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from toolgate.cli.common import (
    CONNECT_TIMEOUT_S,
    Failed,
    check_nats_url,
    connect_failure,
    connect_nats,
)
from toolgate.runtime import settings as env

NEVER_UP = "no toolgate up ran in this data dir yet"


def cmd_agents(args: argparse.Namespace) -> int:
    from toolgate.stack import nats_auth

    data_dir: Path = args.data_dir
    if args.action == "token":
        from toolgate.cli.mcp import cmd_agents_token

        return cmd_agents_token(args)
    if not data_dir.is_dir() and not (args.action == "add" and args.offline):
        raise Failed(
            f"toolgate agents: no gateway data dir at {data_dir} (`toolgate up` has "
            "not run here): run toolgate up first, or give --data-dir"
            + (", or --offline to mint for a later toolgate up" if args.action == "add" else ""),
            2,
        )
    if args.action == "list":
        records = nats_auth.list_agents(data_dir)
        if not records:
            print(f"no agents in {data_dir} (toolgate agents add TENANT AGENT)")
        for record in records:
            state = f"revoked {record.revoked_at}" if record.revoked_at else "active"
            creds = nats_auth.agent_creds_path(data_dir, record.tenant, record.agent)
            print(
                f"{record.tenant:<20} {record.agent:<20} {state:<28} "
                f"{creds if not record.revoked_at else '-'}"
            )
        return 0
    if not args.offline:
        check_nats_url(args.nats_url)
    try:
        if args.action == "add":
            creds, token = nats_auth.add_agent(data_dir, args.tenant, args.agent)
        else:
            token = nats_auth.revoke_agent(data_dir, args.tenant, args.agent)
            from toolgate.cli.mcp import push_front_door_account

            push_front_door_account(args, data_dir)  # the front door may no longer act for it
    except nats_auth.AgentError as exc:
        raise Failed(f"toolgate agents: {exc}", 2) from None
    told = push_account(args, data_dir, token)
    name = f"{args.tenant}.{args.agent}"
    if args.action == "add":
        print(creds)
        if told is None:
            print(
                f"agent {name}: publishes only to toolgate.calls.{name}, reads only "
                f"toolgate.results.{name}.>; active now",
                file=sys.stderr,
            )
        elif args.offline:
            print(
                f"toolgate agents: agent {name} minted, active at the next toolgate up ({told})",
                file=sys.stderr,
            )
        else:
            raise not_told(f"agent {name} minted in {data_dir}", told)
        return 0
    if told is None:
        print(
            f"agent {name} revoked: creds deleted; the server refuses it and has cut its "
            "connections"
        )
        return 0
    if not args.offline:
        raise not_told(f"agent {name} revoked in {data_dir}, creds deleted", told)
    print(
        f"toolgate agents: agent {name} revoked in {data_dir}, creds deleted; the server "
        f"refuses it from its next start ({told})",
        file=sys.stderr,
    )
    return 0


def not_told(done: str, why: str) -> Failed:
    """The files are written, the running server was not told: exit 3 (only --offline
    means "files alone")."""
    return Failed(
        f"toolgate agents: {done}, but no running server was told ({why}); it takes "
        "effect when one is: run this again where `toolgate up` runs (--data-dir, "
        "--nats-url), or pass --offline to only write the files for the next toolgate up",
        3,
    )


def push_account(args: argparse.Namespace, data_dir: Path, token: str) -> str | None:
    """Hand the account JWT to the running server: None once done, else why it was not."""
    from toolgate.stack import nats_auth

    if args.offline:
        return "--offline"
    system = nats_auth.creds_path(data_dir / nats_auth.CREDS_DIR, nats_auth.SYSTEM_ROLE)
    if not system.exists():
        return f"{NEVER_UP}: no system creds in {data_dir}"  # its start preloads the account

    async def push() -> None:
        # Reachable at all? (nats-py alone can wait for ever on a refused port.)
        nc = await connect_nats(args.nats_url, system, CONNECT_TIMEOUT_S)
        await nc.close()
        await asyncio.wait_for(
            nats_auth.push_account_jwts(
                args.nats_url, data_dir, [token], timeout=CONNECT_TIMEOUT_S
            ),
            3 * CONNECT_TIMEOUT_S,
        )

    try:
        asyncio.run(push())
    except nats_auth.AgentError:
        raise
    except Failed as exc:  # no server: it loads the account when it starts
        return str(exc)
    except Exception as exc:
        return str(connect_failure(args.nats_url, exc))
    return None


def register(commands: Any) -> None:
    agents = commands.add_parser("agents", help="mint, list and revoke agent identities")
    agent_actions = agents.add_subparsers(dest="action", required=True)
    for action, text in (
        ("add", "mint one agent's NATS identity; prints its creds path"),
        ("revoke", "refuse an agent's creds and cut its connections"),
        ("token", "print a new bearer token of an agent for the MCP front door"),
    ):
        command = agent_actions.add_parser(action, help=text)
        command.add_argument("tenant", help="tenant name (letters, digits, - _; at most 64)")
        command.add_argument("agent", help="agent name (letters, digits, - _; at most 64)")
        command.add_argument(
            "--offline",
            action="store_true",
            help="only write the files; do not tell a running server (default: tell it)",
        )
        command.add_argument(
            "--nats-url",
            default=env.env_nats_url(),
            help="the running server to tell (default: $TOOLGATE_NATS_URL, "
            "else the one `toolgate up` recorded; now %(default)s)",
        )
    agent_actions.add_parser("list", help="every agent, active or revoked")

    for command in agent_actions.choices.values():
        command.add_argument(
            "--data-dir",
            type=Path,
            default=env.env_data_dir(),
            help="the gateway's state directory (default: $TOOLGATE_DATA_DIR, else %(default)s)",
        )
    agents.set_defaults(func=cmd_agents)
