"""A real OpenID provider for tests, built with authlib, on a free loopback port.

It serves what a relying party reads: the discovery document
(`/.well-known/openid-configuration`), the key set (`/jwks`), and issues signed JWT
access tokens at its token endpoint (`POST /token`, client credentials, with the
test's choice of subject, audience, tenant and lifetime as form fields). Keys are
RSA (RS256) made by authlib; `rotate()` makes a new signing key (the set then holds
the new key and, while `keep_old`, the previous one). `stop()` takes it off the
network: a gateway then finds no provider.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs
from urllib.request import Request, urlopen

from authlib.jose import JsonWebKey, jwt  # (authlib 1.6+ warns it prefers joserfc: it works)

__all__ = ["JsonWebKey", "OpenIdProvider"]

CLIENT_ID = "test-platform"
CLIENT_SECRET = "test-platform-secret"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class OpenIdProvider:
    def __init__(self, port: int = 0) -> None:
        self.port = port or _free_port()
        self.issuer = f"http://127.0.0.1:{self.port}"
        self.keys: list[Any] = []
        self.jwks_requests = 0
        self.rotate(keep_old=False)
        self._server: ThreadingHTTPServer | None = None

    # -- keys ---------------------------------------------------------------------------
    def rotate(self, keep_old: bool = True) -> str:
        """A new signing key (RSA 2048); returns its key id."""
        key = JsonWebKey.generate_key("RSA", 2048, is_private=True)
        kid = uuid.uuid4().hex[:16]
        key = JsonWebKey.import_key(key.as_dict(is_private=True) | {"kid": kid, "use": "sig"})
        self.keys = [key, *self.keys[:1]] if keep_old else [key]
        return kid

    @property
    def signing_key(self) -> Any:
        return self.keys[0]

    def jwks(self) -> dict[str, Any]:
        return {
            "keys": [
                k.as_dict(is_private=False) | {"alg": "RS256", "use": "sig"} for k in self.keys
            ]
        }

    def discovery(self) -> dict[str, Any]:
        return {
            "issuer": self.issuer,
            "jwks_uri": f"{self.issuer}/jwks",
            "token_endpoint": f"{self.issuer}/token",
            "response_types_supported": ["code"],
            "subject_types_supported": ["public"],
            "id_token_signing_alg_values_supported": ["RS256"],
            "grant_types_supported": ["client_credentials"],
            "token_endpoint_auth_methods_supported": ["client_secret_post"],
        }

    # -- tokens -------------------------------------------------------------------------
    def sign(self, claims: dict[str, Any], key: Any | None = None) -> str:
        key = key or self.signing_key
        header = {"alg": "RS256", "kid": key.as_dict()["kid"], "typ": "at+jwt"}
        return jwt.encode(header, claims, key).decode()

    def claims(
        self,
        sub: str,
        aud: str | list[str],
        tenant: str | None,
        expires_in: float = 300,
        **extra: Any,
    ) -> dict[str, Any]:
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": sub,
            "aud": aud,
            "iat": now,
            "exp": int(now + expires_in),
            "jti": uuid.uuid4().hex,
            "client_id": CLIENT_ID,
        }
        if tenant is not None:
            claims["tenant"] = tenant
        return claims | extra

    def token(self, **fields: Any) -> str:
        """An access token from the token endpoint, over HTTP (as a platform gets one)."""
        form = {
            "grant_type": "client_credentials",
            "client_id": CLIENT_ID,
            "client_secret": CLIENT_SECRET,
            **{k: str(v) for k, v in fields.items()},
        }
        body = "&".join(f"{k}={v}" for k, v in form.items()).encode()
        request = Request(
            f"{self.issuer}/token",
            data=body,
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        with urlopen(request, timeout=5) as response:
            return str(json.loads(response.read())["access_token"])

    # -- serving ------------------------------------------------------------------------
    def start(self) -> OpenIdProvider:
        provider = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/.well-known/openid-configuration":
                    self._json(200, provider.discovery())
                elif self.path == "/jwks":
                    provider.jwks_requests += 1
                    self._json(200, provider.jwks())
                else:
                    self._json(404, {"error": "not_found"})

            def do_POST(self) -> None:
                if self.path != "/token":
                    self._json(404, {"error": "not_found"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                form = {k: v[0] for k, v in parse_qs(self.rfile.read(length).decode()).items()}
                if (form.get("client_id"), form.get("client_secret")) != (
                    CLIENT_ID,
                    CLIENT_SECRET,
                ):
                    self._json(401, {"error": "invalid_client"})
                    return
                if form.get("grant_type") != "client_credentials":
                    self._json(400, {"error": "unsupported_grant_type"})
                    return
                extra = {
                    k: v
                    for k, v in form.items()
                    if k not in ("grant_type", "client_id", "client_secret", "sub", "aud")
                    and k not in ("tenant", "expires_in")
                }
                audiences = form.get("aud", "toolgate").split()  # several: space-separated
                claims = provider.claims(
                    form.get("sub", "u-alice"),
                    audiences[0] if len(audiences) == 1 else audiences,
                    form.get("tenant"),
                    float(form.get("expires_in", "300")),
                    **extra,
                )
                self._json(
                    200,
                    {
                        "access_token": provider.sign(claims),
                        "token_type": "Bearer",
                        "expires_in": int(claims["exp"] - claims["iat"]),
                    },
                )

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
