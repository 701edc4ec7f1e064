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
import hashlib
import hmac
import json
import logging
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

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
from toolgate.services.approvals.protocol import (
    ApprovalView,
    HistoryReply,
    ListReply,
    parse_call_ref,
)
from toolgate.services.approvals.render import (
    duplicates,
    pretty_arguments,
    time_left,
    utc_text,
    visible,
    votes_line,
)
from toolgate.services.approvals.store import RETENTION_S

log = logging.getLogger("toolgate.approvals.inbox")

COOKIE = "toolgate_inbox"
SESSION_IDLE_S = 8 * 3600.0
MAX_FORM_BYTES = 16 * 1024
# Approvers are people: a browser opens up to 6 connections each, so 128 serves some twenty
# at once and keeps a slow-client flood to 128 sockets (each closed after 10 s).
INBOX_LIMITS = SlowClientLimits(max_connections=128)
SECURITY_HEADERS = {
    # Scripts only from the inbox's own files (no inline script, no eval); the live
    # updates' EventSource connects to the inbox only.
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; connect-src 'self'; "
    "style-src 'unsafe-inline'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    # Not no-referrer: under it a browser sends `Origin: null` with the inbox's own
    # forms, and the origin check could not tell them from a sandboxed foreign page.
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}

STYLE = """
*{box-sizing:border-box}
body{font-family:system-ui,sans-serif;margin:1rem auto;max-width:60rem;padding:0 .75rem;color:#222;
overflow-wrap:anywhere}
header{display:flex;flex-wrap:wrap;justify-content:space-between;align-items:center;gap:.5rem}
h1{font-size:1.5rem;margin:.5rem 0}h2{font-size:1.2rem;display:flex;flex-wrap:wrap;gap:.5rem}
nav{display:flex;flex-wrap:wrap;gap:1rem;align-items:baseline}
article{border:1px solid #ccc;border-radius:6px;padding:.75rem;margin:1rem 0;min-width:0}
article.fresh{border-color:#68c}article.duplicate-card{border-style:dashed}
pre{background:#f6f6f6;padding:.75rem;max-width:100%;max-height:24rem;overflow:auto;
white-space:pre-wrap;overflow-wrap:anywhere;word-break:break-all}
dl{display:grid;grid-template-columns:minmax(5rem,10rem) minmax(0,1fr);gap:.25rem .75rem}
dt{color:#666}dd{margin:0;min-width:0}
@media (max-width:40rem){dl{grid-template-columns:minmax(0,1fr)}dt{margin-top:.4rem}}
.risk,.status{padding:.1rem .5rem;border-radius:4px;background:#eee;font-size:.9rem}
.risk-high,.risk-critical,.status-denied .status{background:#fdd}
.status-granted .status{background:#dfd}
.flash{padding:.75rem;border-radius:6px;background:#eef}.flash.refused{background:#fee}
.duplicate{padding:.5rem;border-radius:6px;background:#ffd}
input,select,textarea,button{max-width:100%;font:inherit}
textarea{width:100%;min-height:3rem}code{word-break:break-all}
.filters{display:flex;flex-wrap:wrap;gap:.5rem;align-items:end}
.filters label{display:flex;flex-direction:column}
time+.local{color:#555}
"""

