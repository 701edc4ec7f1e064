"""End users' access tokens, verified against an OpenID provider (an OAuth issuer).

Used by the validator (a call's `Authorization: Bearer <JWT>` NATS header) and by
the MCP front door (an OAuth resource server: the HTTP `Authorization` header).

What is checked, and in what order: the token is a JWS whose header names an
algorithm of the allow-list (asymmetric only: no `none`, no HS* that a public key
could be turned into a secret for) and a key of the issuer's JWKS whose type fits the
algorithm; the signature; `iss` is the configured issuer; `exp` (and `nbf`, `iat`)
within a bounded clock skew; `aud` names the configured audience; `sub` is there.
Each failure is a `TokenRejected` with its own code (contracts/calls.py ErrorCode);
the provider being unreachable is `ProviderUnreachable` (fail closed).

Keys: the discovery document (`<issuer>/.well-known/openid-configuration`) names
`jwks_uri`; the key set is fetched once and kept. A token signed with a key id the
set does not hold has the set fetched again (the provider rotated its keys), at most
REFETCH_BURST times at once and then once per REFETCH_EVERY_S, so a stream of tokens
with made-up key ids cannot turn the gateway into a load on the provider. The set is
also refreshed when older than MAX_KEYS_AGE_S (if the provider is down then, the keys
in hand are used: they were the provider's).

Nothing here logs or raises with the token's text: messages name the problem only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from toolgate.contracts.calls import ErrorCode

# httpx and PyJWT (~0.3 CPU-s of imports) are imported where they are used: the validator
# and the executor import this module, and most gateways run without an issuer.

log = logging.getLogger("toolgate.oidc")

# Asymmetric algorithms only: `none` and HS* (a shared secret; with a public key as the
# "secret", anyone could sign) are never accepted.
ALLOWED_ALGORITHMS: Final = (
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES384",
    "ES512",
    "EdDSA",
)
_KEY_TYPES: Final = {"RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}
# Clock skew allowed on exp / nbf / iat, and its bound (a larger one is refused at start).
DEFAULT_LEEWAY_S: Final = 60.0
MAX_LEEWAY_S: Final = 300.0
REFETCH_BURST: Final = 3
REFETCH_EVERY_S: Final = 60.0
MAX_KEYS_AGE_S: Final = 3600.0
HTTP_TIMEOUT_S: Final = 5.0
VERIFIED_CACHE_SIZE: Final = 4096
# After a failed fetch, this long without trying again (calls meanwhile: unverifiable).
QUIET_AFTER_FAILURE_S: Final = 2.0
BEARER: Final = "bearer "


class TokenRejected(Exception):
    """The token is not a valid token of the issuer for this gateway: `code` says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProviderUnreachable(Exception):
    """The provider's discovery document or key set could not be read: fail closed."""


