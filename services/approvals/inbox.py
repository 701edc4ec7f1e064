"""The web inbox: approvers see pending calls and approve or deny them.

A small server-rendered site on uvicorn (a dependency of the MCP SDK), as a bare
ASGI app: one asyncio loop serves every connection and the NATS client, not a
thread per connection, and runtime/http_server.py bounds slow clients (a request
head within 10 s, idle keep-alive 5 s, at most 128 connections: INBOX_LIMITS).

An approver logs in with their token (form POST; the server keeps the session
and gives the browser only a random, HttpOnly, SameSite=Strict cookie) or sends
`Authorization: Bearer <token>` on each request. The inbox holds no approver
list and reads no bucket: it is a client of the approvals service like the CLI
(NATS as the approver role), and the service authenticates the token on every
request and answers with the calls of that approver's tenants only. A token
rotated or removed ends the session at its next request.

Arguments come from a model: every value is HTML-escaped and invisible
characters are made visible; a Content-Security-Policy that allows no script
at all backs that up. Forms carry a per-session CSRF token.

Every request must name the inbox in its `Host` header (a loopback name, the
`--host` it listens on, or an `--allow-host`): anything else is 421, so a
DNS-rebinding page cannot talk to it. Every POST, the login included, must come
from the inbox's own origin (or an `--allow-origin`): a foreign `Origin` (or,
without one, a foreign `Referer`) is 403. A client that sends neither is not a
browser and is judged by its token alone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from html import escape
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlsplit

import msgspec

from toolgate.contracts.events import utc_now
from toolgate.runtime.http_server import SlowClientLimits, uvicorn_config
from toolgate.services.approvals.client import ApprovalsClient, Refused, ServiceUnavailable
from toolgate.services.approvals.logic import (
    MAX_REASON_CHARS,
    Approver,
    Refusal,
    same_person,
)
from toolgate.services.approvals.protocol import ApprovalView, ListReply
from toolgate.services.approvals.render import pretty_arguments, time_left, visible, votes_line

log = logging.getLogger("toolgate.approvals.inbox")

COOKIE = "toolgate_inbox"
SESSION_IDLE_S = 8 * 3600.0
MAX_FORM_BYTES = 16 * 1024
# Approvers are people: a browser opens up to 6 connections each, so 128 serves some twenty
# at once and keeps a slow-client flood to 128 sockets (each closed after 10 s).
INBOX_LIMITS = SlowClientLimits(max_connections=128)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it a browser sends `Origin: null` with the inbox's own
    # forms, and the origin check could not tell them from a sandboxed foreign page.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

STYLE = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:60rem;padding:0 1rem;color:#222}
header{display:flex;justify-content:space-between;align-items:center}
article{border:1px solid #ccc;border-radius:6px;padding:1rem;margin:1rem 0}
pre{background:#f6f6f6;padding:.75rem;overflow:auto;white-space:pre-wrap;word-break:break-all}
dl{display:grid;grid-template-columns:10rem 1fr;gap:.25rem .75rem}dt{color:#666}dd{margin:0}
.risk{padding:.1rem .5rem;border-radius:4px;background:#eee;font-size:.9rem}
.risk-high,.risk-critical{background:#fdd}
.flash{padding:.75rem;border-radius:6px;background:#eef}.flash.refused{background:#fee}
textarea{width:100%;min-height:3rem}code{word-break:break-all}
"""


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
ANY_INTERFACE = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class Origins:
    """Which `Host` headers the inbox answers and which origins may post to it."""

    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()  # "name" (any port) or "name:port"
    allowed_origins: tuple[str, ...] = ()  # e.g. "https://inbox.example.com"

    def host_ok(self, host: str | None) -> bool:
        """Whether a request's Host header names this inbox (DNS rebinding names another)."""
        host = (host or "").strip().lower()
        name = _host_name(host)
        if name is None:
            return False
        names = {*LOOPBACK_NAMES}
        if self.bind_host.lower() not in ANY_INTERFACE:
            names.add(self.bind_host.lower().strip("[]"))
        for allowed in (a.strip().lower() for a in self.allowed_hosts):
            if allowed == host:  # "name:port"
                return True
            if ":" not in allowed.rsplit("]", 1)[-1]:  # "name": any port
                names.add(allowed.strip("[]"))
        return name in names

    def origin_ok(self, origin: str | None, referer: str | None, host: str | None) -> bool:
        """Whether a state-changing request comes from the inbox's own pages: its Origin
        (else its Referer) is the inbox itself or an allowed origin. A request with
        neither is not from a browser, so no foreign page can have sent it."""
        host = (host or "").strip().lower()
        if origin is not None:
            origin = origin.strip().lower().rstrip("/")
            if origin in (o.strip().lower().rstrip("/") for o in self.allowed_origins):
                return True
            return _same_origin(origin, host)
        if referer is not None:
            return _same_origin(referer.strip().lower(), host)
        return True


