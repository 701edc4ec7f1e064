"""The credential the executor sends to an upstream: the `auth` of an `http:` or `mcp:` entry.

- `bearer_file` / `bearer_env`: a static token, read when a request needs it (a rotated
  file is picked up without a restart).
- `oauth_client_credentials`: a token for the gateway's own client (RFC 6749 4.4).
- `token_exchange`: RFC 8693. The end user's verified token (`ToolContext.subject_token`)
  is the subject token; the gateway authenticates as the client and asks for `audience`.
  A call without a user token is refused (USER_TOKEN_REQUIRED): never sent without auth.

Issued tokens are kept in memory, per executor process, until shortly before they expire
(client credentials per client and scope; exchanged tokens per tenant, user, audience and
scope), never written anywhere. A token answered without `expires_in` is not kept.

Secrets (client secrets, bearer tokens, the user's token, issued tokens) are never in an
error message: a failure names the token endpoint, the HTTP status and the OAuth `error`
code; any text quoted from a server goes through `scrub` first.
"""

from __future__ import annotations

import os
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx

from toolgate.contracts.calls import ErrorCode
from toolgate.contracts.registry import ClientCredentials, TokenExchange, UpstreamAuth
from toolgate.contracts.tooling import ToolContext, ToolRefused, ToolUnavailable
from toolgate.runtime.outside_text import visible

GRANT_CLIENT_CREDENTIALS = "client_credentials"
GRANT_TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
TOKEN_TYPE_ACCESS_TOKEN = "urn:ietf:params:oauth:token-type:access_token"
# A cached token is dropped this long before it expires (at most), so a request never
# leaves with a token that runs out on the way.
EXPIRY_MARGIN_S = 30.0
MAX_CACHED_TOKENS = 10_000
# The most of a token endpoint's answer that is read (an access token response is small).
MAX_TOKEN_RESPONSE_BYTES = 64 * 1024
# The most of a server's text quoted in an error message.
MAX_QUOTED_CHARS = 300
OAUTH_ERROR_CODE = re.compile(r"^[a-z_]{1,64}$")