@dataclass(frozen=True)
class OidcConfig:
    issuer: str
    audience: str | None = None
    tenant_claim: str = "tenant"
    leeway_s: float = DEFAULT_LEEWAY_S

    def __post_init__(self) -> None:
        if not self.issuer.startswith(("https://", "http://")):
            raise ValueError(f"the OIDC issuer must be an http(s) URL, not {self.issuer!r}")
        if not 0 <= self.leeway_s <= MAX_LEEWAY_S:
            raise ValueError(f"clock skew must be 0 to {MAX_LEEWAY_S:g} s")


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` value, or None."""
    if not header or not header[: len(BEARER)].lower() == BEARER:
        return None
    token = header[len(BEARER) :].strip()
    return token or None


class RefetchBudget:
    """At most `burst` refetches at once, then one per `every_s` (a token bucket)."""

    def __init__(
        self,
        burst: int = REFETCH_BURST,
        every_s: float = REFETCH_EVERY_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.every_s, self.clock = burst, every_s, clock
        self._tokens = float(burst)
        self._at = clock()

    def take(self) -> bool:
        now = self.clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) / self.every_s)
        self._at = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


class KeySet:
    """The issuer's signing keys, from its discovery document and JWKS (fetched lazily)."""

    def __init__(
        self,
        issuer: str,
        budget: RefetchBudget | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.issuer = issuer.rstrip("/")
        self.budget = budget or RefetchBudget(clock=clock)
        self.clock = clock
        self._jwks_uri: str | None = None
        self._keys: dict[str, dict[str, Any]] = {}
        self._fetched_at: float | None = None
        self._failed_at: float | None = None
        self._lock = asyncio.Lock()

    async def _get_json(self, url: str) -> Any:
        import httpx

        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, follow_redirects=False) as http:
                response = await http.get(url, headers={"Accept": "application/json"})
        except httpx.HTTPError as exc:
            raise ProviderUnreachable(f"{url}: {type(exc).__name__}") from None
        if response.status_code != 200:
            raise ProviderUnreachable(f"{url}: HTTP {response.status_code}")
        try:
            return response.json()
        except ValueError:
            raise ProviderUnreachable(f"{url}: not JSON") from None

    async def _fetch(self) -> None:
        now = self.clock()
        if self._failed_at is not None and now - self._failed_at < QUIET_AFTER_FAILURE_S:
            # Down a moment ago: calls fail fast, not each after an HTTP timeout.
            raise ProviderUnreachable(
                f"{self.issuer}: unreachable {now - self._failed_at:.1f} s ago"
            )
        try:
            await self._fetch_now()
        except ProviderUnreachable:
            self._failed_at = self.clock()
            raise
        self._failed_at = None

    async def _fetch_now(self) -> None:
        if self._jwks_uri is None:
            discovery = await self._get_json(f"{self.issuer}/.well-known/openid-configuration")
            if not isinstance(discovery, dict) or discovery.get("issuer", "").rstrip(
                "/"
            ) != self.issuer.rstrip("/"):
                raise ProviderUnreachable("the discovery document names another issuer")
            uri = discovery.get("jwks_uri")
            if not isinstance(uri, str) or not uri.startswith(("https://", "http://")):
                raise ProviderUnreachable("the discovery document names no jwks_uri")
            self._jwks_uri = uri
        found = await self._get_json(self._jwks_uri)
        keys = found.get("keys") if isinstance(found, dict) else None
        if not isinstance(keys, list):
            raise ProviderUnreachable("the JWKS has no keys")
        self._keys = {
            str(k.get("kid", "")): k
            for k in keys
            if isinstance(k, dict) and k.get("use", "sig") == "sig"
        }
        self._fetched_at = self.clock()
        log.info(
            "OIDC keys of %s: %d (key ids %s)", self.issuer, len(self._keys), sorted(self._keys)
        )

    async def key(self, kid: str) -> dict[str, Any] | None:
        """The JWK with this key id, fetching the set when needed; None if the issuer has
        none (after a refetch, if the budget allows one). ProviderUnreachable if the
        set is needed and cannot be read."""
        async with self._lock:
            stale = self._fetched_at is None or self.clock() - self._fetched_at > MAX_KEYS_AGE_S
            if stale:
                try:
                    await self._fetch()
                except ProviderUnreachable:
                    if self._fetched_at is None:
                        raise
                    log.warning(
                        "OIDC keys of %s could not be refreshed; using those held", self.issuer
                    )
            if kid in self._keys:
                return self._keys[kid]
            if stale or not self.budget.take():
                return None
            await self._fetch()  # an unknown key id: the provider may have rotated
            return self._keys.get(kid)


@dataclass(frozen=True)
class VerifiedToken:
    subject: str
    claims: dict[str, Any]


class TokenVerifier:
    """Checks one access token against the configured issuer (see the module's text)."""

    def __init__(
        self,
        config: OidcConfig,
        keys: KeySet | None = None,
        audience: str | None = None,
    ) -> None:
        self.config = config
        self.keys = keys or KeySet(config.issuer)
        # The front door checks its own resource URL instead of the gateway's audience.
        self.audience = audience if audience is not None else config.audience
        self._key_objects: dict[tuple[str, str, int], Any] = {}
        # Tokens verified before, until their expiry: a user's token comes with many
        # calls, and a full check costs about a millisecond (PyJWT's segment decoding).
        self._verified: dict[str, tuple[float, VerifiedToken]] = {}

    def _key_object(self, kid: str, algorithm: str, jwk: dict[str, Any]) -> Any:
        """The JWK as a key object, made once per key and algorithm (parsing a JWK
        costs more than the signature check itself)."""
        cache_key = (kid, algorithm, id(jwk))
        found = self._key_objects.get(cache_key)
        if found is None:
            import jwt
            from jwt.exceptions import InvalidTokenError, PyJWKError

            try:
                found = jwt.PyJWK(jwk, algorithm).key
            except (PyJWKError, InvalidTokenError, ValueError, TypeError):
                raise TokenRejected(
                    ErrorCode.USER_TOKEN_INVALID, "the issuer's key is unusable"
                ) from None
            if len(self._key_objects) >= 64:  # keys rotate: the oldest go
                self._key_objects.pop(next(iter(self._key_objects)))
            self._key_objects[cache_key] = found
        return found

    async def verify(self, token: str) -> VerifiedToken:
        known = self._verified.get(token)
        if known is not None:
            if time.time() < known[0] + self.config.leeway_s:
                return known[1]
            del self._verified[token]  # expired: the full check says so
        verified = await self._verify(token)
        exp = verified.claims.get("exp")
        if isinstance(exp, int | float):
            if len(self._verified) >= VERIFIED_CACHE_SIZE:
                self._verified.pop(next(iter(self._verified)))
            self._verified[token] = (float(exp), verified)
        return verified

    async def _verify(self, token: str) -> VerifiedToken:
        import jwt
        from jwt.exceptions import (
            ExpiredSignatureError,
            ImmatureSignatureError,
            InvalidAudienceError,
            InvalidIssuerError,
            InvalidTokenError,
            MissingRequiredClaimError,
        )

        header = unverified_header(token)
        algorithm = header.get("alg")
        if algorithm not in ALLOWED_ALGORITHMS:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID,
                f"algorithm {str(algorithm)[:16]!r} is not accepted "
                f"(accepted: {', '.join(ALLOWED_ALGORITHMS)})",
            )
        kid = header.get("kid")
        if not isinstance(kid, str):
            kid = ""
        jwk = await self.keys.key(kid)
        if jwk is None:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID, "signed with a key the issuer does not publish"
            )
        if jwk.get("kty") != _KEY_TYPES[algorithm[:2]] or jwk.get("alg") not in (None, algorithm):
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID, "the algorithm does not fit the issuer's key"
            )
        key = self._key_object(kid, algorithm, jwk)
        required = ["exp", "iss", "sub"] + (["aud"] if self.audience else [])
        try:
            claims = jwt.decode(
                token,
                key=key,
                algorithms=[algorithm],
                issuer=self.config.issuer,
                audience=self.audience,
                leeway=self.config.leeway_s,
                options={"require": required, "verify_aud": self.audience is not None},
            )
        except ExpiredSignatureError:
            raise TokenRejected(ErrorCode.USER_TOKEN_EXPIRED, "the token has expired") from None
        except InvalidAudienceError:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_WRONG_AUDIENCE,
                f"the token is not issued for audience {self.audience!r}",
            ) from None
        except InvalidIssuerError:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID, f"the token is not issued by {self.config.issuer}"
            ) from None
        except ImmatureSignatureError:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID, "the token is not valid yet"
            ) from None
        except MissingRequiredClaimError as exc:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID, f"the token has no {exc.claim!r} claim"
            ) from None
        except InvalidTokenError as exc:
            raise TokenRejected(
                ErrorCode.USER_TOKEN_INVALID, f"the token is not valid: {type(exc).__name__}"
            ) from None
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject:
            raise TokenRejected(ErrorCode.USER_TOKEN_INVALID, "the token's sub is empty")
        return VerifiedToken(subject, claims)


def unverified_header(token: str) -> dict[str, Any]:
    """The JWS header, read only to choose the key and algorithm (PyJWT's decode reads
    it again, covered by the signature): the stdlib decoder, not PyJWT's slower one."""
    head = token.split(".", 1)[0]
    try:
        header = json.loads(base64.urlsafe_b64decode(head + "=" * (-len(head) % 4)))
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or token.count(".") != 2:
        raise TokenRejected(ErrorCode.USER_TOKEN_INVALID, "not a signed JWT")
    return header


def unverified_expiry(token: str) -> float | None:
    """The `exp` of a token verified before (the executor's check at run time), or None."""
    import jwt
    from jwt.exceptions import InvalidTokenError

    try:
        claims = jwt.decode(token, options={"verify_signature": False})
    except InvalidTokenError:
        return None
    exp = claims.get("exp")
    return float(exp) if isinstance(exp, int | float) else None


def claim_text(claims: dict[str, Any], name: str) -> str | None:
    """A string claim (a nested one by dots: `org.tenant`), or None."""
    value: Any = claims
    for part in name.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value if isinstance(value, str) else None


__all__ = [
    "ALLOWED_ALGORITHMS",
    "KeySet",
    "OidcConfig",
    "ProviderUnreachable",
    "TokenRejected",
    "TokenVerifier",
    "VerifiedToken",
    "bearer_token",
    "claim_text",
    "unverified_expiry",
]
