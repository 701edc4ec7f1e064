"""`toolgate bench trips`: what one call costs the bus, counted, not timed.

Timings on a shared machine are noise; counts are not. This runs calls
through a whole gateway (a private one started as `toolgate up` starts it:
locked bus, audit on; or a running one with `--nats-url` and the operator's
creds) and, as the operator, taps every message of the TOOLGATE account (a
subscription to `>`) while they go through: N calls one at a time, then a
burst (`--burst`), each window until every consumer, the audit's too, has
caught up. Each message is sorted by what it is:

- a JetStream publish, by stream and event kind (its publish ack is one
  round trip), and the KV writes by bucket and operation (create: a put that
  must be the key's first; update: one that names the revision it replaces;
  delete/purge);
- a delivery of a stored message to a durable consumer, and what the
  consumer said back (ack, nak, in progress, term), per durable;
- other JetStream API requests (direct gets, KV reads, ...) and core
  request/replies;
- what runs on timers, not per call (pull requests and their ends,
  heartbeats, advisories), shown apart, as totals for the window.

Besides the tap, the streams' last sequence numbers before and after give
the messages stored per call on each stream (the server's own count).
The operator connection's own requests (its inbox prefix) are left out.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from toolgate.bench.drivers import PlainClient, tool_call
from toolgate.bench.loops import say
from toolgate.bench.pipeline import (
    Gate,
    _load,
    _wait_for_pipeline,
)
from toolgate.bench.targets import Target, gateway_target
from toolgate.contracts import subjects
from toolgate.runtime.creds import connect_options
from toolgate.stack.services import AUDIT

# The tap's own requests (consumer and stream info) come back on this prefix: not counted.
OWN_INBOX = "_INBOX_trips"
# After the consumers caught up: a moment for the last copies to reach the tap.
SETTLE_S = 0.3
# How long to wait for the audit's durables (ClickHouse starts slowly on a loaded machine).
AUDIT_WAIT_S = 120.0

# Rows of the table, in this order.
SECTIONS = (
    "stored (JetStream publish + publish ack)",
    "KV writes (a stored message + its ack)",
    "deliveries to durables",
    "acks sent by consumers",
    "other requests (request + reply)",
    "core messages (no ack)",
)
BACKGROUND = "timer-driven (totals, not per call)"


def kv_operation(headers: dict[str, str]) -> str:
    """What a message on `$KV.<bucket>.<key>` does to the key."""
    op = headers.get("KV-Operation", "")
    if op == "DEL":
        return "delete"
    if op == "PURGE":
        return "purge"
    expected = headers.get("Nats-Expected-Last-Subject-Sequence")
    if expected is None:
        return "put"
    return "create" if expected == "0" else "update"


def ack_kind(data: bytes) -> str:
    if data in (b"", b"+ACK"):
        return "ack"
    for prefix, kind in ((b"-NAK", "nak"), (b"+WPI", "in progress"), (b"+TERM", "term")):
        if data.startswith(prefix):
            return kind
    if data.startswith(b"+NXT"):
        return "next"
    return "ack?"


def ack_target(subject: str) -> tuple[str, str]:
    """(stream, durable) of a `$JS.ACK.` subject, in its v1 or v2 (domain, account) form."""
    tokens = subject.split(".")
    if len(tokens) >= 12:  # $JS.ACK.<domain>.<account>.<stream>.<durable>....
        return tokens[4], tokens[5]
    return tokens[2], tokens[3]


def stream_of(subject: str) -> str | None:
    """Which of toolgate's streams stores a publish on `subject` (None: none)."""
    if subject.startswith(subjects.CALLS_PREFIX + "."):
        return subjects.CALLS_STREAM
    if subject.startswith(subjects.EVENTS_PREFIX + "."):
        return subjects.EVENTS_STREAM
    if subject.startswith(subjects.RESULTS_PREFIX + "."):
        return subjects.RESULTS_STREAM
    if subject.startswith(subjects.NOTIFY_PREFIX + "."):
        return subjects.NOTIFICATIONS_STREAM
    if subject == subjects.AUDIT_SEALS_SUBJECT:
        return subjects.AUDIT_SEALS_STREAM
    return None


def _what_on_stream(stream: str, subject: str) -> str:
    if stream == subjects.EVENTS_STREAM:
        return subject.split(".")[2] if subject.count(".") >= 2 else subject
    if stream == subjects.RESULTS_STREAM:
        return "pending notice" if subject.endswith(".pending") else "result"
    if stream == subjects.CALLS_STREAM:
        return "call"
    return subject