def _host_name(host: str) -> str | None:
    """The name part of a Host header (no port, no brackets); None if it is not one."""
    try:
        parts = urlsplit(f"//{host}")
        parts.port  # noqa: B018 (raises on a port that is not one)
    except ValueError:
        return None
    if not host or "@" in host or not parts.hostname or parts.netloc != host:
        return None
    return parts.hostname


def _same_origin(url: str, host: str) -> bool:
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(host) and parts.netloc == host


def h(value: object) -> str:
    """HTML-escape anything shown; invisible characters made visible first."""
    return escape(visible(str(value)), quote=True)


@dataclass
class Session:
    approver: Approver
    token: str
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    flash: tuple[str, bool] | None = None  # (message, refused)
    seen: float = field(default_factory=time.monotonic)


class Inbox:
    """The inbox server: HTTP (uvicorn) and NATS in one asyncio loop, on a thread of its own."""

    def __init__(
        self,
        nats_url: str,
        host: str = "127.0.0.1",
        port: int = 0,
        connect_options: dict[str, Any] | None = None,
        allowed_hosts: tuple[str, ...] = (),
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.nats_url = nats_url
        self.host = host
        self.port = port
        self.origins = Origins(host, allowed_hosts, allowed_origins)
        self.connect_options = connect_options or {}
        self.sessions: dict[str, Session] = {}
        self._sessions_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="inbox-loop"
        )
        self._client: ApprovalsClient | None = None
        self._server: Any = None  # uvicorn.Server
        self._serving: Any = None  # concurrent.futures.Future of its serve()

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Inbox:
        self._loop_thread.start()
        self._client = self.run(ApprovalsClient.connect(self.nats_url, **self.connect_options))
        import uvicorn

        # Bound here, not by uvicorn (which exits the process on a bind error): the CLI
        # turns an OSError into its one-line "cannot listen" message.
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.create_server((self.host, self.port), family=family, backlog=128)
        self.port = int(sock.getsockname()[1])
        config = uvicorn_config(
            self.asgi,
            self.host,
            self.port,
            INBOX_LIMITS,
            interface="asgi3",
            lifespan="off",
            proxy_headers=False,
            log_config=None,
            access_log=False,
            server_header=False,
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._serving = asyncio.run_coroutine_threadsafe(
            self._server.serve(sockets=[sock]), self._loop
        )
        while not self._server.started:
            if self._serving.done():
                self._serving.result()  # raises why it did not start
                raise RuntimeError("the inbox's HTTP server did not start")
            time.sleep(0.01)
        log.info("approvals inbox on %s", self.url)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            try:
                self._serving.result(10)
            except Exception:  # stopping on the way out: nothing to save
                pass
        if self._client is not None:
            try:
                self.run(self._client.close(), timeout=5)
            except Exception:  # closing on the way out: nothing to save
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(5)

    async def asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await asgi_app(self, scope, receive, send)

    def run(self, coroutine: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the inbox's loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    @property
    def client(self) -> ApprovalsClient:
        assert self._client is not None
        return self._client

    # ------------------------------------------------------------ sessions

    async def authenticate(self, token: str) -> Approver | None:
        """Ask the approvals service whose token this is (ServiceUnavailable if none answers)."""
        token = token.strip()
        if not token:
            return None
        identity = await self.client.whoami(token)
        return identity.approver() if identity is not None else None

    async def login(self, token: str) -> tuple[str, Session] | None:
        approver = await self.authenticate(token)
        if approver is None:
            return None
        sid = secrets.token_urlsafe(32)
        session = Session(approver=approver, token=token.strip())
        with self._sessions_lock:
            self.sessions[sid] = session
        return sid, session

    def session(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        with self._sessions_lock:
            session = self.sessions.get(sid)
            if session is None:
                return None
            if time.monotonic() - session.seen > SESSION_IDLE_S:
                del self.sessions[sid]
                return None
            session.seen = time.monotonic()
            return session

    def logout(self, sid: str | None) -> None:
        with self._sessions_lock:
            self.sessions.pop(sid or "", None)

    def forget_token(self, token: str) -> None:
        """The service no longer knows this token: end every session that holds it."""
        with self._sessions_lock:
            gone = [
                sid
                for sid, session in self.sessions.items()
                if hmac.compare_digest(session.token.encode(), token.encode())
            ]
            for sid in gone:
                del self.sessions[sid]

    # ------------------------------------------------------------ pages

    async def pending_for(self, token: str) -> ListReply | None:
        """What the service lets this token see now; None if the token is no longer valid."""
        try:
            reply: ListReply = await self.client.list_pending(token)
        except Refused as exc:
            if exc.code == Refusal.INVALID_TOKEN:
                self.forget_token(token)
                return None
            raise
        return reply


def page(title: str, body: str) -> bytes:
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>{h(title)}</title><style>{STYLE}</style></head>"
        f"<body>{body}</body></html>"
    ).encode()


def login_page(message: str = "") -> bytes:
    note = f"<p class='flash refused' id=flash>{h(message)}</p>" if message else ""
    return page(
        "toolgate approvals: log in",
        f"""
<h1>toolgate approvals</h1>{note}
<form method=post action=/login>
<label for=token>Approver token</label>
<input id=token name=token type=password autocomplete=off required size=60>
<button id=login type=submit>Log in</button>
</form>""",
    )


def call_html(state: ApprovalView, approver: Approver, csrf: str) -> str:
    p = state.call.principal
    now = utc_now()
    own = same_person(approver.name, state.requester)
    voted = next((v for v in state.votes if same_person(v.approver, approver.name)), None)
    rows = [
        ("call", f"<code class=key>{h(state.key)}</code>"),
        (
            "requester",
            f"{h(state.requester)} <small>(tenant {h(p.tenant)}, agent {h(p.agent)}, "
            f"session {h(p.session)}"
            + (f", task {h(state.call.task_id)}" if state.call.task_id else "")
            + ")</small>",
        ),
        (
            "policy",
            h(state.policy_version)
            + (f" <small>({h(', '.join(state.policy_ids))})</small>" if state.policy_ids else ""),
        ),
    ]
    if state.request_reason:
        rows.append(("why", h(state.request_reason)))
    rows += [
        (
            "expires",
            f"<time datetime='{h(state.expires_at.isoformat())}'>"
            f"{h(state.expires_at.isoformat())}</time> "
            f"({h(time_left(state.expires_at, now))})",
        ),
        ("approvals", f"<span class=votes>{h(votes_line(state))}</span>"),
        ("arguments sha256", f"<code class=sha>{h(state.arguments_sha256)}</code>"),
    ]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    if voted is not None:
        action = f"<p class=voted>You voted {h(voted.decision)}: {h(voted.reason)}</p>"
    else:
        approve = (
            "<p class=own>You made this call: another approver must approve it.</p>"
            if own
            else "<button type=submit name=decision value=approve class=approve>Approve</button> "
        )
        action = f"""
<form method=post action=/vote class=vote>
<input type=hidden name=csrf value="{h(csrf)}">
<input type=hidden name=call value="{h(state.key)}">
<input type=hidden name=arguments_sha256 value="{h(state.arguments_sha256)}">
<label>Reason <textarea name=reason required maxlength={MAX_REASON_CHARS}></textarea></label>
{approve}<button type=submit name=decision value=deny class=deny>Deny</button>
</form>"""
    return f"""
<article class=call id="call-{h(state.key)}" data-call-key="{h(state.key)}"
 data-call-id="{h(state.call_id)}">
<h2><span class=tool>{h(state.call.tool)}</span>
<span class="risk risk-{h(state.risk)}">{h(state.risk)}</span></h2>
<dl>{dl}</dl>
<h3>Arguments</h3>
<pre class=arguments>{escape(pretty_arguments(state.call.arguments), quote=True)}</pre>
{action}
</article>"""


def inbox_page(
    approver: Approver,
    session_csrf: str,
    states: list[ApprovalView],
    flash: tuple[str, bool] | None,
    omitted: int = 0,
) -> bytes:
    note = ""
    if flash:
        message, refused = flash
        note = f"<p class='flash{' refused' if refused else ''}' id=flash>{h(message)}</p>"
    calls = "".join(call_html(s, approver, session_csrf) for s in states)
    if not calls:
        calls = "<p id=empty>No calls are waiting for approval.</p>"
    if omitted:
        calls += (
            f"<p id=omitted>{omitted} more calls are waiting: decide these first, "
            "or use <code>toolgate approvals list</code>.</p>"
        )
    scope = "every tenant" if approver.all_tenants else "tenant " + ", ".join(approver.tenants)
    return page(
        "toolgate approvals",
        f"""
<header><h1>Pending approvals</h1>
<form method=post action=/logout><input type=hidden name=csrf value="{h(session_csrf)}">
<span id=who>{h(approver.name)}</span> <small id=scope>({h(scope)})</small>
<button type=submit>Log out</button></form></header>
{note}
<p><a href="/">Refresh</a></p>
{calls}""",
    )


class _Headers:
    """A request's headers by case-insensitive name (the first of a repeated one)."""

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self._values: dict[str, str] = {}
        for name, value in raw:
            self._values.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))

    def get(self, name: str, default: Any = None) -> Any:
        return self._values.get(name.lower(), default)


