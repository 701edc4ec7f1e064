"""The inbox over plain HTTP (the browser test is tests/system/test_approval_inbox.py):
security headers, Bearer tokens, the CSRF check, refusals shown to the approver."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.test_approvals_support import (
    ServiceProc,
    approval_requested,
    approvers,
    prepare_bus,
    publish_event,
)
from toolgate.contracts.authorization import arguments_sha256
from toolgate.services.approvals.inbox import Inbox
from toolgate.services.stack.nats_server import EmbeddedNats

ARGS = {"task_id": "task_c04", "claim": "<b>bold</b>", "source_url": "https://example.org"}
SHA = arguments_sha256(ARGS)


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return None


opener = urllib.request.build_opener(NoRedirect)


def http(method: str, url: str, form: dict[str, str] | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], str]:
    data = urllib.parse.urlencode(form).encode() if form is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        request.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with opener.open(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()


@pytest.fixture
async def inbox(nats_server: EmbeddedNats, tmp_path: Path) -> AsyncIterator[tuple[Inbox, dict]]:
    await prepare_bus(nats_server.url)
    data_dir = tmp_path / "data"
    tokens = approvers(data_dir, "bob", "u-alice")
    service = await ServiceProc(nats_server.url, data_dir,
                                data_dir / "logs" / "approvals.log").start().ready()
    await publish_event(nats_server.url, approval_requested("call_http", ARGS, n=2))
    await asyncio.sleep(0.5)
    server = await asyncio.to_thread(Inbox(nats_server.url, data_dir).start)
    yield server, tokens
    await asyncio.to_thread(server.stop)
    service.stop()


async def test_bearer_listing_and_voting(inbox: tuple[Inbox, dict]) -> None:
    server, tokens = inbox
    status, headers, body = await asyncio.to_thread(
        http, "GET", server.url + "/", None, {"Authorization": f"Bearer {tokens['bob']}"})
    assert status == 200
    assert "script-src" not in headers["Content-Security-Policy"]
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    assert headers["X-Frame-Options"] == "DENY"
    assert "call_http" in body and SHA in body
    assert "&lt;b&gt;bold&lt;/b&gt;" in body and "<b>bold" not in body

    status, _, body = await asyncio.to_thread(
        http, "POST", server.url + "/vote",
        {"call_id": "call_http", "decision": "approve", "arguments_sha256": "0" * 64,
         "reason": "ok"}, {"Authorization": f"Bearer {tokens['bob']}"})
    assert status == 409 and json.loads(body)["code"] == "ARGUMENTS_MISMATCH"
    status, _, body = await asyncio.to_thread(
        http, "POST", server.url + "/vote",
        {"call_id": "call_http", "decision": "approve", "arguments_sha256": SHA,
         "reason": "ok"}, {"Authorization": f"Bearer {tokens['u-alice']}"})
    assert status == 409 and json.loads(body)["code"] == "SELF_APPROVAL"
    status, _, body = await asyncio.to_thread(
        http, "POST", server.url + "/vote",
        {"call_id": "call_http", "decision": "approve", "arguments_sha256": SHA,
         "reason": "ok"}, {"Authorization": f"Bearer {tokens['bob']}"})
    assert status == 200 and json.loads(body)["approvers"] == ["bob"]

    status, _, _ = await asyncio.to_thread(
        http, "GET", server.url + "/", None, {"Authorization": "Bearer tgap_wrong"})
    assert status == 401


async def test_cookie_session_needs_the_form_csrf_token(inbox: tuple[Inbox, dict]) -> None:
    server, tokens = inbox
    status, headers, _ = await asyncio.to_thread(
        http, "POST", server.url + "/login", {"token": tokens["bob"]})
    assert status == 303
    cookie = headers["Set-Cookie"]
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    assert tokens["bob"] not in cookie
    session = {"Cookie": cookie.split(";")[0]}
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert status == 200 and "call_http" in page
    form = {"call_id": "call_http", "decision": "deny", "arguments_sha256": SHA,
            "reason": "no"}
    status, _, _ = await asyncio.to_thread(http, "POST", server.url + "/vote", form, session)
    assert status == 403  # no csrf: a forged cross-site form
    csrf = page.split('name=csrf value="')[1].split('"')[0]
    status, _, _ = await asyncio.to_thread(
        http, "POST", server.url + "/vote", {**form, "csrf": csrf}, session)
    assert status == 303
    status, _, page = await asyncio.to_thread(http, "GET", server.url + "/", None, session)
    assert "denied: the call will not run" in page and "data-call-id" not in page