def classify(msg: Msg) -> tuple[str, str] | None:
    """(section, row) a tapped message counts under; None: the tap's own traffic."""
    subject, reply = msg.subject, msg.reply or ""
    headers = msg.headers or {}
    if subject.startswith(OWN_INBOX) or reply.startswith(OWN_INBOX):
        return None
    if reply.startswith("$JS.ACK."):
        stream, durable = ack_target(reply)
        return SECTIONS[2], f"{stream} > {durable}"
    if subject.startswith("$JS.ACK."):
        stream, durable = ack_target(subject)
        kind = ack_kind(msg.data)
        if reply:
            kind += " (awaited)"
        return SECTIONS[3], f"{durable}: {kind}"
    if subject.startswith("$KV."):
        bucket = subject.split(".")[1]
        return SECTIONS[1], f"{bucket}: {kv_operation(headers)}"
    if subject.startswith("$JS.API."):
        rest = subject[len("$JS.API.") :].split(".")
        if rest[:3] == ["CONSUMER", "MSG", "NEXT"]:
            return BACKGROUND, "pull requests"
        if rest[:2] == ["DIRECT", "GET"]:
            return SECTIONS[4], f"direct get {rest[2] if len(rest) > 2 else ''}"
        if rest[:3] == ["STREAM", "MSG", "GET"]:
            return SECTIONS[4], f"stream msg get {rest[3] if len(rest) > 3 else ''}"
        return BACKGROUND, "JetStream API " + ".".join(rest[:2])
    if subject.startswith(("$JS.EVENT.", "$SYS.")):
        return BACKGROUND, "advisory " + ".".join(subject.split(".")[3:5])
    status = headers.get("Status")
    if status is not None and not msg.data:
        return BACKGROUND, f"status {status} (pull ends, heartbeats, no responders)"
    on_stream = stream_of(subject)
    if on_stream is not None:
        stream = on_stream
        what = _what_on_stream(stream, subject)
        if reply:
            return SECTIONS[0], f"{stream}: {what}"
        return SECTIONS[5], f"{stream} subject, plain publish: {what}"
    if msg.data.startswith(b'{"stream":') or msg.data.startswith(b'{"error":'):
        return BACKGROUND + " ", "publish acks (one per stored message above)"
    if reply:
        return SECTIONS[4], f"core request {'.'.join(subject.split('.')[:3])}"
    if subject.startswith(("_INBOX", "_R_")):
        return BACKGROUND + " ", "replies to requests (API answers, direct gets)"
    return BACKGROUND + " ", f"others ({'.'.join(subject.split('.')[:2])}.*)"


