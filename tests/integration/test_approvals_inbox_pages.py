"""The inbox's page per call, its history of decided calls, duplicates, the tool's
registry facts on a card, and live updates over server-sent events (their
authorization and caps), against a real nats-server and approvals service process.
(The browser side, screenshots included: tests/system/test_approval_inbox.py.)"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_approvals_inbox_http import http
from tests.integration.test_approvals_support import (
    ServiceProc,
    approval_requested,
    approvers,
    prepare_bus,
    publish_event,
)
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal
from toolgate.runtime.http_server import SlowClientLimits
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.client import ApprovalsClient
from toolgate.services.approvals.inbox import Inbox, LiveLimits
from toolgate.stack.nats_server import EmbeddedNats

ARGS = {"task_id": "task_c04", "claim": "wire it", "source_url": "https://example.org"}
SHA = arguments_sha256(ARGS)
KEY = "acme.researcher.call_up"
GLOBEX = Principal(tenant="globex", user="u-gina", agent="researcher", session="s-7")
PIN = "c" * 64
# The registry's words are shown to a person: the server URL is as odd as the pattern allows.
SERVER = "https://up.example/mcp?x=<script>alert(1)</script>"
UPSTREAM_TOOL = f"""\
name: up_wire
description: "Wire money through the upstream <b>bank</b>\\u202e."
input_schema: {{type: object}}
output_schema: {{type: object}}
mcp: {{url: "{SERVER}", tool: wire, definition_sha256: "{PIN}"}}
read_only: false
timeout_s: 5
risk: critical
allowed_agents: ["*"]
"""
# Short enough that a held-open stream outlives the door's head and idle timeouts.
LIMITS = SlowClientLimits(max_connections=16, head_timeout_s=1.0, idle_timeout_s=1.0)
# A quiet stream's heartbeats come further apart than those timeouts.
LIVE = LiveLimits(poll_s=0.2, heartbeat_s=2.5, max_streams=3, max_per_approver=2)


@dataclass
class Setup:
    inbox: Inbox
    tokens: dict[str, str]
    url: str
    data_dir: Path
    service: ServiceProc
    logs: Path
    extra: list[ServiceProc] = field(default_factory=list)


@pytest.fixture
async def setup(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[Setup]:
    await prepare_bus(nats_server.url)
    data_dir = tmp_path / "data"
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "up_wire.yaml").write_text(UPSTREAM_TOOL)
    tokens = approvers(data_dir, "bob", "u-alice")
    tokens["gus"] = add_approver(data_dir, "gus", ["globex"])
    service = (
        await ServiceProc(
            nats_server.url, data_dir, tmp_path / "logs" / "approvals.log", registry_dirs=(tools,)
        )
        .start()
        .ready()
    )
    await publish_event(nats_server.url, approval_requested("call_up", ARGS, n=1, tool="up_wire"))
    await publish_event(
        nats_server.url, approval_requested("call_up", ARGS, principal=GLOBEX, tool="up_wire")
    )
    inbox = await asyncio.to_thread(Inbox(nats_server.url, limits=LIMITS, live=LIVE).start)
    found = Setup(inbox, tokens, nats_server.url, data_dir, service, tmp_path / "logs")
    await until_stored(found, KEY, "bob")
    yield found
    await asyncio.to_thread(inbox.stop)
    for proc in [service, *found.extra]:
        proc.stop()


async def until_stored(setup: Setup, key: str, who: str) -> None:
    async with await ApprovalsClient.connect(setup.url, token=setup.tokens[who]) as client:
        for _ in range(150):
            if await client.get(key) is not None:
                return
            await asyncio.sleep(0.1)
    raise TimeoutError(f"the approvals service never stored {key}")


def bearer(setup: Setup, who: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {setup.tokens[who]}"}


async def get(setup: Setup, path: str, headers: dict[str, str]) -> tuple[int, str]:
    status, _, body = await asyncio.to_thread(http, "GET", setup.inbox.url + path, None, headers)
    return status, body


async def login(setup: Setup, who: str) -> dict[str, str]:
    status, headers, _ = await asyncio.to_thread(
        http, "POST", setup.inbox.url + "/login", {"token": setup.tokens[who]}
    )
    assert status == 303
    return {"Cookie": headers["Set-Cookie"].split(";")[0]}


async def test_the_page_of_a_call_shows_its_tool_and_hides_other_tenants_calls(
    setup: Setup,
) -> None:
    status, body = await get(setup, f"/calls/{KEY}", bearer(setup, "bob"))
    assert status == 200 and f'data-call-key="{KEY}"' in body
    # The registry's description and, for an upstream MCP tool, its server and pin.
    assert "Wire money through the upstream &lt;b&gt;bank&lt;/b&gt;\\u202e." in body
    assert "<b>bank" not in body and "\u202e" not in body
    assert "https://up.example/mcp?x=&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert f"<code class=pin>{PIN}</code>" in body
    assert "<code class=upstream-tool>wire</code>" in body
    assert "up_wire is critical" in body  # the policy's why
    assert "name=approve" not in body and "class=approve" in body  # a vote form on it
    # gus (globex) asks for acme's call: the very answer of a call that does not exist.
    _, missing = await get(setup, "/calls/acme.researcher.call_nope", bearer(setup, "gus"))
    status, hidden = await get(setup, f"/calls/{KEY}", bearer(setup, "gus"))
    assert status == 404 and hidden == missing and "wire it" not in hidden
    for odd in ("call_up", "acme.researcher", "..%2f..%2fetc", "acme.x.call_up%00"):
        status, body = await get(setup, f"/calls/{odd}", bearer(setup, "bob"))
        assert status == 404 and body == missing, odd
    # Without a login (a notification's link): the login form, nothing of the call, and
    # the login leads to the call's page (never to another site).
    status, body = await get(setup, f"/calls/{KEY}", {})
    assert status == 200 and "id=token" in body and "wire it" not in body
    assert f"name=back value='/calls/{KEY}'" in body
    for back, lands in ((f"/calls/{KEY}", f"/calls/{KEY}"), ("https://evil.example/", "/")):
        status, headers, _ = await asyncio.to_thread(
            http,
            "POST",
            setup.inbox.url + "/login",
            {"token": setup.tokens["bob"], "back": back},
        )
        assert status == 303 and headers["Location"] == lands


async def test_a_vote_on_the_call_page_then_history_tells_who_when_why(
    setup: Setup, tmp_path: Path
) -> None:
    session = await login(setup, "bob")
    _, body = await get(setup, f"/calls/{KEY}", session)
    csrf = body.split('name=csrf value="')[1].split('"')[0]
    form = {
        "csrf": csrf,
        "call": KEY,
        "decision": "deny",
        "arguments_sha256": SHA,
        "reason": "Payee unknown <i>to us</i>.",
        "back": f"/calls/{KEY}",
    }
    status, headers, _ = await asyncio.to_thread(
        http, "POST", setup.inbox.url + "/vote", form, session
    )
    assert status == 303 and headers["Location"] == f"/calls/{KEY}"
    status, body = await get(setup, f"/calls/{KEY}", session)
    assert status == 200 and "denied: the call will not run" in body  # the flash
    assert "class='decision decision-denied'" in body and "<b class=voter>bob</b> denied" in body
    assert "Payee unknown &lt;i&gt;to us&lt;/i&gt;." in body and "name=reason" not in body
    # A foreign `back` sends the browser home, never elsewhere.
    form["back"] = "https://evil.example/"
    _, headers, _ = await asyncio.to_thread(http, "POST", setup.inbox.url + "/vote", form, session)
    assert headers["Location"] == "/"

    async def history(query: dict[str, str], who: str = "bob") -> str:
        status, body = await get(
            setup, "/history?" + urllib.parse.urlencode(query), bearer(setup, who)
        )
        assert status == 200, body
        return body

    assert f'data-call-key="{KEY}"' in await history({})
    for hit in (
        {"tool": "up_wire"},
        {"decision": "denied"},
        {"approver": "BOB"},
        {"since": "2000-01-01", "until": "2999-01-01T00:00"},
    ):
        assert f'data-call-key="{KEY}"' in await history(hit), hit
    for miss in (
        {"tool": "echo"},
        {"decision": "granted"},
        {"approver": "zed"},
        {"since": "2999-01-01"},
        {"until": "2000-01-01"},
    ):
        assert KEY not in await history(miss), miss
    assert KEY not in await history({}, "gus")  # another tenant's approver
    status, _ = await get(setup, "/history?since=yesterday", bearer(setup, "bob"))
    assert status == 400

    # The history is the approvals bucket's (file storage): a restarted service has it.
    setup.service.stop()
    again = (
        await ServiceProc(setup.url, setup.data_dir, setup.logs / "approvals-again.log")
        .start()
        .ready()
    )
    setup.extra.append(again)
    body = await history({"decision": "denied"})
    assert f'data-call-key="{KEY}"' in body and "Payee unknown" in body


async def test_two_identical_pending_calls_are_marked_as_likely_duplicates(setup: Setup) -> None:
    for call_id, args in (
        ("call_twin", ARGS),
        ("call_other", {**ARGS, "claim": "something else"}),
    ):
        await publish_event(setup.url, approval_requested(call_id, args, tool="up_wire"))
        await until_stored(setup, f"acme.researcher.{call_id}", "bob")
    _, body = await get(setup, "/", bearer(setup, "bob"))
    cards = {part.split('"', 1)[0]: part for part in body.split('data-call-key="')[1:]}
    twin = "acme.researcher.call_twin"
    assert "Likely a duplicate" in cards[KEY] and f"href='/calls/{twin}'" in cards[KEY]
    assert "Likely a duplicate" in cards[twin] and f"href='/calls/{KEY}'" in cards[twin]
    assert "Likely a duplicate" not in cards["acme.researcher.call_other"]


class Sse:
    """A server-sent events client over a plain socket (what EventSource does)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.status = 0
        self.heartbeats = 0

    @classmethod
    async def open(cls, inbox: Inbox, headers: dict[str, str]) -> Sse:
        reader, writer = await asyncio.open_connection("127.0.0.1", inbox.port)
        headers = {"Host": f"127.0.0.1:{inbox.port}", **headers}
        lines = ["GET /events HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        sse = cls(reader, writer)
        sse.status = int((await reader.readline()).split()[1])
        while (await reader.readline()).strip():
            pass  # the response's headers
        return sse

    async def next(self, timeout: float = 15.0) -> tuple[str, Any]:
        """The next event (name, data); heartbeats are counted."""
        name, data = "", ""
        while True:
            line = (await asyncio.wait_for(self.reader.readline(), timeout)).decode()
            if not line:
                raise EOFError("the stream ended")
            line = line.rstrip("\r\n")
            if line.startswith(":"):
                self.heartbeats += 1
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = line[6:]
            elif not line and name:
                return name, json.loads(data)

    async def until(self, name: str, key: str) -> Any:
        while True:
            kind, data = await self.next()
            if kind == name and data.get("key") == key:
                return data

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


async def test_live_events_bring_new_calls_and_decisions_to_their_approvers_only(
    setup: Setup,
) -> None:
    session = await login(setup, "bob")
    bob = await Sse.open(setup.inbox, session)
    gus = await Sse.open(setup.inbox, bearer(setup, "gus"))
    assert bob.status == gus.status == 200
    first = await bob.until("card", KEY)
    assert "Wire money" in first["html"] and 'name=csrf value="' in first["html"]

    await publish_event(setup.url, approval_requested("call_live", ARGS, tool="up_wire"))
    live = "acme.researcher.call_live"
    card = await bob.until("card", live)
    assert f'data-call-key="{live}"' in card["html"] and "Likely a duplicate" in card["html"]
    async with await ApprovalsClient.connect(setup.url, token=setup.tokens["u-alice"]) as alice:
        outcome = await alice.vote(live, "deny", arguments_sha256=SHA, reason="a retry, drop it")
    assert outcome.accepted
    decided = await bob.until("decided", live)
    assert decided["status"] == "denied" and "a retry, drop it" in decided["html"]
    # A vote that does not decide changes the card; an expiry ends it.
    other = {**ARGS, "claim": "two people"}
    await publish_event(setup.url, approval_requested("call_two", other, n=2, tool="up_wire"))
    await publish_event(
        setup.url,
        approval_requested("call_soon", other, ttl=timedelta(seconds=3), tool="up_wire"),
    )
    two, soon = "acme.researcher.call_two", "acme.researcher.call_soon"
    assert "0 of 2" in (await bob.until("card", two))["html"]
    async with await ApprovalsClient.connect(setup.url, token=setup.tokens["bob"]) as client:
        outcome = await client.vote(
            two, "approve", arguments_sha256=arguments_sha256(other), reason="fine by me"
        )
    assert outcome.accepted and outcome.status == "pending"
    assert "1 of 2 (bob)" in (await bob.until("card", two))["html"]
    expired = await bob.until("decided", soon)
    assert expired["status"] == "expired" and "nobody decided" in expired["html"]
    # A held-open stream, quiet for 2.5 s between heartbeats, outlives the door's head
    # and idle timeouts (1 s here): the heartbeats keep coming.
    seen = bob.heartbeats
    while bob.heartbeats < seen + 2:
        await _one_line(bob)
    # gus (globex) got globex's call and nothing of acme's.
    kinds = []
    while True:
        try:
            kinds.append(await asyncio.wait_for(gus.next(), 1.0))
        except TimeoutError:
            break
    assert kinds and all(data["key"].startswith("globex.") for _, data in kinds), kinds
    # Logging out ends the stream.
    csrf = (await get(setup, "/", session))[1].split('name=csrf value="')[1].split('"')[0]
    await asyncio.to_thread(http, "POST", setup.inbox.url + "/logout", {"csrf": csrf}, session)
    while (await bob.next())[0] != "end":
        pass
    await bob.close()
    await gus.close()


async def _one_line(sse: Sse) -> None:
    line = await asyncio.wait_for(sse.reader.readline(), 5.0)
    if not line:
        raise EOFError("the stream ended")
    if line.startswith(b":"):
        sse.heartbeats += 1


async def test_live_streams_are_capped_per_approver_and_overall(setup: Setup) -> None:
    first = [await Sse.open(setup.inbox, bearer(setup, "bob")) for _ in range(2)]
    assert [s.status for s in first] == [200, 200]
    over = await Sse.open(setup.inbox, bearer(setup, "bob"))
    assert over.status == 429  # bob's own cap (2)
    gus = await Sse.open(setup.inbox, bearer(setup, "gus"))
    assert gus.status == 200
    alice = await Sse.open(setup.inbox, bearer(setup, "u-alice"))
    assert alice.status == 429  # the overall cap (3)
    # The pages still answer: the streams never take the whole door.
    status, _ = await get(setup, "/", bearer(setup, "bob"))
    assert status == 200
    # A stream closed frees its place.
    await first[0].close()
    for _ in range(100):
        again = await Sse.open(setup.inbox, bearer(setup, "u-alice"))
        if again.status == 200:
            break
        await again.close()
        await asyncio.sleep(0.1)
    assert again.status == 200
    for sse in (*first[1:], over, gus, alice, again):
        await sse.close()
    # No stream without a login, nor from another site's name (DNS rebinding).
    nobody = await Sse.open(setup.inbox, {})
    assert nobody.status == 401
    rebound = await Sse.open(setup.inbox, {**bearer(setup, "bob"), "Host": "evil.example"})
    assert rebound.status == 421
