"""`toolgate audit replay`: the recorded calls it compares, and its `--execute` mode.

By default `audit replay` re-decides (cli/redecide.py): nothing is published and
no tool runs. This module finds the recorded calls (each by its first request:
the one that was decided) and, only for `--execute`, drives them through a
running gateway again: a re-executed call is a new call of the same agent:
new call_id `rp-<original>-<random>` and `context.replay_of = <original>`,
published on that agent's calls subject (tenant and agent are the ones the
bus recorded for the original, not its payload's word), so it is validated,
decided and (where the policy says so) approved again, under today's registry
and policy, and its own events are audited. The command lets only tools
declared `read_only` be re-executed. With the operator's (admin) creds any
agent's calls can be re-executed; with an agent's creds, only that agent's.
Only calls whose arguments were recorded in full can be replayed; the
original result is compared by status and by the SHA-256 of its data (which
the audit keeps even when the data itself is redacted).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from clickhouse_connect.driver.client import Client
from nats.js.errors import Error as JetStreamError

from toolgate.client.gateway_client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    GatewayClient,
    ResultTimeout,
)
from toolgate.contracts.calls import ToolCall, ToolResult
from toolgate.services.audit.progress import Progress
from toolgate.services.audit.rows import sha256_of

REPLAY_PREFIX = "rp-"
_call_decoder = msgspec.json.Decoder(ToolCall)


@dataclass(frozen=True)
class RecordedCall:
    call_id: str
    call: ToolCall | None  # None: the arguments were not recorded, or the call was malformed
    why_not: str = ""
    status: str = ""
    error_code: str = ""
    result: dict[str, Any] | None = None
    result_sha256: str = ""
    # Who sent it, as the bus recorded it (a call is (tenant, agent, call_id)).
    tenant: str = ""
    agent: str = ""
    # The call as its agent published it (its own principal claim included), for
    # deciding it again as the validator did; None when `call` is None.
    published: dict[str, Any] | None = None


@dataclass(frozen=True)
class Replayed:
    original: RecordedCall
    new_call_id: str = ""
    new: ToolResult | None = None
    error: str = ""

    @property
    def same(self) -> bool | None:
        """Whether the new result matches the recorded one (None: could not replay)."""
        if self.new is None:
            return None
        if self.new.status != self.original.status:
            return False
        if self.new.ok and self.original.result_sha256:
            return sha256_of(self.new.data) == self.original.result_sha256
        code = self.new.error.code if self.new.error else ""
        return code == self.original.error_code


def replay_call_id(original: str) -> str:
    # At most 128 characters; the full original id is in context.replay_of anyway.
    return f"{REPLAY_PREFIX}{original[:110]}-{uuid.uuid4().hex[:8]}"


def find_recorded(
    client: Client,
    call_id: str | None = None,
    since: datetime | None = None,
    tool: str | None = None,
    agent: str | None = None,
    user: str | None = None,
    status: str | None = None,
    include_replays: bool = False,
    limit: int = 20,
    tenant: str | None = None,
) -> list[RecordedCall]:
    where = ["event_type = 'CallRequested'", "call_id != ''"]
    params: dict[str, Any] = {"limit": limit}
    filters = {"call_id": call_id, "tool": tool, "tenant": tenant, "agent": agent, "user": user}
    for column, value in filters.items():
        if value:
            where.append(f"{column} = {{{column}:String}}")
            params[column] = value
    if since is not None:
        where.append("occurred_at >= {since:DateTime64(6, 'UTC')}")
        params["since"] = since
    if status:
        where.append(
            "(tenant, agent, call_id) IN (SELECT tenant, agent, call_id FROM events "
            "WHERE event_type = 'ResultAttached' AND status = {status:String})"
        )
        params["status"] = status
    if not include_replays and not call_id:
        where.append(f"NOT startsWith(call_id, '{REPLAY_PREFIX}')")
    # The same call_id from two agents is two calls: each is keyed by its sender too.
    # A call_id published again is the same call: its first request is the one decided.
    requested = client.query(
        "SELECT tenant, agent, call_id, argMin(payload, occurred_at), argMin(note, occurred_at), "
        f"min(occurred_at) AS first FROM events WHERE {' AND '.join(where)} "
        "GROUP BY tenant, agent, call_id ORDER BY first DESC LIMIT {limit:UInt32}",
        parameters=params,
    ).result_rows
    ids = sorted({r[2] for r in requested})
    results = (
        {
            tuple(r[:3]): r[3:]
            for r in client.query(
                "SELECT tenant, agent, call_id, argMax(status, occurred_at), "
                "argMax(error_code, occurred_at), argMax(payload, occurred_at), "
                "argMax(result_sha256, occurred_at) FROM events "
                "WHERE event_type = 'ResultAttached' AND call_id IN {ids:Array(String)} "
                "GROUP BY tenant, agent, call_id",
                parameters={"ids": ids},
            ).result_rows
        }
        if ids
        else {}
    )
    recorded = []
    for tenant_, agent_, cid, payload, note, _ in reversed(requested):  # oldest first
        status_, code, result_payload, sha = results.get((tenant_, agent_, cid), ("", "", "{}", ""))
        call, why_not = recorded_call(payload, note, tenant_, agent_)
        recorded.append(
            RecordedCall(
                cid,
                call,
                why_not,
                status_,
                code,
                json.loads(result_payload).get("result"),
                sha,
                tenant=tenant_,
                agent=agent_,
                published=json.loads(payload)["call"] if call is not None else None,
            )
        )
    return recorded


def recorded_call(payload: str, note: str, tenant: str, agent: str) -> tuple[ToolCall | None, str]:
    document = json.loads(payload)
    call = document.get("call")
    if call is None:
        return None, f"the call was not decodable ({note})"
    arguments = call.get("arguments")
    if isinstance(arguments, dict) and "redacted" in arguments and len(arguments) <= 2:
        return None, f"its arguments were not recorded (audit: {arguments['redacted']})"
    decoded = _call_decoder.decode(json.dumps(call))
    if tenant and agent:  # the sender the bus recorded, whatever the payload claimed
        decoded = msgspec.structs.replace(
            decoded,
            principal=msgspec.structs.replace(decoded.principal, tenant=tenant, agent=agent),
        )
    return decoded, ""


async def replay(
    nats_url: str,
    recorded: list[RecordedCall],
    creds: Path | None = None,
    timeout: float = 60.0,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    progress: Progress | None = None,
) -> list[Replayed]:
    """Replay each call (all at once); `progress` counts the ones done."""
    async with await GatewayClient.connect(
        nats_url, creds, connect_timeout=connect_timeout
    ) as client:

        async def one(original: RecordedCall) -> Replayed:
            outcome = await attempt(original)
            if progress is not None:
                progress.advance()
            return outcome

        async def attempt(original: RecordedCall) -> Replayed:
            if original.call is None:
                return Replayed(original, error=f"cannot replay: {original.why_not}")
            sender = (original.call.principal.tenant, original.call.principal.agent)
            if client.identity is not None and client.identity != sender:
                return Replayed(
                    original,
                    error=(
                        f"cannot replay: a call of {sender[0]}.{sender[1]}, and these creds "
                        f"speak for {client.identity[0]}.{client.identity[1]} (replay it with "
                        "that agent's creds or the operator's)"
                    ),
                )
            call = msgspec.structs.replace(
                original.call,
                call_id=replay_call_id(original.call_id),
                context={**original.call.context, "replay_of": original.call_id},
            )
            try:
                return Replayed(original, call.call_id, await client.submit(call, timeout))
            except ResultTimeout as exc:
                return Replayed(original, call.call_id, error=str(exc))
            except (TimeoutError, nats.errors.Error, JetStreamError) as exc:
                return Replayed(
                    original,
                    call.call_id,
                    error=(f"the gateway did not take the call: {type(exc).__name__}: {exc}"),
                )

        async def tick() -> None:  # a line every interval even while every call still waits
            while progress is not None:
                await asyncio.sleep(0.5)
                progress.maybe_report()

        ticker = asyncio.create_task(tick())
        try:
            return list(await asyncio.gather(*(one(r) for r in recorded)))
        finally:
            ticker.cancel()


def side_by_side(replayed: Replayed, width: int = 60) -> str:
    """Original and new result in two columns."""
    original = {
        "call_id": replayed.original.call_id,
        "status": replayed.original.status,
        "error_code": replayed.original.error_code,
        "result": replayed.original.result,
    }
    new: dict[str, Any] = (
        {"call_id": replayed.new_call_id}
        if replayed.new is None
        else {"call_id": replayed.new_call_id, **msgspec.to_builtins(replayed.new)}
    )
    left = json.dumps(original, indent=2, ensure_ascii=False, default=str).splitlines()
    right = json.dumps(new, indent=2, ensure_ascii=False, default=str).splitlines()
    verdict = {
        True: "SAME result",
        False: "DIFFERENT result",
        None: f"not replayed: {replayed.error}",
    }
    lines = [f"{'original (recorded)':<{width}} | replayed", "-" * width + "-+-" + "-" * width]
    for i in range(max(len(left), len(right))):
        a = left[i] if i < len(left) else ""
        b = right[i] if i < len(right) else ""
        lines.append(f"{a[:width]:<{width}} | {b[:width]}")
    lines.append(verdict[replayed.same])
    return "\n".join(lines)
