"""Helpers for the approvals tests (no tests here): the service as a real
process, ApprovalRequested events built as the policy builds them, waiting
for events on the real events stream."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
from nats.js.errors import NotFoundError

from tests.harness import REPO_ROOT, events_of, read_events
from tests.harness import publish_event as publish_event  # the approvals tests import it from here
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import PendingNotice, Principal, ToolCall
from toolgate.contracts.events import (
    ApprovalRequested,
    Event,
    call_fields,
    derive_event_id,
    utc_now,
)
from toolgate.runtime.topology import apply_topology
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.store import ensure_bucket

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")


async def prepare_bus(url: str) -> None:
    """The topology `toolgate up` applies, plus the approvals bucket."""
    await apply_topology(url)
    nc = await nats.connect(url)
    try:
        await ensure_bucket(nc.jetstream())
    finally:
        await nc.close()


def approvers(data_dir: Path, *names: str, tenants: tuple[str, ...] = ("acme",)) -> dict[str, str]:
    """Approvers of `tenants` (default: acme, ALICE's tenant); name -> token."""
    return {name: add_approver(data_dir, name, list(tenants)) for name in names}


def key_of(call_id: str, principal: Principal = ALICE) -> str:
    """The call key approvers address a call by: TENANT.AGENT.CALL_ID."""
    return subjects.call_key(principal.tenant, principal.agent, call_id)


def of_call(events: list[Event], call_id: str, principal: Principal = ALICE) -> list[Event]:
    """The events of one call: (tenant, agent, call_id), not the call_id alone."""
    return [
        e
        for e in events
        if e.call_id == call_id
        and e.principal is not None
        and (e.principal.tenant, e.principal.agent) == (principal.tenant, principal.agent)
    ]


def approval_requested(
    call_id: str,
    arguments: dict,
    *,
    n: int = 1,
    ttl: timedelta = timedelta(minutes=15),
    principal: Principal = ALICE,
    tool: str = "save_evidence",
) -> ApprovalRequested:
    """What the policy emits for a call that needs a human (nothing is signed)."""
    call = ToolCall(
        call_id=call_id,
        tool=tool,
        arguments=arguments,
        principal=principal,
        task_id="task_c04",
    )
    now = utc_now()
    return ApprovalRequested(
        # As the policy's ids, unique per call (tenant, agent, call_id): the stream's
        # Nats-Msg-Id dedupe would drop a second agent's request with the same call_id.
        event_id=derive_event_id(f"test:{key_of(call_id, principal)}", "approval-requested"),
        occurred_at=now,
        service="policy",
        call=call,
        policy_version="test-policy-1",
        policy_ids=["critical-needs-approval"],
        risk="critical",
        required_approvals=n,
        expires_at=now + ttl,
        reason=f"{tool} is critical",
        arguments_sha256=arguments_sha256(arguments),
        **call_fields(call),
    )


async def wait_for_events(
    url: str,
    call_id: str,
    done: Callable[[list[Event]], bool],
    timeout: float = 15.0,
    principal: Principal | None = None,
    **options: Any,
) -> list[Event]:
    """Wait until `done(events of the call)`; with `principal`, of that agent's call only."""
    deadline = time.monotonic() + timeout
    while True:
        events = await read_events(url, **options)
        found = (
            events_of(events, call_id) if principal is None else of_call(events, call_id, principal)
        )
        if done(found):
            return found
        if time.monotonic() > deadline:
            raise TimeoutError(f"events of {call_id} so far: {[type(e).__name__ for e in found]}")
        await asyncio.sleep(0.1)


def types_of(events: list[Event]) -> list[str]:
    return [type(e).__name__ for e in events]


async def pending_notices(
    url: str, call_id: str, principal: Principal = ALICE, **options: Any
) -> list[PendingNotice]:
    """Every pending notice stored on this call's `.pending` subject (at most one)."""
    import msgspec

    nc = await nats.connect(url, **options)
    subject = subjects.pending_subject(principal.tenant, principal.agent, call_id)
    try:
        info = await nc.jsm().stream_info(subjects.RESULTS_STREAM, subjects_filter=subject)
        stored = (info.state.subjects or {}).get(subject, 0)
        if not stored:
            return []
        msg = await nc.jsm().get_last_msg(subjects.RESULTS_STREAM, subject)
    except NotFoundError:
        return []
    finally:
        await nc.close()
    assert msg.data is not None
    return [msgspec.json.decode(msg.data, type=PendingNotice)] * stored


async def pending_notice(
    url: str, call_id: str, principal: Principal = ALICE, **options: Any
) -> PendingNotice | None:
    found = await pending_notices(url, call_id, principal, **options)
    return found[-1] if found else None


def service_env() -> dict[str, str]:
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


@dataclass
class ServiceProc:
    """`toolgate serve approvals`: one replica, its own process."""

    url: str
    data_dir: Path
    log_path: Path
    sweep_interval_s: float = 0.3
    registry_dirs: tuple[Path, ...] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ServiceProc:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "toolgate.cli",
                    "serve",
                    "approvals",
                    "--nats-url",
                    self.url,
                    "--data-dir",
                    str(self.data_dir),
                    "--sweep-interval",
                    str(self.sweep_interval_s),
                    *(arg for d in self.registry_dirs for arg in ("--registry", str(d))),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=service_env(),
                start_new_session=True,
            )
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def ready(self, timeout: float = 30.0) -> ServiceProc:
        """Started: FastStream says so (its vote subscriber and durable are up)."""
        deadline = time.monotonic() + timeout
        while "started successfully" not in self.log():
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"approvals service died: {self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"approvals service not ready: {self.log()[-3000:]}")
            await asyncio.sleep(0.1)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
