"""The end-user token verifier against a real OpenID provider (tests/oidc_provider.py:
discovery, JWKS and token issuance over HTTP on a loopback port)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator

import jwt as pyjwt
import pytest

from tests.oidc_provider import JsonWebKey, OpenIdProvider
from toolgate.contracts.calls import ErrorCode
from toolgate.runtime.oidc import (
    KeySet,
    OidcConfig,
    ProviderUnreachable,
    RefetchBudget,
    TokenRejected,
    TokenVerifier,
    bearer_token,
)

AUD = "toolgate-test"


@pytest.fixture
def provider() -> Iterator[OpenIdProvider]:
    started = OpenIdProvider().start()
    yield started
    started.stop()


def verifier_for(provider: OpenIdProvider, budget: RefetchBudget | None = None) -> TokenVerifier:
    config = OidcConfig(provider.issuer, AUD)
    return TokenVerifier(config, KeySet(provider.issuer, budget))


async def rejected(verifier: TokenVerifier, token: str) -> str:
    with pytest.raises(TokenRejected) as caught:
        await verifier.verify(token)
    assert token not in str(caught.value)
    return caught.value.code


def b64(data: dict) -> str:
    return base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()


async def test_a_token_from_the_token_endpoint_is_verified(provider: OpenIdProvider) -> None:
    token = provider.token(sub="u-alice", aud=AUD, tenant="acme")
    verified = await verifier_for(provider).verify(token)
    assert verified.subject == "u-alice"
    assert verified.claims["tenant"] == "acme"


async def test_bad_tokens_get_their_codes(provider: OpenIdProvider) -> None:
    verifier = verifier_for(provider)
    # signed by another key under the provider's key id: a forged signature
    forger = JsonWebKey.generate_key("RSA", 2048, is_private=True)
    forger = JsonWebKey.import_key(
        forger.as_dict(is_private=True) | {"kid": provider.signing_key.as_dict()["kid"]}
    )
    claims = provider.claims("u-alice", AUD, "acme")
    assert await rejected(verifier, provider.sign(claims, forger)) == ErrorCode.USER_TOKEN_INVALID
    # the payload of a good token with another subject pasted in
    good = provider.sign(claims).split(".")
    pasted = ".".join([good[0], b64(claims | {"sub": "u-mallory"}), good[2]])
    assert await rejected(verifier, pasted) == ErrorCode.USER_TOKEN_INVALID
    expired = provider.token(sub="u-alice", aud=AUD, tenant="acme", expires_in=-3600)
    assert await rejected(verifier, expired) == ErrorCode.USER_TOKEN_EXPIRED
    other = provider.token(sub="u-alice", aud="another-service", tenant="acme")
    assert await rejected(verifier, other) == ErrorCode.USER_TOKEN_WRONG_AUDIENCE
    # alg none, and HS256 keyed with the provider's public key: never accepted
    unsigned = f"{b64({'alg': 'none', 'typ': 'JWT'})}.{b64(claims)}."
    assert await rejected(verifier, unsigned) == ErrorCode.USER_TOKEN_INVALID
    public_pem = provider.signing_key.as_pem(is_private=False)
    hs = ".".join(
        [
            b64({"alg": "HS256", "kid": provider.signing_key.as_dict()["kid"]}),
            b64(claims),
            "c2lnbmF0dXJl",
        ]
    )
    assert public_pem and await rejected(verifier, hs) == ErrorCode.USER_TOKEN_INVALID
    # another issuer's token, signed with the right key
    foreign = provider.sign(claims | {"iss": "https://elsewhere.example"})
    assert await rejected(verifier, foreign) == ErrorCode.USER_TOKEN_INVALID
    assert await rejected(verifier, "not-a-jwt") == ErrorCode.USER_TOKEN_INVALID
    with pytest.raises(pyjwt.InvalidTokenError):  # the check above is PyJWT's, not ours alone
        pyjwt.decode(unsigned, options={"verify_signature": True}, algorithms=["RS256"], key="x")


async def test_a_rotated_key_is_fetched_on_its_first_token(provider: OpenIdProvider) -> None:
    verifier = verifier_for(provider)
    await verifier.verify(provider.token(sub="u-alice", aud=AUD, tenant="acme"))
    fetched = provider.jwks_requests
    provider.rotate(keep_old=False)
    verified = await verifier.verify(provider.token(sub="u-bob", aud=AUD, tenant="acme"))
    assert verified.subject == "u-bob"
    assert provider.jwks_requests == fetched + 1


async def test_unknown_key_ids_refetch_only_within_the_budget(provider: OpenIdProvider) -> None:
    clock = [0.0]
    budget = RefetchBudget(burst=2, every_s=60, clock=lambda: clock[0])
    verifier = verifier_for(provider, budget)
    await verifier.verify(provider.token(sub="u-alice", aud=AUD, tenant="acme"))
    fetched = provider.jwks_requests
    stranger = JsonWebKey.generate_key("RSA", 2048, is_private=True)
    for n in range(5):
        made_up = JsonWebKey.import_key(stranger.as_dict(is_private=True) | {"kid": f"made-up-{n}"})
        token = provider.sign(provider.claims("u-alice", AUD, "acme"), made_up)
        assert await rejected(verifier, token) == ErrorCode.USER_TOKEN_INVALID
    assert provider.jwks_requests == fetched + 2  # the burst, then nothing
    clock[0] += 60  # one more refetch a minute later
    provider.rotate(keep_old=False)
    assert (await verifier.verify(provider.token(sub="u-b", aud=AUD, tenant="acme"))).subject


async def test_a_provider_that_is_down_fails_closed(provider: OpenIdProvider) -> None:
    token = provider.token(sub="u-alice", aud=AUD, tenant="acme")
    verifier = verifier_for(provider)
    provider.stop()
    with pytest.raises(ProviderUnreachable) as caught:
        await verifier.verify(token)
    assert token not in str(caught.value)


def test_the_bearer_header_is_read() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None


async def test_a_token_verified_before_is_refused_once_it_expires(
    provider: OpenIdProvider,
) -> None:
    verifier = TokenVerifier(OidcConfig(provider.issuer, AUD, leeway_s=0))
    short = provider.token(sub="u-alice", aud=AUD, tenant="acme", expires_in=2)
    assert (await verifier.verify(short)).subject == "u-alice"
    assert (await verifier.verify(short)).subject == "u-alice"  # remembered
    exp = pyjwt.decode(short, options={"verify_signature": False})["exp"]
    await asyncio.sleep(max(0.0, exp - time.time()) + 0.5)
    assert await rejected(verifier, short) == ErrorCode.USER_TOKEN_EXPIRED


async def test_a_provider_down_is_not_asked_again_at_once() -> None:
    provider = OpenIdProvider()  # not started yet: down
    clock = [0.0]
    verifier = TokenVerifier(
        OidcConfig(provider.issuer, AUD), KeySet(provider.issuer, clock=lambda: clock[0])
    )
    token = provider.sign(provider.claims("u-alice", AUD, "acme"))
    with pytest.raises(ProviderUnreachable):
        await verifier.verify(token)
    provider.start()
    try:
        with pytest.raises(ProviderUnreachable):  # within the quiet time: not asked
            await verifier.verify(token)
        assert provider.jwks_requests == 0
        clock[0] += 2.0
        assert (await verifier.verify(token)).subject == "u-alice"
    finally:
        provider.stop()