def scrub(text: str, secrets: list[str]) -> str:
    """`text` bounded, with every known secret replaced and hidden characters escaped:
    fit to quote in an error message."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "[redacted]")
    if len(text) > MAX_QUOTED_CHARS:
        text = text[:MAX_QUOTED_CHARS] + "..."
    return visible(text)


def read_secret(file: str | None, env: str | None, what: str, environ: Mapping[str, str]) -> str:
    """The secret named by a registry entry (a file's content or an environment variable's
    value, stripped); ToolRefused (UPSTREAM_AUTH_FAILED) naming where it was looked for."""
    if file is not None:
        try:
            value = Path(file).read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ToolRefused(
                f"cannot read the {what} from {file}: {type(exc).__name__}",
                code=ErrorCode.UPSTREAM_AUTH_FAILED,
            ) from None
        where = file
    else:
        assert env is not None  # the registry requires one of the two
        value = environ.get(env, "").strip()
        where = f"${env}"
    if not value:
        raise ToolRefused(
            f"the {what} in {where} is empty or not set in the executor",
            code=ErrorCode.UPSTREAM_AUTH_FAILED,
        )
    if any(ch in value for ch in "\r\n\0"):
        raise ToolRefused(
            f"the {what} in {where} holds a line break", code=ErrorCode.UPSTREAM_AUTH_FAILED
        )
    return value


class TokenCache:
    """Issued tokens by key until shortly before they expire; at most `max_entries` (the
    least recently used go first). In memory only."""

    def __init__(
        self,
        max_entries: int = MAX_CACHED_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tokens: OrderedDict[tuple[str, ...], tuple[str, float]] = OrderedDict()
        self._max = max_entries
        self._clock = clock

    def get(self, key: tuple[str, ...]) -> str | None:
        found = self._tokens.get(key)
        if found is None:
            return None
        token, good_until = found
        if self._clock() >= good_until:
            del self._tokens[key]
            return None
        self._tokens.move_to_end(key)
        return token

    def put(self, key: tuple[str, ...], token: str, expires_in: float | None) -> None:
        if expires_in is None or expires_in <= 0:
            return  # no lifetime given: asked again next time rather than kept too long
        margin = min(EXPIRY_MARGIN_S, expires_in / 10)
        self._tokens[key] = (token, self._clock() + expires_in - margin)
        self._tokens.move_to_end(key)
        while len(self._tokens) > self._max:
            self._tokens.popitem(last=False)

    def __len__(self) -> int:
        return len(self._tokens)

    def clear(self) -> None:
        self._tokens.clear()


# One per executor process: the tools of one client (or one user and audience) share
# their tokens; the key names the endpoint, client, scope (and user, audience) in full.
PROCESS_TOKENS = TokenCache()


class Authenticator:
    """The `Authorization` value for one entry's `auth`, per call (see the module doc)."""

    def __init__(
        self,
        auth: UpstreamAuth,
        cache: TokenCache | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.auth = auth
        self.cache = cache if cache is not None else PROCESS_TOKENS
        self._environ = environ

    @property
    def environ(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    async def bearer(self, ctx: ToolContext | None, http: httpx.AsyncClient) -> str:
        """The bearer token to send for this call. Raises ToolRefused / ToolUnavailable."""
        auth = self.auth
        if auth.bearer_file is not None or auth.bearer_env is not None:
            return read_secret(auth.bearer_file, auth.bearer_env, "bearer token", self.environ)
        if auth.oauth_client_credentials is not None:
            client = auth.oauth_client_credentials
            key: tuple[str, ...] = (
                "client_credentials",
                client.token_endpoint,
                client.client_id,
                client.scope or "",
            )
            form = {"grant_type": GRANT_CLIENT_CREDENTIALS}
            return await self._issued(key, client, form, http, [])
        exchange = auth.token_exchange
        assert exchange is not None  # the registry requires exactly one kind
        if ctx is None or not ctx.subject_token:
            raise ToolRefused(
                "this tool acts on the end user's behalf (token exchange) and the call "
                "carries no verified user token",
                code=ErrorCode.USER_TOKEN_REQUIRED,
            )
        principal = ctx.principal
        key = (
            "token_exchange",
            exchange.token_endpoint,
            exchange.client_id,
            exchange.audience,
            exchange.scope or "",
            principal.tenant,
            principal.user,
        )
        form = {
            "grant_type": GRANT_TOKEN_EXCHANGE,
            "subject_token": ctx.subject_token,
            "subject_token_type": TOKEN_TYPE_ACCESS_TOKEN,
            "requested_token_type": TOKEN_TYPE_ACCESS_TOKEN,
            "audience": exchange.audience,
        }
        return await self._issued(key, exchange, form, http, [ctx.subject_token])

    async def header(self, ctx: ToolContext | None) -> dict[str, str]:
        """`{"Authorization": "Bearer ..."}` for a caller without an HTTP client of its own
        (an `mcp:` upstream): a token endpoint is asked on a client made for it."""
        async with httpx.AsyncClient(trust_env=False, timeout=httpx.Timeout(30.0)) as http:
            return {"Authorization": f"Bearer {await self.bearer(ctx, http)}"}

    async def _issued(
        self,
        key: tuple[str, ...],
        client: ClientCredentials | TokenExchange,
        form: dict[str, str],
        http: httpx.AsyncClient,
        secrets: list[str],
    ) -> str:
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        secret = read_secret(
            client.client_secret_file, client.client_secret_env, "client secret", self.environ
        )
        if client.scope:
            form["scope"] = client.scope
        token, expires_in = await request_token(
            http, client.token_endpoint, client.client_id, secret, form, [secret, *secrets]
        )
        self.cache.put(key, token, expires_in)
        return token


async def request_token(
    http: httpx.AsyncClient,
    endpoint: str,
    client_id: str,
    client_secret: str,
    form: dict[str, str],
    secrets: list[str],
) -> tuple[str, float | None]:
    """POST one grant to a token endpoint as the client (HTTP Basic, RFC 6749 2.3.1):
    (access_token, expires_in). ToolRefused when the endpoint refuses (4xx, or an answer
    that is no bearer token), ToolUnavailable when it fails or cannot be reached."""
    grant = "token exchange" if form["grant_type"] == GRANT_TOKEN_EXCHANGE else form["grant_type"]
    # RFC 6749 2.3.1: id and secret are form-encoded before they are joined.
    basic = httpx.BasicAuth(quote(client_id, safe=""), quote(client_secret, safe=""))
    try:
        async with http.stream(
            "POST",
            endpoint,
            data=form,
            auth=basic,
            headers={"Accept": "application/json"},
            follow_redirects=False,
        ) as response:
            body = await read_capped(response, MAX_TOKEN_RESPONSE_BYTES)
    except httpx.TimeoutException:
        raise ToolUnavailable(
            f"the token endpoint {endpoint} did not answer the {grant} grant in time",
            code=ErrorCode.UPSTREAM_AUTH_FAILED,
        ) from None
    except httpx.HTTPError as exc:
        raise ToolUnavailable(
            f"cannot reach the token endpoint {endpoint}: {type(exc).__name__}",
            code=ErrorCode.UPSTREAM_AUTH_FAILED,
        ) from None
    if body is None:
        raise ToolRefused(
            f"the token endpoint {endpoint} answered more than {MAX_TOKEN_RESPONSE_BYTES} bytes",
            code=ErrorCode.UPSTREAM_AUTH_FAILED,
        )
    answer = _json_object(body)
    status = response.status_code
    if status != 200:
        error = answer.get("error") if answer else None
        named = f" {error}" if isinstance(error, str) and OAUTH_ERROR_CODE.match(error) else ""
        description = answer.get("error_description") if answer else None
        said = f": {scrub(description, secrets)}" if isinstance(description, str) else ""
        message = f"the token endpoint {endpoint} refused the {grant} grant: HTTP {status}{named}"
        if status >= 500 or status in (408, 429):
            raise ToolUnavailable(message + said, code=ErrorCode.UPSTREAM_AUTH_FAILED)
        raise ToolRefused(message + said, code=ErrorCode.UPSTREAM_AUTH_FAILED)
    token = answer.get("access_token") if answer else None
    token_type = answer.get("token_type") if answer else None
    if not isinstance(token, str) or not token or any(ch in token for ch in "\r\n\0 "):
        raise ToolRefused(
            f"the token endpoint {endpoint} answered the {grant} grant without an access token",
            code=ErrorCode.UPSTREAM_AUTH_FAILED,
        )
    if not isinstance(token_type, str) or token_type.lower() != "bearer":
        raise ToolRefused(
            f"the token endpoint {endpoint} issued a token of type "
            f"{visible(str(token_type))[:40]!r}, not a bearer token",
            code=ErrorCode.UPSTREAM_AUTH_FAILED,
        )
    expires_in = answer.get("expires_in") if answer else None
    lifetime = float(expires_in) if isinstance(expires_in, int | float) else None
    return token, lifetime


def _json_object(body: bytes) -> dict[str, Any] | None:
    import json

    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def read_capped(response: httpx.Response, limit: int) -> bytes | None:
    """The response's body, or None when it is longer than `limit` bytes (not read on)."""
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
