"""The gateway a bench runs against: a private one started as `toolgate up` runs it,
or a running one given by `--nats-url` (with `--creds` / `--agent-creds`).

`gateway_target(args, tmp)` is that choice, once, for every bench that drives the
pipeline (`toolgate bench`, `bench soak`, `bench trips`): it yields a `Target` (where
the gateway is, whose creds drive the calls and whose read the consumers, which
processes to count CPU of) and stops a private gateway on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from toolgate.bench import procs
from toolgate.bench.loops import say
from toolgate.contracts.calls import Principal
from toolgate.runtime.creds import identity_of_creds
from toolgate.runtime.settings import env_nats_creds
from toolgate.stack.services import AUDIT, PIPELINE
from toolgate.stack.supervisor import Stack

PRINCIPAL = Principal(tenant="bench", user="u-bench", agent="bench", session="s-bench")
PRIVATE = "a private gateway (locked bus, audit on)"
RUNNING = "a running gateway"


def principal_for(creds: Path | None) -> Principal:
    """The bench's principal: the agent `creds` speak for, else bench.bench."""
    identity = identity_of_creds(creds) if creds is not None else None
    tenant, agent = identity or (PRINCIPAL.tenant, PRINCIPAL.agent)
    return Principal(tenant=tenant, user=PRINCIPAL.user, agent=agent, session=PRINCIPAL.session)


@dataclass
class Target:
    """The gateway under test and who may do what on it."""

    nats_url: str
    agent_creds: Path | None
    admin_creds: Path | None
    processes: procs.Processes
    description: str

    @property
    def principal(self) -> Principal:
        return principal_for(self.agent_creds)


def creds_of(args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """(agent's, operator's) creds for a gateway given by --nats-url."""
    creds: Path | None = args.creds
    agent: Path | None = getattr(args, "agent_creds", None)
    if creds is not None and identity_of_creds(creds) is not None:
        # An agent's creds given as --creds: they drive the calls; the floor needs the admin's.
        agent, creds = agent or creds, env_nats_creds("admin")
    if agent is None:
        recorded = env_nats_creds("agent")
        agent = recorded if recorded is not None and identity_of_creds(recorded) else creds
    return agent, creds


@contextlib.contextmanager
def gateway_target(
    args: argparse.Namespace,
    tmp: Path,
    *,
    running: str = RUNNING,
    say_started: bool = False,
) -> Iterator[Target]:
    """The gateway of `args`: without --nats-url a private one in `tmp/gateway`, started
    as `toolgate up` runs it (locked bus, audit on, the executor at concurrency 8) and
    stopped on the way out; with it, the running one there, described as `running`.
    `say_started`: say how long the private gateway took to start."""
    if args.nats_url is not None:
        agent, admin = creds_of(args)
        yield Target(
            args.nats_url,
            agent,
            admin,
            procs.of_running_gateway(args.nats_url, (*PIPELINE, AUDIT)),
            running,
        )
        return
    say("starting a private gateway as `toolgate up` runs it (locked bus, audit on)")
    stack = Stack(data_dir=tmp / "gateway", executor_args=["--concurrency", "8"])
    try:
        started = time.monotonic()
        stack.start()
        if say_started:
            say(f"gateway processes started in {time.monotonic() - started:.1f} s")
        yield Target(
            stack.url,
            stack.creds_of("agent"),
            stack.creds_of("admin"),
            procs.of_stack(stack),
            PRIVATE,
        )
    finally:
        stack.stop()


__all__ = ["PRINCIPAL", "Target", "creds_of", "gateway_target", "principal_for"]