async def _read_body(receive: Any, limit: int) -> bytes:
    """A request's body, read no further than one byte past `limit` (then refused)."""
    body = b""
    while len(body) <= limit:
        message = await receive()
        if message["type"] != "http.request":
            break
        body += message.get("body", b"")
        if not message.get("more_body", False):
            break
    return body


async def asgi_app(owner: Inbox, scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    handler = _Handler(owner, scope)
    if handler.command == "POST":
        handler.body = await _read_body(receive, MAX_FORM_BYTES)
    await handler.handle()
    status, headers, body = handler.response
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


class _Handler:
    """One request: the routes, as thin as they were on http.server."""

    def __init__(self, owner: Inbox, scope: dict[str, Any]) -> None:
        self.owner = owner
        self.command: str = scope["method"]
        target = scope.get("raw_path") or scope["path"].encode()
        query = scope.get("query_string") or b""
        self.path = (target + (b"?" + query if query else b"")).decode("latin-1")
        self.headers = _Headers(scope["headers"])
        self.body = b""
        self.response: tuple[int, list[tuple[str, str]], bytes] = (500, [], b"")

    async def handle(self) -> None:
        if self.command in ("GET", "HEAD"):
            await self.do_GET()
        elif self.command == "POST":
            await self.do_POST()
        else:
            self._send(501, page("not implemented", "<p>Unsupported method.</p>"))

    # -------------------------------------------------------- plumbing

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str = "text/html; charset=utf-8",
        headers: dict[str, str] | None = None,
    ) -> None:
        values = {**SECURITY_HEADERS, **(headers or {})}
        values["Server"] = "toolgate-inbox"
        values["Content-Type"] = content_type
        values["Content-Length"] = str(len(body))
        self.response = (status, list(values.items()), b"" if self.command == "HEAD" else body)

    def _redirect(self, location: str, headers: dict[str, str] | None = None) -> None:
        self._send(303, b"", headers={"Location": location, **(headers or {})})

    def _json(self, status: int, value: Any) -> None:
        self._send(status, json.dumps(value).encode(), "application/json")

    def _sid(self) -> str | None:
        raw = self.headers.get("Cookie")
        if not raw:
            return None
        try:
            cookie = SimpleCookie(raw)
        except CookieError:
            return None
        morsel = cookie.get(COOKIE)
        return morsel.value if morsel else None

    def _bearer(self) -> str | None:
        value = self.headers.get("Authorization", "")
        if value.lower().startswith("bearer "):
            return value[7:].strip()
        return None

    def _form(self) -> dict[str, str] | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if length < 0 or length > MAX_FORM_BYTES:
            return None
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != "application/x-www-form-urlencoded":
            return None
        if len(self.body) < length:  # the client closed before sending all it announced
            return None
        data = self.body[:length].decode("utf-8", "replace")
        return {k: v[0] for k, v in parse_qs(data, keep_blank_values=True).items()}

    async def _identity(self) -> tuple[Approver, str, Session | None] | None:
        """(approver, token, session): a Bearer token, else the session cookie."""
        bearer = self._bearer()
        if bearer is not None:
            approver = await self.owner.authenticate(bearer)
            return (approver, bearer, None) if approver else None
        session = self.owner.session(self._sid())
        if session is None:
            return None
        return session.approver, session.token, session

    def _misdirected(self) -> bool:
        """Refuse (421) a request whose Host names another site: a DNS-rebinding page."""
        if self.owner.origins.host_ok(self.headers.get("Host")):
            return False
        log.warning("refused a request for host %r", self.headers.get("Host"))
        self._send(421, page("misdirected", "<p>This is not the host you asked for.</p>"))
        return True

    def _foreign(self) -> bool:
        """Refuse (403) a POST that a page of another origin made the browser send."""
        origin, referer = self.headers.get("Origin"), self.headers.get("Referer")
        if self.owner.origins.origin_ok(origin, referer, self.headers.get("Host")):
            return False
        log.warning("refused a POST from origin %r (referer %r)", origin, referer)
        self._send(403, page("forbidden", "<p>Cross-site request refused.</p>"))
        return True

    # -------------------------------------------------------- routes

    async def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/healthz":  # probes name the pod's address: no Host check, no data
            self._send(200, b"ok", "text/plain")
            return
        if self._misdirected():
            return
        if path != "/":
            self._send(404, page("not found", "<p>Not found.</p>"))
            return
        try:
            identity = await self._identity()
            if identity is None:
                if self._bearer() is not None:
                    self._send(401, login_page("unknown or invalid token"))
                else:
                    self._send(200, login_page())
                return
            approver, token, session = identity
            reply = await self.owner.pending_for(token)
        except Exception as exc:
            log.warning("listing pending approvals failed: %r", exc)
            self._send(
                503,
                page("unavailable", "<p>The approvals service is unavailable; retry shortly.</p>"),
            )
            return
        if reply is None:  # the token was rotated or removed meanwhile
            self._send(401, login_page("your token is no longer valid: log in again"))
            return
        if reply.approver is not None:
            approver = reply.approver.approver()
        flash = None
        csrf = ""
        if session is not None:
            flash, session.flash = session.flash, None
            csrf = session.csrf
        self._send(200, inbox_page(approver, csrf, list(reply.calls), flash, reply.omitted))

    async def do_POST(self) -> None:
        if self._misdirected() or self._foreign():
            return
        path = self.path.split("?", 1)[0]
        form = self._form()
        if form is None:
            self._send(400, page("bad request", "<p>Bad request.</p>"))
            return
        if path == "/login":
            try:
                found = await self.owner.login(form.get("token", ""))
            except Exception as exc:
                log.warning("login failed: %r", exc)
                self._send(503, login_page("the approvals service is unavailable; retry shortly"))
                return
            if found is None:
                self._send(401, login_page("unknown or invalid token"))
                return
            sid, _ = found
            self._redirect(
                "/", {"Set-Cookie": f"{COOKIE}={sid}; HttpOnly; SameSite=Strict; Path=/"}
            )
            return
        try:
            identity = await self._identity()
        except Exception as exc:
            log.warning("authenticating a request failed: %r", exc)
            self._send(
                503,
                page("unavailable", "<p>The approvals service is unavailable; retry shortly.</p>"),
            )
            return
        if identity is None:
            self._send(401, login_page("log in first"))
            return
        _, token, session = identity
        if session is not None and not hmac.compare_digest(form.get("csrf", ""), session.csrf):
            self._send(403, page("forbidden", "<p>Stale or forged form: reload the page.</p>"))
            return
        if path == "/logout":
            self.owner.logout(self._sid())
            self._redirect(
                "/", {"Set-Cookie": f"{COOKIE}=; Max-Age=0; HttpOnly; SameSite=Strict; Path=/"}
            )
            return
        if path != "/vote":
            self._send(404, page("not found", "<p>Not found.</p>"))
            return
        decision = form.get("decision", "")
        if decision not in ("approve", "deny"):
            self._send(400, page("bad request", "<p>Choose approve or deny.</p>"))
            return
        call = form.get("call", "")
        try:
            outcome = await self.owner.client.vote(
                call,
                decision,  # type: ignore[arg-type]
                arguments_sha256=form.get("arguments_sha256", ""),
                reason=form.get("reason", ""),
                token=token,
            )
        except ServiceUnavailable as exc:
            message, refused = str(exc), True
            outcome = None
        else:
            assert outcome is not None  # the try's answer (mypy keeps the except's None)
            if outcome.code == Refusal.INVALID_TOKEN:
                self.owner.forget_token(token)
            shown = outcome.call or call
            message = (
                f"{shown}: {outcome.message}"
                if outcome.accepted
                else f"{shown}: refused ({outcome.code}): {outcome.message}"
            )
            refused = not outcome.accepted
        if session is None:  # an API client with a Bearer token
            self._json(
                200 if outcome and outcome.accepted else 409,
                msgspec.to_builtins(outcome) if outcome else {"error": message},
            )
            return
        session.flash = (message, refused)
        self._redirect("/")


def serve_inbox(
    nats_url: str,
    host: str,
    port: int,
    connect_options: dict[str, Any] | None = None,
    allowed_hosts: tuple[str, ...] = (),
    allowed_origins: tuple[str, ...] = (),
) -> int:
    """Run the inbox until interrupted (the `toolgate approvals inbox` command)."""
    inbox = Inbox(
        nats_url,
        host=host,
        port=port,
        connect_options=connect_options,
        allowed_hosts=allowed_hosts,
        allowed_origins=allowed_origins,
    ).start()
    print(f"approvals inbox: {inbox.url}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        inbox.stop()
    return 0