@dataclass
class Tap:
    """Counts what goes by while it is on."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    on: bool = False

    async def on_message(self, msg: Msg) -> None:
        if not self.on:
            return
        found = classify(msg)
        if found is not None:
            self.counts[found] += 1


@dataclass
class Counted:
    """One window: how many calls, what the tap counted, what the streams stored."""

    name: str
    calls: int
    counts: Counter[tuple[str, str]]
    stored: dict[str, int]
    seconds: float


async def last_sequences(admin: Client) -> dict[str, int]:
    js = admin.jetstream()
    found = {}
    for name in await js.streams_info():
        found[name.config.name or "?"] = name.state.last_seq
    return found


async def count_window(
    name: str,
    calls: int,
    burst: bool,
    client: PlainClient,
    admin: Client,
    tap: Tap,
    gate: Gate,
    prefix: str,
) -> Counted:
    await gate.drain()
    before = await last_sequences(admin)
    await admin.flush()
    tap.counts = Counter()
    tap.on = True
    started = time.monotonic()
    if burst:
        await asyncio.gather(*(client.call(f"{prefix}-{i}") for i in range(calls)))
    else:
        for i in range(calls):
            await client.call(f"{prefix}-{i}")
    await gate.drain()
    await asyncio.sleep(SETTLE_S)
    await admin.flush()
    tap.on = False
    seconds = time.monotonic() - started
    after = await last_sequences(admin)
    stored = {s: after.get(s, 0) - before.get(s, 0) for s in after}
    return Counted(name, calls, tap.counts, stored, seconds)


def table(windows: Iterable[Counted]) -> list[str]:
    """Per call, one column per window; the timer-driven rows as totals."""
    windows = list(windows)
    width = 10
    rows: dict[str, set[str]] = {}
    for w in windows:
        for section, row in w.counts:
            rows.setdefault(section, set()).add(row)
    head = f"{'per call':<58}" + "".join(f"{w.name:>{width}}" for w in windows)
    lines = [head]

    def line(label: str, values: list[float], fmt: str = ".2f") -> str:
        return f"  {label:<56}" + "".join(f"{v:{width}{fmt}}" for v in values)

    for section in SECTIONS:
        if section not in rows:
            continue
        lines.append(section)
        totals = [0.0] * len(windows)
        for row in sorted(rows[section]):
            values = [w.counts.get((section, row), 0) / w.calls for w in windows]
            totals = [a + b for a, b in zip(totals, values, strict=True)]
            lines.append(line(row, values))
        lines.append(line("= total", totals))
    lines.append("stored messages per call, by stream (the server's sequence numbers)")
    streams = sorted({s for w in windows for s, n in w.stored.items() if n})
    for stream in streams:
        lines.append(line(stream, [w.stored.get(stream, 0) / w.calls for w in windows]))
    lines.append(line("= total", [sum(w.stored.values()) / w.calls for w in windows]))
    lines.append(
        "requests answered per call (publish acks, awaited acks, other requests): "
        + "  ".join(f"{w.name} {round_trips(w):.2f}" for w in windows)
    )
    for section in (BACKGROUND, BACKGROUND + " "):
        if section not in rows:
            continue
        lines.append(f"{section.strip()}: totals over the window")
        for row in sorted(rows[section]):
            values = [float(w.counts.get((section, row), 0)) for w in windows]
            lines.append(line(row, values, ".0f"))
    lines.append(line("window, seconds", [w.seconds for w in windows], ".1f"))
    return lines


def round_trips(w: Counted) -> float:
    total = 0
    for (section, row), n in w.counts.items():
        if section in (SECTIONS[0], SECTIONS[1], SECTIONS[4]) or (
            section == SECTIONS[3] and row.endswith("(awaited)")
        ):
            total += n
    return total / w.calls


async def _count(target: Target, args: argparse.Namespace, run: str) -> list[Counted]:
    admin = await nats.connect(
        target.nats_url, inbox_prefix=OWN_INBOX, **connect_options(target.admin_creds)
    )
    tap = Tap()
    try:
        await admin.subscribe(">", cb=tap.on_message, pending_msgs_limit=-1, pending_bytes_limit=-1)
        gate = Gate(
            admin.jetstream(), [subjects.CALLS_STREAM, subjects.EVENTS_STREAM], target.processes
        )
        say("waiting for one call to go through")
        await _wait_for_pipeline(target.nats_url, target.agent_creds)
        await _wait_for_audit(admin)
        await gate.drain()
        client = await PlainClient.connect(target.nats_url, target.agent_creds, target.principal)
        try:
            for i in range(5):  # warm: every durable has asked, every store is open
                await client.call(f"t{run}-warm-{i}")
            windows = []
            if args.calls:
                say(f"counting {args.calls} calls, one at a time")
                windows.append(
                    await count_window(
                        "seq", args.calls, False, client, admin, tap, gate, f"t{run}-s"
                    )
                )
            if args.burst:
                say(f"counting a burst of {args.burst} calls")
                windows.append(
                    await count_window(
                        "burst", args.burst, True, client, admin, tap, gate, f"t{run}-b"
                    )
                )
            if client.failures:
                say(f"warning: {client.failures} calls did not end ok")
            return windows
        finally:
            await client.close()
    finally:
        await admin.close()


async def _wait_for_audit(admin: Client, timeout_s: float = AUDIT_WAIT_S) -> None:
    """Until the audit reads both streams (its durables exist): its deliveries and acks
    are part of what a call costs. A gateway without an audit is counted without."""
    js = admin.jetstream()
    deadline = time.monotonic() + timeout_s
    for stream in (subjects.CALLS_STREAM, subjects.EVENTS_STREAM):
        while True:
            try:
                await js.consumer_info(stream, AUDIT)
                break
            except NotFoundError:
                if time.monotonic() > deadline:
                    say(f"no audit consumer on {stream} after {timeout_s:.0f} s: counted without")
                    return
                await asyncio.sleep(0.2)


def cmd_bench_trips(args: argparse.Namespace) -> int:
    if args.calls < 0 or args.burst < 0 or not (args.calls or args.burst):
        print(
            "toolgate bench trips: -n and --burst must not be negative, nor both 0", file=sys.stderr
        )
        return 2
    run = str(int(time.time()))
    with (
        tempfile.TemporaryDirectory(prefix="toolgate-trips-") as tmp,
        gateway_target(args, Path(tmp)) as target,
    ):
        windows = asyncio.run(_count(target, args, run))
    calls = " and ".join(
        f"{w.calls} calls {'at once' if w.name == 'burst' else 'one at a time'}" for w in windows
    )
    print(
        f"toolgate bench trips: messages on the bus per call, tool 'echo', {calls}; "
        f"{target.description}; {_load()}"
    )
    for text in table(windows):
        print(text)
    return 0


__all__ = ["classify", "cmd_bench_trips", "table", "tool_call"]
