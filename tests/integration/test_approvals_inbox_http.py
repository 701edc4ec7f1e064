"""The inbox over plain HTTP (the browser test is tests/system/test_approval_inbox.py):
security headers, Bearer tokens, the CSRF check, refusals shown to the approver,
only the approver's tenants' calls, and sessions that end with their token."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_approvals_support import (
    ServiceProc,
    approval_requested,
    approvers,
    prepare_bus,
    publish_event,
)
from tests.waiting import eventually, settled
from toolgate.contracts import subjects
from toolgate.contracts.authorization import arguments_sha256
from toolgate.contracts.calls import Principal
from toolgate.services.approvals.approvers import add_approver
from toolgate.services.approvals.inbox import Inbox
from toolgate.stack.nats_server import EmbeddedNats

ARGS = {"task_id": "task_c04", "claim": "<b>bold</b>", "source_url": "https://example.org"}
SHA = arguments_sha256(ARGS)
KEY = "acme.researcher.call_http"
GLOBEX = Principal(tenant="globex", user="u-gina", agent="researcher", session="s-7")
GLOBEX_ARGS = {"task_id": "task_g1", "claim": "globex-secret-claim", "source_url": "https://g"}


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


opener = urllib.request.build_opener(NoRedirect)


def http(
    method: str, url: str, form: dict[str, str] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], str]:
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, headers_of(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, headers_of(exc.headers), exc.read().decode()


def headers_of(message: Any) -> dict[str, str]:
    """Response headers by their canonical names (HTTP names are case-insensitive)."""
    return {"-".join(p.capitalize() for p in k.split("-")): v for k, v in message.items()}


@pytest.fixture
async def inbox(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[tuple[Inbox, dict]]:
    await prepare_bus(nats_server.url)
    data_dir = tmp_path / "data"
    tokens = approvers(data_dir, "bob", "u-alice")
    tokens["gus"] = add_approver(data_dir, "gus", ["globex"])
    service = (
        await ServiceProc(nats_server.url, data_dir, data_dir / "logs" / "approvals.log")
        .start()
        .ready()
    )
    await publish_event(nats_server.url, approval_requested("call_http", ARGS, n=2))
    # globex's call with the same call_id: none of acme's approvers may see it, and back.
    await publish_event(
        nats_server.url, approval_requested("call_http", GLOBEX_ARGS, principal=GLOBEX)
    )
    await eventually(
        lambda: settled(nats_server.url, subjects.EVENTS_STREAM, "approvals"),
        what="the service has stored both requests",
    )
    server = await asyncio.to_thread(Inbox(nats_server.url).start)
    yield server, tokens
    await asyncio.to_thread(server.stop)
    service.stop()


async def test_bearer_listing_and_voting(inbox: tuple[Inbox, dict]) -> None:
    server, tokens = inbox
    status, headers, body = await asyncio.to_thread(
        http, "GET", server.url + "/", None, {"Authorization": f"Bearer {tokens['bob']}"}
    )
    assert status == 200
    # Scripts only from the inbox's own files: nothing inline, nothing of another origin.
    assert "script-src 'self';" in headers["Content-Security-Policy"]
    assert "unsafe-inline" not in headers["Content-Security-Policy"].split("style-src")[0]
    assert "<script>" not in body and "<script src='/static/inbox.js' defer>" in body
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert headers["X-Frame-Options"] == "DENY"
    assert f'data-call-key="{KEY}"' in body and SHA in body
    assert "&lt;b&gt;bold&lt;/b&gt;" in body and "<b>bold" not in body
    assert "globex" not in body and "globex-secret-claim" not in body

    status, _, body = await asyncio.to_thread(
        http,
        "POST",
        server.url + "/vote",
        {"call": KEY, "decision": "approve", "arguments_sha256": "0" * 64, "reason": "ok"},
        {"Authorization": f"Bearer {tokens['bob']}"},
    )
    assert status == 409 and json.loads(body)["code"] == "ARGUMENTS_MISMATCH"
    status, _, body = await asyncio.to_thread(
        http,
        "POST",
        server.url + "/vote",
        {"call": KEY, "decision": "approve", "arguments_sha256": SHA, "reason": "ok"},
        {"Authorization": f"Bearer {tokens['u-alice']}"},
    )
    assert status == 409 and json.loads(body)["code"] == "SELF_APPROVAL"
    status, _, body = await asyncio.to_thread(
        http,
        "POST",
        server.url + "/vote",
        {"call": KEY, "decision": "approve", "arguments_sha256": SHA, "reason": "ok"},
        {"Authorization": f"Bearer {tokens['bob']}"},
    )
    assert status == 200 and json.loads(body)["approvers"] == ["bob"]
    assert json.loads(body)["call"] == KEY

    status, _, _ = await asyncio.to_thread(
        http, "GET", server.url + "/", None, {"Authorization": "Bearer tgap_wrong"}
    )
    assert status == 401


async def test_cookie_session_needs_the_form_csrf_token(inbox: tuple[Inbox, dict]) -> None:
    server, tokens = inbox
    status, headers, _ = await asyncio.to_thread(
        http, "POST", server.url + "/login", {"token": tokens["bob"]}
    )
    assert status == 303
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert tokens["bob"] not in cookie
    session = {"Cookie": cookie.split(";")[0]}
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert status == 200 and "call_http" in page
    assert page.count("<article") == 1  # bob sees acme's call, not globex's of the same id
    csrf = page.split('name=csrf value="')[1].split('"')[0]
    call = page.split('name=call value="')[1].split('"')[0]
    assert call == KEY
    form = {"call": call, "decision": "deny", "arguments_sha256": SHA, "reason": "no"}
    status, _, _ = await asyncio.to_thread(http, "POST", server.url + "/vote", form, session)
    assert status == 403  # no csrf: a forged cross-site form
    status, _, _ = await asyncio.to_thread(
        http, "POST", server.url + "/vote", {**form, "csrf": csrf}, session
    )
    assert status == 303
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert "denied: the call will not run" in page and "data-call-id" not in page


async def test_an_approver_of_another_tenant_sees_and_decides_nothing_of_acme(
    inbox: tuple[Inbox, dict],
) -> None:
    server, tokens = inbox
    gus = {"Authorization": f"Bearer {tokens['gus']}"}
    status, _, body = await asyncio.to_thread(http, "GET", server.url + "/", None, gus)
    assert status == 200 and 'data-call-key="globex.researcher.call_http"' in body
    assert KEY not in body and "bold" not in body and SHA not in body
    assert "(tenant globex)" in body
    for call in (KEY, "call_http"):  # the bare call_id finds globex's own call only
        status, _, answer = await asyncio.to_thread(
            http,
            "POST",
            server.url + "/vote",
            {"call": call, "decision": "deny", "arguments_sha256": SHA, "reason": "mine?"},
            gus,
        )
        assert status == 409
        assert json.loads(answer)["code"] == (
            "UNKNOWN_CALL" if call == KEY else "ARGUMENTS_MISMATCH"
        )
    status, _, body = await asyncio.to_thread(
        http, "GET", server.url + "/", None, {"Authorization": f"Bearer {tokens['bob']}"}
    )
    assert "0 of 2" in body  # acme's call untouched


async def test_a_session_ends_when_its_token_is_rotated(
    inbox: tuple[Inbox, dict], tmp_path: Path
) -> None:
    server, tokens = inbox
    status, headers, _ = await asyncio.to_thread(
        http, "POST", server.url + "/login", {"token": tokens["bob"]}
    )
    session = {"Cookie": headers["Set-Cookie"].split(";")[0]}
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert status == 200 and KEY in page
    add_approver(tmp_path / "data", "bob", ["acme"], rotate=True)
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert status == 401 and "no longer valid" in page and KEY not in page
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert status == 200 and "id=token" in page  # logged out: the login form


async def test_a_login_from_a_foreign_origin_is_refused(inbox: tuple[Inbox, dict]) -> None:
    """A cross-site form that posts a token (login CSRF) sets no cookie; nor a vote."""
    server, tokens = inbox
    own = server.url.replace("http://", "")
    for foreign in (
        {"Origin": "https://evil.example"},
        {"Origin": "null"},  # a sandboxed frame or a data: page
        {"Origin": f"http://{own}.evil.example"},
        {"Referer": "https://evil.example/login.html"},
    ):
        status, headers, _ = await asyncio.to_thread(
            http, "POST", server.url + "/login", {"token": tokens["bob"]}, foreign
        )
        assert status == 403, foreign
        assert "Set-Cookie" not in headers
        status, _, _ = await asyncio.to_thread(
            http,
            "POST",
            server.url + "/vote",
            {"call": KEY, "decision": "deny", "arguments_sha256": SHA, "reason": "x"},
            {**foreign, "Authorization": f"Bearer {tokens['bob']}"},
        )
        assert status == 403, foreign
    # The inbox's own pages (and clients that are no browser) still log in.
    for same in ({"Origin": server.url}, {"Referer": server.url + "/"}, {}):
        status, headers, _ = await asyncio.to_thread(
            http, "POST", server.url + "/login", {"token": tokens["bob"]}, same
        )
        assert status == 303 and "Set-Cookie" in headers, same


async def test_a_request_for_another_host_is_refused(inbox: tuple[Inbox, dict]) -> None:
    """DNS rebinding: evil.example resolves to the inbox, the Host header still says evil."""
    server, tokens = inbox
    bob = {"Authorization": f"Bearer {tokens['bob']}"}
    for host in ("evil.example", f"evil.example:{server.port}", "127.0.0.1.evil.example"):
        status, _, body = await asyncio.to_thread(
            http, "GET", server.url + "/", None, {**bob, "Host": host}
        )
        assert status == 421 and KEY not in body, host
        status, headers, _ = await asyncio.to_thread(
            http,
            "POST",
            server.url + "/login",
            {"token": tokens["bob"]},
            {"Host": host, "Origin": f"http://{host}"},
        )
        assert status == 421 and "Set-Cookie" not in headers, host
    for host in (f"localhost:{server.port}", f"127.0.0.1:{server.port}"):
        status, _, body = await asyncio.to_thread(
            http, "GET", server.url + "/", None, {**bob, "Host": host}
        )
        assert status == 200 and KEY in body, host


def test_hosts_and_origins_an_operator_allows() -> None:
    from toolgate.services.approvals.inbox import Origins

    behind = Origins(
        "0.0.0.0", ("inbox.example.com", "alt.example:8443"), ("https://approve.example.com",)
    )
    assert behind.host_ok("inbox.example.com") and behind.host_ok("inbox.example.com:443")
    assert behind.host_ok("alt.example:8443") and not behind.host_ok("alt.example:9")
    assert not behind.host_ok("0.0.0.0:8090") and not behind.host_ok("evil.example")
    assert not behind.host_ok("") and not behind.host_ok(None)
    assert not behind.host_ok("user@127.0.0.1") and not behind.host_ok("127.0.0.1:x")
    assert behind.origin_ok("https://approve.example.com", None, "10.0.0.5:8090")
    assert behind.origin_ok("https://inbox.example.com", None, "inbox.example.com")
    assert not behind.origin_ok("https://evil.example", None, "inbox.example.com")
    assert Origins("10.0.0.5").host_ok("10.0.0.5:8090")
