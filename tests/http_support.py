"""Real HTTP servers for the HTTP-tool tests, each on a free loopback port in a thread.

`Backend` records every request it receives (method, raw path, headers, body) and answers
by path: `/status/<code>` with that status and a body quoting the request's Authorization
header (a backend that echoes credentials), `/redirect?to=URL` with a 302, `/big` with
more than a megabyte of JSON, `/slow` after 5 seconds, `/text` with text/plain, `/empty`
with 204, a path in `answers` with its canned answer, anything else with 200 and the
request as JSON.

`TokenServer` is a small OAuth 2.0 authorization server and OpenID provider: discovery,
JWKS, and a token endpoint for the client credentials grant and RFC 8693 token exchange.
It issues RS256 JWTs with `iss`, `sub`, `aud`, `exp` and, for an exchange, `act` (the
client that exchanged: the gateway). It mints end users' tokens for the tests, and records
every grant it served.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import jwt
from cryptography.hazmat.primitives.asymmetric import rsa

GRANT_TOKEN_EXCHANGE = "urn:ietf:params:oauth:grant-type:token-exchange"
ACCESS_TOKEN_TYPE = "urn:ietf:params:oauth:token-type:access_token"


@dataclass
class Received:
    method: str
    path: str  # raw, as sent (percent-encoding kept)
    headers: dict[str, str]
    body: bytes

    @property
    def bearer(self) -> str | None:
        value = self.headers.get("authorization", "")
        return value[7:] if value.startswith("Bearer ") else None

    @property
    def query(self) -> dict[str, list[str]]:
        return parse_qs(urlsplit(self.path).query, keep_blank_values=True)

    @property
    def json(self) -> Any:
        return json.loads(self.body) if self.body else None


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Running:
    server: _Server
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = _Server(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Backend(_Running):
    """An HTTP API that records what it receives (see the module doc)."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        # Canned answers by path (query left out): (status, JSON body).
        self.answers: dict[str, tuple[int, Any]] = {}
        backend = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                got = Received(
                    self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body
                )
                backend.received.append(got)
                path = urlsplit(self.path).path
                if path in backend.answers:
                    code, value = backend.answers[path]
                    self._answer(code, json.dumps(value).encode())
                elif path.startswith("/status/"):
                    code = int(path.rsplit("/", 1)[1])
                    said = f"no. \x1b[31myou sent {got.headers.get('authorization')}"
                    self._answer(code, json.dumps({"error": said}).encode())
                elif path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", unquote(got.query["to"][0]))
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                elif path == "/big":
                    self._answer(200, json.dumps({"pad": "x" * (2 * 1024 * 1024)}).encode())
                elif path == "/slow":  # answers after the tests' timeouts
                    time.sleep(5)
                    self._answer(200, b"{}")
                elif path == "/text":
                    self._answer(200, b"plain words", "text/plain")
                elif path == "/empty":
                    self.send_response(204)
                    self.end_headers()
                else:
                    self._answer(
                        200,
                        json.dumps(
                            {
                                "method": got.method,
                                "path": got.path,
                                "body": got.json if got.body else None,
                            }
                        ).encode(),
                    )

            def _answer(
                self, code: int, body: bytes, content_type: str = "application/json"
            ) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _handle

        self._serve(Handler)

    def last(self) -> Received:
        return self.received[-1]


@dataclass
class Grant:
    grant_type: str
    client_id: str
    form: dict[str, str]
    issued: str | None = None


@dataclass
class TokenServer(_Running):
    """An OAuth authorization server / OpenID provider (see the module doc)."""

    clients: dict[str, str] = field(default_factory=dict)  # client_id -> secret
    lifetime_s: int = 300
    grants: list[Grant] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.kid = uuid.uuid4().hex[:8]
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, code: int, value: Any) -> None:
                body = json.dumps(value).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    self._json(200, issuer.discovery())
                elif self.path == "/jwks":
                    self._json(200, issuer.jwks())
                else:
                    self._json(404, {"error": "not_found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                code, answer = issuer.token(self.headers.get("authorization", ""), form)
                self._json(code, answer)

        self._serve(Handler)

    @property
    def issuer(self) -> str:
        return self.url

    @property
    def token_endpoint(self) -> str:
        return f"{self.url}/token"

    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "jwks_uri": f"{self.url}/jwks",
            "token_endpoint": self.token_endpoint,
            "grant_types_supported": ["client_credentials", GRANT_TOKEN_EXCHANGE],
            "id_token_signing_alg_values_supported": ["RS256"],
        }

    def jwks(self) -> dict[str, Any]:
        public = json.loads(jwt.algorithms.RSAAlgorithm.to_jwk(self.key.public_key()))
        return {"keys": [{**public, "kid": self.kid, "use": "sig", "alg": "RS256"}]}

    def mint(self, claims: dict[str, Any], lifetime_s: int | None = None) -> str:
        now = int(time.time())
        body = {
            "iss": self.issuer,
            "iat": now,
            "exp": now + (lifetime_s or self.lifetime_s),
            "jti": uuid.uuid4().hex,
            **claims,
        }
        return jwt.encode(body, self.key, algorithm="RS256", headers={"kid": self.kid})

    def user_token(self, sub: str, audience: str = "toolgate", **claims: Any) -> str:
        """An end user's access token, as the provider issues it at login."""
        return self.mint({"sub": sub, "aud": audience, **claims})

    def verify(self, token: str, audience: str | None = None) -> dict[str, Any]:
        return jwt.decode(
            token,
            self.key.public_key(),
            algorithms=["RS256"],
            audience=audience,
            issuer=self.issuer,
            options={"verify_aud": audience is not None},
        )

    def _client(self, authorization: str) -> str | None:
        if not authorization.startswith("Basic "):
            return None
        raw = base64.b64decode(authorization[6:]).decode()
        client_id, _, secret = raw.partition(":")
        client_id, secret = unquote(client_id), unquote(secret)
        return client_id if self.clients.get(client_id) == secret else None

    def token(self, authorization: str, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        client_id = self._client(authorization)
        grant_type = form.get("grant_type", "")
        grant = Grant(grant_type, client_id or "", form)
        self.grants.append(grant)
        if client_id is None:
            return 401, {"error": "invalid_client", "error_description": "bad client secret"}
        scope = {"scope": form["scope"]} if "scope" in form else {}
        if grant_type == "client_credentials":
            claims = {"sub": client_id, "aud": form.get("audience", "api"), **scope}
        elif grant_type == GRANT_TOKEN_EXCHANGE:
            if form.get("subject_token_type") != ACCESS_TOKEN_TYPE or "audience" not in form:
                return 400, {"error": "invalid_request"}
            try:
                subject = self.verify(form.get("subject_token", ""))
            except jwt.PyJWTError as exc:
                return 400, {
                    "error": "invalid_grant",
                    "error_description": f"subject token {form.get('subject_token')} "
                    f"rejected: {exc}",
                }
            claims = {
                "sub": subject["sub"],
                "aud": form["audience"],
                "act": {"sub": client_id},
                **scope,
            }
        else:
            return 400, {"error": "unsupported_grant_type"}
        grant.issued = self.mint(claims)
        return 200, {
            "access_token": grant.issued,
            "token_type": "Bearer",
            "expires_in": self.lifetime_s,
            "issued_token_type": ACCESS_TOKEN_TYPE,
        }
