"""End-user tokens: the validator's verdict (pure), the seal, the executor's last check."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from toolgate.contracts.calls import ErrorCode, Principal, ToolCall
from toolgate.contracts.registry import load_registry, tool_dirs
from toolgate.runtime.oidc import ProviderUnreachable, TokenRejected, VerifiedToken
from toolgate.runtime.user_tokens import SealBroken, ensure_seal_key, open_sealed, seal
from toolgate.services.executor.logic import user_token_problem
from toolgate.services.validator.logic import Rejected, Validated
from toolgate.services.validator.users import user_verdict

REGISTRY = load_registry(*tool_dirs((), True))
SPEC = REGISTRY.get("search_sources")
TOKEN = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1LWFsaWNlIn0.c2ln"


def validated(user: str = "", tenant: str = "acme") -> Validated:
    principal = Principal(tenant=tenant, user=user, agent="researcher", session="s")
    return Validated(
        ToolCall(call_id="c1", tool="search_sources", arguments={}, principal=principal)
    )


def alice(tenant: str | None = "acme") -> VerifiedToken:
    claims = {"sub": "u-alice"} | ({"tenant": tenant} if tenant is not None else {})
    return VerifiedToken("u-alice", claims)


def code_of(outcome: Validated | Rejected) -> str:
    assert isinstance(outcome, Rejected) and outcome.status == "denied"
    return outcome.error.code


class TestUserVerdict:
    def test_the_user_becomes_the_tokens_sub(self) -> None:
        verdict = user_verdict(validated(), SPEC, alice(), "tenant")
        assert isinstance(verdict.outcome, Validated) and verdict.token_for_tool
        assert verdict.outcome.call.principal.user == "u-alice"

    def test_a_payload_naming_another_user_is_denied(self) -> None:
        verdict = user_verdict(validated(user="u-bob"), SPEC, alice(), "tenant")
        assert code_of(verdict.outcome) == ErrorCode.USER_MISMATCH

    def test_the_tenant_claim_must_be_the_agents_tenant(self) -> None:
        for claims in (alice("globex"), alice(None)):
            verdict = user_verdict(validated(), SPEC, claims, "tenant")
            assert code_of(verdict.outcome) == ErrorCode.USER_TOKEN_WRONG_TENANT
        nested = VerifiedToken("u-alice", {"org": {"id": "acme"}})
        assert isinstance(user_verdict(validated(), SPEC, nested, "org.id").outcome, Validated)

    def test_no_token_is_denied_unless_the_tool_acts_for_no_user(self) -> None:
        assert code_of(user_verdict(validated(), SPEC, None, "t").outcome) == (
            ErrorCode.USER_TOKEN_REQUIRED
        )
        public = SPEC.model_copy(update={"acts_for_user": False})
        verdict = user_verdict(validated(user="u-x"), public, None, "tenant")
        assert isinstance(verdict.outcome, Validated) and not verdict.token_for_tool
        # a token sent anyway is checked, and not kept for the tool
        checked = user_verdict(validated(), public, alice(), "tenant")
        assert checked.outcome.call.principal.user == "u-alice" and not checked.token_for_tool

    def test_refusals_keep_their_code_and_an_unreachable_provider_is_retryable(self) -> None:
        refused = TokenRejected(ErrorCode.USER_TOKEN_EXPIRED, "the token has expired")
        assert code_of(user_verdict(validated(), SPEC, refused, "t").outcome) == (
            ErrorCode.USER_TOKEN_EXPIRED
        )
        down = user_verdict(validated(), SPEC, ProviderUnreachable("x"), "t").outcome
        assert code_of(down) == ErrorCode.USER_TOKEN_UNVERIFIABLE
        assert isinstance(down, Rejected) and down.error.retryable


class TestSeal:
    def test_the_key_is_made_once_and_readable_by_its_owner_only(self, tmp_path: Path) -> None:
        key = ensure_seal_key(tmp_path / "keys")
        assert ensure_seal_key(tmp_path / "keys") == key and len(key) == 32
        mode = stat.S_IMODE((tmp_path / "keys" / "user-token-seal.key").stat().st_mode)
        assert mode == 0o600

    def test_a_sealed_token_opens_only_for_its_call_and_key(self, tmp_path: Path) -> None:
        key = ensure_seal_key(tmp_path)
        sealed = seal(key, TOKEN, "acme.researcher.c1")
        assert TOKEN.encode() not in sealed and b"u-alice" not in sealed
        assert open_sealed(key, sealed, "acme.researcher.c1") == TOKEN
        with pytest.raises(SealBroken):
            open_sealed(key, sealed, "acme.researcher.c2")  # moved to another call
        with pytest.raises(SealBroken):
            open_sealed(bytes(32), sealed, "acme.researcher.c1")
        tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
        with pytest.raises(SealBroken):
            open_sealed(key, tampered, "acme.researcher.c1")


class TestExecutorCheck:
    def test_a_token_past_its_expiry_ends_the_call(self) -> None:
        assert user_token_problem(TOKEN, 1000.0, 999.0, 0) is None
        late = user_token_problem(TOKEN, 1000.0, 1000.5, 0)
        assert late is not None and late.outcome.error is not None
        assert late.outcome.error.code == ErrorCode.USER_TOKEN_EXPIRED
        assert user_token_problem(TOKEN, 1000.0, 1000.5, 60) is None  # within the skew
        missing = user_token_problem(None, None, 0, 0)
        assert missing is not None and missing.outcome.error is not None
        assert missing.outcome.error.code == ErrorCode.USER_TOKEN_REQUIRED


class TestCommandLine:
    def test_up_refuses_a_bad_issuer_or_skew_in_one_line(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        from toolgate.cli.main import main

        data = str(tmp_path / "data")
        assert main(["up", "--data-dir", data, "--oidc-issuer", "id.example.com"]) == 2
        assert "--oidc-issuer" in capsys.readouterr().err
        issuer = ["--oidc-issuer", "https://id.example.com", "--oidc-clock-skew", "3600"]
        assert main(["up", "--data-dir", data, *issuer]) == 2
        assert "--oidc-clock-skew" in capsys.readouterr().err
        assert not (tmp_path / "data").exists()  # nothing was started

    def test_up_gives_every_service_the_oidc_flags_and_records_them(self) -> None:
        from toolgate.cli.main import build_parser
        from toolgate.cli.serve import oidc_args
        from toolgate.stack.supervisor import Stack

        args = build_parser().parse_args(
            ["up", "--oidc-issuer", "https://id.example.com", "--oidc-audience", "tg"]
        )
        flags = oidc_args(args)
        assert flags[:4] == ["--oidc-issuer", "https://id.example.com", "--oidc-audience", "tg"]
        stack = Stack(data_dir=Path("unused"), oidc_args=flags)
        assert stack.oidc_settings() == {
            "issuer": "https://id.example.com",
            "audience": "tg",
            "tenant_claim": "tenant",
            "agent_claim": "agent",
            "clock_skew": "60",
        }
        served = build_parser().parse_args(["serve", "validator", *flags])
        assert (served.oidc_issuer, served.oidc_audience) == ("https://id.example.com", "tg")
