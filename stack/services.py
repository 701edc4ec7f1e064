"""Every service toolgate runs, named once: how `toolgate serve NAME` builds it, the
NATS role it logs in as, and whether `toolgate up` starts it as a hop of the pipeline.

`toolgate serve` (cli), the supervisor of `toolgate up` (stack/supervisor.py) and the
test harness (tests/harness.py) all read this table. Each builder imports its service
only when called: a process loads the one service it runs.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from toolgate.runtime.settings import GatewaySettings

if TYPE_CHECKING:  # faststream: loaded by the service a process runs, not by every command
    from faststream import FastStream

Build = Callable[[GatewaySettings, argparse.Namespace], "FastStream"]


@dataclass(frozen=True)
class Service:
    name: str
    # Its FastStream app, from `toolgate serve`'s arguments; None: not a stage app
    # (the MCP front door, a door onto the wire contract: cli/mcp.py serves it).
    build: Build | None
    # Its NATS user on a locked bus (stack/nats_auth.py, infra/nats).
    role: str
    # A hop of the pipeline (validator ... approvals): `toolgate up` starts these first,
    # and a gateway is not alive without every one of them.
    pipeline: bool = False


def _validator(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.validator.app import build_app

    return build_app(settings)


def _policy(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.policy.app import build_app

    return build_app(settings, policy_dir=args.policy)


def executor_tools(args: argparse.Namespace) -> list[str]:
    """`--tools a,b`: the tools one executor serves (none named: every tool)."""
    return [tool for tool in (getattr(args, "tools", None) or "").split(",") if tool]


def _executor(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.executor.app import build_app

    return build_app(settings, tools=executor_tools(args) or None, concurrency=args.concurrency)


def _attacher(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.attacher.app import build_app

    return build_app(settings)


def _approvals(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.approvals.app import build_app

    return build_app(settings, sweep_interval_s=args.sweep_interval)


def _notifier(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.notifier.app import build_app

    # The webhooks were read (their secrets once) when the command was checked.
    webhooks: list[Any] = getattr(args, "notifier_webhooks", [])
    return build_app(settings, webhooks, notifier_options(args))


def notifier_options(args: argparse.Namespace) -> Any:
    from toolgate.services.notifier.app import Options

    return Options(
        inbox_url=args.inbox_url,
        reminder_share=args.reminder_at,
        retry_base_s=args.retry_base,
        give_up_after_s=args.give_up_after,
        timeout_s=args.webhook_timeout,
    )


def _audit(settings: GatewaySettings, args: argparse.Namespace) -> FastStream:
    from toolgate.services.audit.app import build_app

    return build_app(settings, args.clickhouse_url)


# In `toolgate serve`'s order (its choices).
SERVICES: dict[str, Service] = {
    s.name: s
    for s in (
        Service("validator", _validator, "validator", pipeline=True),
        Service("policy", _policy, "policy", pipeline=True),
        Service("executor", _executor, "executor", pipeline=True),
        Service("attacher", _attacher, "attacher", pipeline=True),
        Service("approvals", _approvals, "approvals", pipeline=True),
        # Tells webhooks about approvals and decides nothing.
        Service("notifier", _notifier, "notifier"),
        # The audit sink only reads.
        Service("audit", _audit, "audit"),
        # The front door: its role is of an account of its own (MCP_FRONT).
        Service("mcp", None, "mcp_front"),
    )
}
PIPELINE = tuple(name for name, s in SERVICES.items() if s.pipeline)
AUDIT = "audit"
NOTIFIER = "notifier"
MCP = "mcp"
