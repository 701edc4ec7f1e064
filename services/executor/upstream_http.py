"""A tool that is one HTTP request: the executor's function for an `http:` registry entry.

The request is built from the registry entry and the validated arguments only
(`build_request`, pure): the method, scheme, host and port are the operator's; each
`{name}` in the url's path is filled with its argument percent-encoded (a `/`, `?` or
`#` in it cannot leave its path segment; `.` and `..` are refused); the other arguments
go into the query (GET, HEAD, DELETE) or a JSON object body (POST, PUT, PATCH), or as the
entry's `query` and `body` say. Headers are the entry's static ones, those it takes from
the executor's environment, and the credential of its `auth` (http_auth.py): none comes
from the model.

The answer: a 2xx JSON body is the tool's output (the attacher checks it against the
entry's `output_schema`, as any tool's); an empty one is `null`. Anything else is an
`execution_error`: a non-2xx status is UPSTREAM_HTTP_ERROR with the status and a bounded,
escaped excerpt of the body (retryable for 5xx, 429 and 408; not for other 4xx); a body
that is not JSON or larger than `max_response_bytes` is UPSTREAM_BAD_RESPONSE. Redirects
are followed (at most MAX_REDIRECTS) only within the same scheme, host and port, so the
credential never travels to another host. Transport failures are retryable; the timeout
is the entry's (`http.timeout`, else `timeout_s`: status `timeout`).

Error messages name the method and the url template, never the filled url (its path holds
arguments, which an entry may audit as hashes only), and never a credential.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx

from toolgate.contracts.calls import ErrorCode
from toolgate.contracts.registry import QUERY_METHODS, URL_PLACEHOLDER, HttpUpstream
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable
from toolgate.services.executor.http_auth import Authenticator, read_capped, scrub

MAX_REDIRECTS = 3
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
# Statuses worth asking again: the upstream is overloaded or timed out.
RETRYABLE_STATUSES = frozenset({408, 429})
# The most of an error answer's body read (its excerpt is shorter still).
MAX_ERROR_BODY_BYTES = 4096
USER_AGENT = "toolgate"


@dataclass(frozen=True)
class HttpRequest:
    method: str
    url: str
    # A JSON body (None with has_body False: no body at all).
    body: Any = None
    has_body: bool = False


def _path_value(name: str, value: Any) -> str:
    """One `{name}` placeholder's text, percent-encoded as a single path segment."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ToolRefused(f"argument {name!r} fills the url path: a string or a number only")
    text = value if isinstance(value, str) else json.dumps(value)
    if text in ("", ".", ".."):
        raise ToolRefused(f"argument {name!r} fills a url path segment: {text!r} cannot")
    return quote(text, safe="")


def _query_value(name: str, value: Any) -> list[str]:
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, str):
        return [value]
    if isinstance(value, int | float):
        return [json.dumps(value)]
    if isinstance(value, list) and all(
        isinstance(item, str | int | float) and not isinstance(item, bool) for item in value
    ):
        return [item if isinstance(item, str) else json.dumps(item) for item in value]
    raise ToolRefused(
        f"argument {name!r} cannot be sent in a query string (a string, number, boolean, or "
        "a list of strings or numbers only)"
    )


def build_request(http: HttpUpstream, arguments: dict[str, Any]) -> HttpRequest:
    """The request for these (validated) arguments. ToolRefused for a value that cannot be
    placed where the entry puts it."""
    path_names = set(http.path_parameters)

    def fill(match: Any) -> str:
        name = match.group(1)
        if name not in arguments:
            raise ToolRefused(f"argument {name!r} fills the url path and is missing")
        return _path_value(name, arguments[name])

    url = URL_PLACEHOLDER.sub(fill, http.url)
    rest = {k: v for k, v in arguments.items() if k not in path_names}
    in_query = set(http.query)
    if http.method in QUERY_METHODS and http.body is None:
        in_query |= set(rest)
    pairs: list[tuple[str, str]] = []
    for name in sorted(in_query):
        if name in rest and rest[name] is not None:
            pairs.extend((name, text) for text in _query_value(name, rest[name]))
    if pairs:
        url += ("&" if "?" in url else "?") + urlencode(pairs, quote_via=quote)
    if http.body is not None:
        if http.body in rest:
            return HttpRequest(http.method, url, rest[http.body], has_body=True)
        return HttpRequest(http.method, url)
    if http.method in QUERY_METHODS:
        return HttpRequest(http.method, url)
    body = {k: v for k, v in rest.items() if k not in in_query}
    return HttpRequest(http.method, url, body, has_body=True)