# The small script of every page (served from the inbox itself: the CSP allows no inline
# script): live updates over server-sent events, and times in the approver's own zone.
SCRIPT_PATH = "/static/inbox.js"
SCRIPT = rb"""(function () {
  "use strict";
  function two(n) { return (n < 10 ? "0" : "") + n; }
  function localize(root) {
    var zone = Intl.DateTimeFormat().resolvedOptions().timeZone || "local time";
    root.querySelectorAll("time[datetime]").forEach(function (t) {
      if (t.dataset.localized) { return; }
      var d = new Date(t.getAttribute("datetime"));
      if (isNaN(d.getTime())) { return; }
      var s = document.createElement("span");
      s.className = "local";
      s.textContent = " (" + d.getFullYear() + "-" + two(d.getMonth() + 1) + "-" +
        two(d.getDate()) + " " + two(d.getHours()) + ":" + two(d.getMinutes()) + ":" +
        two(d.getSeconds()) + " " + zone + ")";
      t.after(s);
      t.dataset.localized = "1";
    });
  }
  function place(data, insert) {
    var template = document.createElement("template");
    template.innerHTML = data.html;
    var fresh = template.content.firstElementChild;
    if (!fresh) { return; }
    var old = document.getElementById("call-" + data.key);
    if (old && old.dataset.mark === data.mark) { return; }
    if (old) {
      var typed = old.querySelector("textarea[name=reason]");
      var now = fresh.querySelector("textarea[name=reason]");
      if (typed && now) { now.value = typed.value; }
      old.replaceWith(fresh);
    } else if (insert) {
      var empty = document.getElementById("empty");
      if (empty) { empty.remove(); }
      document.getElementById("calls").appendChild(fresh);
    } else {
      return;
    }
    fresh.classList.add("fresh");
    localize(fresh);
  }
  function start() {
    localize(document);
    var live = document.body.dataset.live;
    var shown = document.getElementById("live");
    if (!live || !window.EventSource || !shown) { return; }
    var source = new EventSource("/events");
    source.addEventListener("open", function () { shown.textContent = "live"; });
    source.addEventListener("error", function () {
      shown.textContent = source.readyState === 2 ? "not live: reload" : "reconnecting";
    });
    source.addEventListener("card", function (e) { place(JSON.parse(e.data), live === "list"); });
    source.addEventListener("decided", function (e) { place(JSON.parse(e.data), false); });
    source.addEventListener("end", function () {
      source.close();
      shown.textContent = "session ended: reload";
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
"""
CALLS_PATH = "/calls/"
RETENTION_DAYS = int(RETENTION_S // 86400)

# Live updates: each stream asks the approvals service for the approver's calls every
# LIVE_POLL_S (with the approver's token: the service's own answer, so the stream sees
# what the page sees and nothing of another tenant). Streams are held open, so they are
# capped well below the connection cap (they never take the whole door) and per approver
# (one person's tabs cannot take them all); a stream ends after LIVE_STREAM_S and the
# browser reconnects, which checks the session again.
LIVE_POLL_S = 2.0
LIVE_HEARTBEAT_S = 15.0
LIVE_STREAM_S = 600.0
MAX_LIVE_STREAMS = 32
MAX_LIVE_STREAMS_PER_APPROVER = 4


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


@dataclass(frozen=True)
class LiveLimits:
    """How the live streams behave (tests shorten the times)."""

    poll_s: float = LIVE_POLL_S
    heartbeat_s: float = LIVE_HEARTBEAT_S
    stream_s: float = LIVE_STREAM_S
    max_streams: int = MAX_LIVE_STREAMS
    max_per_approver: int = MAX_LIVE_STREAMS_PER_APPROVER


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
        limits: SlowClientLimits = INBOX_LIMITS,
        live: LiveLimits | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.limits = limits
        self.live = live or LiveLimits()
        self.streams: dict[str, int] = {}  # open live streams, by approver (loop thread only)
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
            self.limits,
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

    @property
    def stopping(self) -> bool:
        """The server is shutting down: live streams end (within a poll) so it can."""
        return self._server is not None and bool(self._server.should_exit)

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

    def session_alive(self, sid: str | None) -> bool:
        """Whether a session still stands (without counting this as its use)."""
        with self._sessions_lock:
            return bool(sid) and sid in self.sessions

    def open_stream(self, approver: str) -> bool:
        """Count a live stream for `approver`; False if a cap is reached."""
        key = approver.strip().casefold()
        if sum(self.streams.values()) >= self.live.max_streams:
            return False
        if self.streams.get(key, 0) >= self.live.max_per_approver:
            return False
        self.streams[key] = self.streams.get(key, 0) + 1
        return True

    def close_stream(self, approver: str) -> None:
        key = approver.strip().casefold()
        left = self.streams.get(key, 0) - 1
        if left > 0:
            self.streams[key] = left
        else:
            self.streams.pop(key, None)

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

    async def history_for(self, token: str, filters: dict[str, Any]) -> HistoryReply | None:
        """Decided calls this token may see, filtered; None if the token is no longer valid."""
        try:
            reply: HistoryReply = await self.client.history(token, **filters)
        except Refused as exc:
            if exc.code == Refusal.INVALID_TOKEN:
                self.forget_token(token)
                return None
            raise
        return reply

    async def call_for(self, token: str, key: str) -> ApprovalView | object | None:
        """One call by its key, if this token may see it (else UNKNOWN: the same for a call
        that does not exist and one of another tenant); None if the token is no longer valid."""
        ref = parse_call_ref(key)
        if ref is None or ref.key != key:
            return UNKNOWN
        try:
            found = await self.client.get(key, token)
        except Refused as exc:
            if exc.code == Refusal.INVALID_TOKEN:
                self.forget_token(token)
                return None
            raise
        return UNKNOWN if found is None else found


UNKNOWN = object()  # a call this approver may not see, or that does not exist


def page(title: str, body: str, live: str = "") -> bytes:
    """A whole page. `live` ("list" or "call"): the script keeps it up to date."""
    return (
        f"<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>{h(title)}</title><style>{STYLE}</style>"
        f"<script src='{SCRIPT_PATH}' defer></script></head>"
        f"<body{f' data-live={live}' if live else ''}>{body}</body></html>"
    ).encode()


def login_page(message: str = "", back: str = "/") -> bytes:
    """The login form; `back`: the call page a link (a notification's) asked for, where
    the login then leads."""
    note = f"<p class='flash refused' id=flash>{h(message)}</p>" if message else ""
    then = f"<input type=hidden name=back value='{h(back)}'>" if _is_call_page(back) else ""
    return page(
        "toolgate approvals: log in",
        f"""
<h1>toolgate approvals</h1>{note}
<form method=post action=/login>{then}
<label for=token>Approver token</label>
<input id=token name=token type=password autocomplete=off required size=60>
<button id=login type=submit>Log in</button>
</form>""",
    )


def moment_html(moment: datetime) -> str:
    """A time: UTC as text (readable without a script), its ISO form for the script,
    which adds the approver's own zone beside it."""
    return f"<time datetime='{h(moment.isoformat())}'>{h(utc_text(moment))}</time>"


def call_link(key: str) -> str:
    return f"<a class=call-link href='{CALLS_PATH}{h(key)}'><code class=key>{h(key)}</code></a>"


def _tool_rows(state: ApprovalView) -> list[tuple[str, str]]:
    info = state.tool_info
    if info is None:
        return [("tool", "<em>not in the registry any more</em>")]
    # A registry's description is often folded YAML: its line breaks are layout, not data.
    description = " ".join(info.description.split())
    rows = [("tool", f"<span class=description>{h(description)}</span>")]
    if info.risk and info.risk != state.risk:
        rows.append(("registry risk", f"<span class=registry-risk>{h(info.risk)}</span>"))
    if info.server:
        rows.append(
            (
                "upstream",
                f"<code class=server>{h(info.server)}</code> "
                f"<small>(tool <code class=upstream-tool>{h(info.upstream_tool)}</code>)</small>",
            )
        )
        rows.append(("pinned sha256", f"<code class=pin>{h(info.pin)}</code>"))
    return rows


def _decision_html(state: ApprovalView) -> str:
    """Who decided, when, why (a decided call)."""
    when = moment_html(state.decided_at) if state.decided_at else "?"
    if state.status == "expired":
        head = f"Expired {when}: {h(votes_line(state))} approvals given, nobody decided."
    else:
        head = f"{h(state.status.capitalize())} {when}."
    return f"<p class='decision decision-{h(state.status)}'>{head}</p>"


def _votes_html(state: ApprovalView) -> str:
    if not state.votes:
        return ""
    items = "".join(
        f"<li class='vote vote-{h(v.decision)}'><b class=voter>{h(v.approver)}</b> "
        f"{'approved' if v.decision == 'approve' else 'denied'} {moment_html(v.at)}: "
        f"<q class=reason>{h(v.reason)}</q></li>"
        for v in state.votes
    )
    return f"<h3>Votes</h3><ul class=votes-list>{items}</ul>"


def call_html(
    state: ApprovalView,
    approver: Approver,
    csrf: str,
    twins: list[str] | None = None,
    back: str = "/",
) -> str:
    """One call's card: pending (with the vote form) or decided (who, when, why)."""
    p = state.call.principal
    now = utc_now()
    own = same_person(approver.name, state.requester)
    voted = next((v for v in state.votes if same_person(v.approver, approver.name)), None)
    rows = [
        ("call", call_link(state.key)),
        *_tool_rows(state),
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
        rows.append(("why", f"<span class=why>{h(state.request_reason)}</span>"))
    rows.append(("requested", moment_html(state.requested_at)))
    if state.status == "pending":
        rows.append(
            (
                "expires",
                f"{moment_html(state.expires_at)} "
                f"<small>({h(time_left(state.expires_at, now))})</small>",
            )
        )
    rows += [
        ("approvals", f"<span class=votes>{h(votes_line(state))}</span>"),
        ("arguments sha256", f"<code class=sha>{h(state.arguments_sha256)}</code>"),
    ]
    dl = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in rows)
    twin_note = ""
    if twins:
        twin_note = (
            "<p class=duplicate>Likely a duplicate (a client's retry: same tenant, agent, "
            "tool and arguments) of " + ", ".join(call_link(k) for k in twins) + ".</p>"
        )
    if state.status != "pending":
        action = _decision_html(state)
    elif voted is not None:
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
<input type=hidden name=back value="{h(back)}">
<label>Reason <textarea name=reason required maxlength={MAX_REASON_CHARS}></textarea></label>
{approve}<button type=submit name=decision value=deny class=deny>Deny</button>
</form>"""
    status = f"call status-{h(state.status)}" + (" duplicate-card" if twins else "")
    return f"""
<article class="{status}" id="call-{h(state.key)}" data-call-key="{h(state.key)}"
 data-call-id="{h(state.call_id)}" data-status="{h(state.status)}"
 data-mark="{card_mark(state, twins)}">
<h2><span class=tool>{h(state.call.tool)}</span>
<span class="risk risk-{h(state.risk)}">{h(state.risk)}</span>
{"" if state.status == "pending" else f"<span class=status>{h(state.status)}</span>"}</h2>
{twin_note}<dl>{dl}</dl>
<h3>Arguments</h3>
<pre class=arguments>{escape(pretty_arguments(state.call.arguments), quote=True)}</pre>
{_votes_html(state) if state.status != "pending" else ""}{action}
</article>"""


def _header(approver: Approver, csrf: str, title: str) -> str:
    scope = "every tenant" if approver.all_tenants else "tenant " + ", ".join(approver.tenants)
    return f"""
<header><h1>{h(title)}</h1>
<form method=post action=/logout><input type=hidden name=csrf value="{h(csrf)}">
<span id=who>{h(approver.name)}</span> <small id=scope>({h(scope)})</small>
<button type=submit>Log out</button></form></header>
<nav><a href="/">Pending</a> <a href="/history">History</a>
<small id=live class=live></small></nav>"""


def _flash_html(flash: tuple[str, bool] | None) -> str:
    if not flash:
        return ""
    message, refused = flash
    return f"<p class='flash{' refused' if refused else ''}' id=flash>{h(message)}</p>"


def inbox_page(
    approver: Approver,
    session_csrf: str,
    states: list[ApprovalView],
    flash: tuple[str, bool] | None,
    omitted: int = 0,
) -> bytes:
    twins = duplicates(states)
    calls = "".join(call_html(s, approver, session_csrf, twins.get(s.key)) for s in states)
    if not calls:
        calls = "<p id=empty>No calls are waiting for approval.</p>"
    more = ""
    if omitted:
        more = (
            f"<p id=omitted>{omitted} more calls are waiting: decide these first, "
            "or use <code>toolgate approvals list</code>.</p>"
        )
    return page(
        "toolgate approvals",
        f"""{_header(approver, session_csrf, "Pending approvals")}
{_flash_html(flash)}
<p><a href="/">Refresh</a></p>
<main id=calls>{calls}</main>{more}""",
        live="list",
    )


def call_page(
    approver: Approver, csrf: str, state: ApprovalView, flash: tuple[str, bool] | None
) -> bytes:
    return page(
        f"toolgate approvals: {state.key}",
        f"""{_header(approver, csrf, "Call")}
{_flash_html(flash)}
<main id=call>{call_html(state, approver, csrf, back=CALLS_PATH + state.key)}</main>""",
        live="call",
    )


def not_found_page() -> bytes:
    # The same bytes whether the call does not exist or is another tenant's.
    return page("not found", "<p id=not-found>No such call that you may see.</p>")


HISTORY_DECISIONS = ("", "granted", "denied", "expired")


def history_filters(query: str) -> dict[str, Any] | None:
    """The history filters of a query string (HistoryRequest's fields); None if one is
    not valid. Times are UTC: `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM[:SS]`."""
    raw = {k: v[0].strip() for k, v in parse_qs(query, keep_blank_values=True).items()}
    found: dict[str, Any] = {}
    for name in ("tool", "approver"):
        value = raw.get(name, "")
        if len(value) > 200:
            return None
        found[name] = value
    decision = raw.get("decision", "")
    if decision not in HISTORY_DECISIONS:
        return None
    found["decision"] = decision
    for name in ("since", "until"):
        value = raw.get(name, "")
        if not value:
            found[name] = None
            continue
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            return None
        found[name] = moment if moment.tzinfo else moment.replace(tzinfo=UTC)
    return found


def history_page(
    approver: Approver, csrf: str, filters: dict[str, Any], reply: HistoryReply
) -> bytes:
    def value(name: str) -> str:
        v = filters.get(name)
        if isinstance(v, datetime):
            return h(v.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S"))
        return h(v or "")

    options = "".join(
        f"<option value='{d}'{' selected' if filters.get('decision') == d else ''}>"
        f"{d or 'any'}</option>"
        for d in HISTORY_DECISIONS
    )
    form = f"""
<form method=get action=/history id=filters class=filters>
<label>Tool <input name=tool value="{value("tool")}" size=16></label>
<label>Decision <select name=decision>{options}</select></label>
<label>Approver <input name=approver value="{value("approver")}" size=12></label>
<label>From (UTC) <input name=since value="{value("since")}" placeholder=2026-12-01 size=19></label>
<label>Before (UTC) <input name=until value="{value("until")}" size=19></label>
<button type=submit>Filter</button>
</form>"""
    cards = "".join(call_html(s, approver, csrf) for s in reply.calls)
    if not cards:
        cards = "<p id=empty>No decided calls match.</p>"
    more = (
        f"<p id=omitted>{reply.omitted} more match: narrow the filters.</p>"
        if reply.omitted
        else ""
    )
    return page(
        "toolgate approvals: history",
        f"""{_header(approver, csrf, "Decided calls")}
<p><small>Kept {RETENTION_DAYS} days in the approvals bucket (older: `toolgate audit`).</small></p>
{form}<main id=history>{cards}</main>{more}""",
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
    if handler.command == "GET" and scope["path"] == EVENTS_PATH:
        await live_stream(handler, receive, send)
        return
    if handler.command == "POST":
        handler.body = await _read_body(receive, MAX_FORM_BYTES)
    await handler.handle()
    await _respond(send, handler.response)


EVENTS_PATH = "/events"
HISTORY_PATH = "/history"


def _is_call_page(path: str) -> bool:
    """A path of the inbox's own per-call pages (where a vote may send the browser back)."""
    if not path.startswith(CALLS_PATH):
        return False
    ref = parse_call_ref(path[len(CALLS_PATH) :])
    return ref is not None and ref.key == path[len(CALLS_PATH) :]


def _event(name: str, data: Any) -> bytes:
    """One server-sent event (JSON data: one line, whatever it holds)."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def card_mark(view: ApprovalView, twins: list[str] | None) -> str:
    """Changes when what a card shows does (not with the seconds left): the page's cards
    carry it, so the script leaves a card the stream sends again as it is."""
    return hashlib.sha256(msgspec.json.encode((view, twins or []))).hexdigest()[:20]


async def live_stream(handler: _Handler, receive: Any, send: Any) -> None:
    """`GET /events`: the approver's pending calls as server-sent events, while the
    session stands. `card`: a call new or changed (its card's HTML); `decided`: a call
    no longer pending (its decided card); `end`: the session is over. Only what the
    service answers for this approver's token is sent."""
    owner = handler.owner
    if handler._misdirected():
        await _respond(send, handler.response)
        return
    try:
        identity = await handler._identity()
    except Exception as exc:
        log.warning("authenticating a live stream failed: %r", exc)
        identity, handler.response = None, _unavailable(handler)
        await _respond(send, handler.response)
        return
    if identity is None:
        handler._send(401, login_page("log in first"))
        await _respond(send, handler.response)
        return
    approver, token, session = identity
    if not owner.open_stream(approver.name):
        handler._send(
            429,
            page("too many", "<p>Too many live pages open: close some, or reload.</p>"),
            headers={"Retry-After": "30"},
        )
        await _respond(send, handler.response)
        return
    sid = handler._sid() if session is not None else None
    gone = asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.create_task(watch())
    headers = {**SECURITY_HEADERS, "Server": "toolgate-inbox"}
    headers["Content-Type"] = "text/event-stream; charset=utf-8"
    headers["X-Accel-Buffering"] = "no"  # a proxy must pass each event at once
    try:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": b"retry: 5000\n\n", "more_body": True})
        await _stream_changes(owner, approver, token, session, sid, send, gone)
    except OSError:  # the client went away mid-send
        pass
    finally:
        owner.close_stream(approver.name)
        watcher.cancel()
        try:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except Exception:  # already closed: nothing to finish
            pass


async def _stream_changes(
    owner: Inbox,
    approver: Approver,
    token: str,
    session: Session | None,
    sid: str | None,
    send: Any,
    gone: asyncio.Event,
) -> None:
    loop = asyncio.get_running_loop()
    limits = owner.live
    ends_at = loop.time() + limits.stream_s
    shown: dict[str, str] = {}
    quiet_since = loop.time()
    while not gone.is_set() and not owner.stopping and loop.time() < ends_at:
        if session is not None and not owner.session_alive(sid):
            await send({"type": "http.response.body", "body": _event("end", {}), "more_body": True})
            return
        try:
            reply = await owner.pending_for(token)
        except Exception as exc:  # the service is away for a moment: try next round
            log.warning("a live stream could not list approvals: %r", exc)
            reply = ListReply(ok=False)
        if reply is None:  # the token is no longer valid
            await send({"type": "http.response.body", "body": _event("end", {}), "more_body": True})
            return
        chunks: list[bytes] = []
        if reply.ok:
            if reply.approver is not None:
                approver = reply.approver.approver()
            chunks = await _changes(owner, approver, token, session, reply, shown)
        if chunks:
            quiet_since = loop.time()
        elif loop.time() - quiet_since >= limits.heartbeat_s:
            chunks = [b": keep-alive\n\n"]
            quiet_since = loop.time()
        if chunks:
            await send({"type": "http.response.body", "body": b"".join(chunks), "more_body": True})
        try:
            await asyncio.wait_for(gone.wait(), limits.poll_s)
        except TimeoutError:
            pass


async def _changes(
    owner: Inbox,
    approver: Approver,
    token: str,
    session: Session | None,
    reply: ListReply,
    shown: dict[str, str],
) -> list[bytes]:
    """The events that bring a page from `shown` to `reply` (and update `shown`). The
    stream cannot know how old the page is, so its first round sends every card once
    (the script keeps a reason being typed)."""
    csrf = session.csrf if session is not None else ""
    twins = duplicates(reply.calls)
    chunks: list[bytes] = []
    now_keys = set()
    for view in reply.calls:
        now_keys.add(view.key)
        mark = card_mark(view, twins.get(view.key))
        if shown.get(view.key) != mark:
            shown[view.key] = mark
            html = call_html(view, approver, csrf, twins.get(view.key))
            chunks.append(_event("card", {"key": view.key, "mark": mark, "html": html}))
    for key in [k for k in shown if k not in now_keys]:
        del shown[key]
        try:
            found = await owner.client.get(key, token)
        except Exception as exc:
            log.warning("a live stream could not show %s: %r", key, exc)
            continue
        if found is not None and found.status == "pending":
            shown[key] = ""  # past its expiry, not yet swept: look again next round
        elif found is not None:
            html = call_html(found, approver, csrf)
            mark = card_mark(found, None)
            chunks.append(
                _event("decided", {"key": key, "mark": mark, "status": found.status, "html": html})
            )
    return chunks


async def _respond(send: Any, response: tuple[int, list[tuple[str, str]], bytes]) -> None:
    status, headers, body = response
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _unavailable(handler: _Handler) -> tuple[int, list[tuple[str, str]], bytes]:
    handler._send(
        503, page("unavailable", "<p>The approvals service is unavailable; retry shortly.</p>")
    )
    return handler.response


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
        path, _, query = self.path.partition("?")
        if path == "/healthz":  # probes name the pod's address: no Host check, no data
            self._send(200, b"ok", "text/plain")
            return
        if self._misdirected():
            return
        if path == SCRIPT_PATH:
            self._send(200, SCRIPT, "text/javascript; charset=utf-8")
            return
        if path not in ("/", HISTORY_PATH) and not path.startswith(CALLS_PATH):
            self._send(404, page("not found", "<p>Not found.</p>"))
            return
        filters = history_filters(query) if path == HISTORY_PATH else {}
        if filters is None:
            self._send(
                400, page("bad request", "<p>Bad filters: times are YYYY-MM-DD[THH:MM].</p>")
            )
            return
        try:
            identity = await self._identity()
            if identity is None:
                if self._bearer() is not None:
                    self._send(401, login_page("unknown or invalid token"))
                else:
                    self._send(200, login_page(back=path))
                return
            approver, token, session = identity
            reply: Any
            if path == "/":
                reply = await self.owner.pending_for(token)
            elif path == HISTORY_PATH:
                reply = await self.owner.history_for(token, filters)
            else:
                reply = await self.owner.call_for(token, unquote(path[len(CALLS_PATH) :]))
        except Exception as exc:
            log.warning("reading approvals failed: %r", exc)
            self._send(
                503,
                page("unavailable", "<p>The approvals service is unavailable; retry shortly.</p>"),
            )
            return
        if reply is None:  # the token was rotated or removed meanwhile
            self._send(401, login_page("your token is no longer valid: log in again"))
            return
        flash = None
        csrf = ""
        if session is not None:
            csrf = session.csrf
        if path == HISTORY_PATH:
            self._send(200, history_page(approver, csrf, filters, reply))
            return
        if path != "/":
            if reply is UNKNOWN:
                self._send(404, not_found_page())
                return
            if session is not None:
                flash, session.flash = session.flash, None
            self._send(200, call_page(approver, csrf, reply, flash))
            return
        if reply.approver is not None:
            approver = reply.approver.approver()
        if session is not None:
            flash, session.flash = session.flash, None
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
            back = form.get("back", "/")
            if found is None:
                self._send(401, login_page("unknown or invalid token", back))
                return
            sid, _ = found
            self._redirect(
                back if _is_call_page(back) else "/",
                {"Set-Cookie": f"{COOKIE}={sid}; HttpOnly; SameSite=Strict; Path=/"},
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
        back = form.get("back", "/")
        self._redirect(back if back == "/" or _is_call_page(back) else "/")


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