def same_origin(a: httpx.URL, b: httpx.URL) -> bool:
    return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)


def is_json_type(content_type: str) -> bool:
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (
        mime.startswith("application/") and mime.endswith("+json")
    )


class HttpTool:
    """The executor's function for one `http:` entry (an async callable)."""

    def __init__(
        self,
        name: str,
        http: HttpUpstream,
        timeout_s: float = 30.0,
        environ: dict[str, str] | None = None,
    ):
        self.name = name
        self.http = http
        self.timeout_s = timeout_s
        self.environ = environ
        self.authenticator = Authenticator(http.auth, environ=environ) if http.auth else None
        self._client: httpx.AsyncClient | None = None
        self.where = f"{http.method} {http.url}"

    def client(self) -> httpx.AsyncClient:
        # Made on first use, on the executor's loop; kept for its connection pool.
        # trust_env=False: no proxy or .netrc credentials from the environment.
        if self._client is None:
            timeout = self.http.timeout or self.timeout_s
            self._client = httpx.AsyncClient(
                follow_redirects=False, trust_env=False, timeout=httpx.Timeout(timeout)
            )
        return self._client

    def headers(self) -> dict[str, str]:
        environ = os.environ if self.environ is None else self.environ
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json", **self.http.headers}
        for header, variable in self.http.headers_from_env.items():
            value = environ.get(variable)
            if value is None:
                raise ToolRefused(
                    f"header {header} of {self.name} comes from ${variable}, which is not set "
                    "in the executor's environment"
                )
            if any(ch in value for ch in "\r\n\0"):
                raise ToolRefused(
                    f"header {header} of {self.name} (${variable}) holds a line break"
                )
            headers[header] = value
        return headers

    async def __call__(self, arguments: dict[str, Any], ctx: ToolContext) -> Any:
        request = build_request(self.http, arguments)
        http = self.client()
        headers = self.headers()
        secrets = [v for h, v in headers.items() if h in self.http.headers_from_env]
        if self.authenticator is not None:
            token = await self.authenticator.bearer(ctx, http)
            headers["Authorization"] = f"Bearer {token}"
            secrets.append(token)
        if ctx.subject_token:
            secrets.append(ctx.subject_token)
        if self.http.timeout is None:
            return await self._send(http, request, headers, secrets)
        try:
            async with asyncio.timeout(self.http.timeout):
                return await self._send(http, request, headers, secrets)
        except TimeoutError:
            raise ToolUnavailable(
                f"{self.where} did not answer within {self.http.timeout:g}s",
                code=ErrorCode.UPSTREAM_HTTP_ERROR,
            ) from None

    async def _send(
        self,
        http: httpx.AsyncClient,
        request: HttpRequest,
        headers: dict[str, str],
        secrets: list[str],
    ) -> Any:
        method, url, has_body, body = request.method, httpx.URL(request.url), request.has_body, None
        if has_body:
            body = json.dumps(request.body, ensure_ascii=False, separators=(",", ":")).encode()
        for _hop in range(MAX_REDIRECTS + 1):
            sent_headers = dict(headers)
            if has_body:
                sent_headers["Content-Type"] = "application/json"
            try:
                async with http.stream(method, url, headers=sent_headers, content=body) as answer:
                    status = answer.status_code
                    location = answer.headers.get("location")
                    if status in REDIRECT_STATUSES and location:
                        target = self._redirect_target(url, location)
                        if status in (301, 302, 303) and method not in ("GET", "HEAD"):
                            method, has_body, body = "GET", False, None
                        url = target
                        continue
                    if not 200 <= status < 300:
                        excerpt = await read_capped(answer, MAX_ERROR_BODY_BYTES)
                        raise self._status_error(status, excerpt, secrets)
                    content_type = answer.headers.get("content-type", "")
                    raw = await read_capped(answer, self.http.max_response_bytes)
            except httpx.TimeoutException:
                raise ToolUnavailable(
                    f"{self.where} timed out", code=ErrorCode.UPSTREAM_HTTP_ERROR
                ) from None
            except httpx.HTTPError as exc:
                raise ToolUnavailable(
                    f"{self.where} could not be sent: {type(exc).__name__}: "
                    f"{scrub(str(exc), secrets)}",
                    code=ErrorCode.UPSTREAM_HTTP_ERROR,
                ) from None
            return self._output(raw, content_type)
        raise ToolRefused(
            f"{self.where} redirected more than {MAX_REDIRECTS} times",
            code=ErrorCode.UPSTREAM_BAD_RESPONSE,
        )

    def _redirect_target(self, url: httpx.URL, location: str) -> httpx.URL:
        try:
            target = url.join(location)
        except httpx.InvalidURL:
            target = None
        if target is None or not same_origin(url, target):
            host = scrub(target.host, [])[:100] if target is not None else "an invalid location"
            raise ToolRefused(
                f"{self.where} redirected to another host ({host!r}); not followed: the "
                "request and its credential go only where the registry says",
                code=ErrorCode.UPSTREAM_BAD_RESPONSE,
            )
        return target

    def _status_error(self, status: int, body: bytes | None, secrets: list[str]) -> Exception:
        text = (body or b"").decode("utf-8", errors="replace").strip()
        said = f": {scrub(text, secrets)}" if text else ""
        message = f"{self.where} answered HTTP {status}{said}"
        if status >= 500 or status in RETRYABLE_STATUSES:
            return ToolUnavailable(message, code=ErrorCode.UPSTREAM_HTTP_ERROR)
        return ToolRefused(message, code=ErrorCode.UPSTREAM_HTTP_ERROR)

    def _output(self, raw: bytes | None, content_type: str) -> Any:
        if raw is None:
            raise ToolRefused(
                f"{self.where} answered more than {self.http.max_response_bytes} bytes (the "
                "entry's max_response_bytes); the answer was dropped",
                code=ErrorCode.UPSTREAM_BAD_RESPONSE,
            )
        if not raw.strip():
            return None
        if not is_json_type(content_type):
            shown = scrub(content_type.split(";", 1)[0], [])[:80] or "none"
            raise ToolRefused(
                f"{self.where} answered with content type {shown!r}, not JSON",
                code=ErrorCode.UPSTREAM_BAD_RESPONSE,
            )
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise ToolRefused(
                f"{self.where} answered a body that is not JSON ({exc.msg} at {exc.pos})"
                if isinstance(exc, json.JSONDecodeError)
                else f"{self.where} answered a body that is not JSON",
                code=ErrorCode.UPSTREAM_BAD_RESPONSE,
            ) from None


def quiet_httpx() -> None:
    """httpx logs each request's URL at INFO; an HTTP tool's URL holds its arguments (which
    an entry may audit as hashes only), so the executor logs none of them."""
    logging.getLogger("httpx").setLevel(logging.WARNING)


def http_tool(name: str, http: HttpUpstream, timeout_s: float = 30.0):
    """The executor's function for one `http:` registry entry (a coroutine function: the
    executor awaits it under the entry's timeout_s)."""
    tool = HttpTool(name, http, timeout_s)
    quiet_httpx()

    async def call_http(arguments: dict[str, Any], ctx: ToolContext) -> Any:
        return await tool(arguments, ctx)

    return call_http
