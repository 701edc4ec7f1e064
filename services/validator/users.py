"""Pure: what a verified (or refused) end-user token makes of a validated call.

With an OIDC issuer configured, the validator checks the call's
`Authorization: Bearer <JWT>` header (runtime/oidc.py does the I/O) and this
module decides: a tool that acts for a user needs a valid token; the token's tenant
claim must be the calling agent's tenant (the NATS account's, from the subject);
the principal's `user` becomes the token's `sub`, and a payload naming another user
is refused. A tool whose registry entry says `acts_for_user: false` needs no token
(one that is sent is still checked: a bad token is never passed over in silence).
No message here quotes the token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import msgspec

from toolgate.contracts.calls import ErrorCode, ToolCall, ToolError
from toolgate.contracts.registry import ToolSpec
from toolgate.runtime.oidc import ProviderUnreachable, TokenRejected, VerifiedToken, claim_text
from toolgate.services.validator.logic import Rejected, Validated

TokenCheck: TypeAlias = VerifiedToken | TokenRejected | ProviderUnreachable | None


@dataclass(frozen=True)
class UserVerdict:
    outcome: Validated | Rejected
    # The token to seal for the executor: only for a tool that acts for the user.
    token_for_tool: bool = False


def _denied(call: ToolCall, code: str, message: str, retryable: bool = False) -> Rejected:
    return Rejected(
        call.call_id,
        "denied",
        ToolError(code=code, message=message, retryable=retryable),
        call.principal,
        call=call,
    )


def user_verdict(
    validated: Validated, spec: ToolSpec | None, check: TokenCheck, tenant_claim: str
) -> UserVerdict:
    """`check`: the verifier's answer for the call's token (None: the call sent none)."""
    call = validated.call
    acts_for_user = spec is None or spec.acts_for_user
    if check is None:
        if not acts_for_user:
            return UserVerdict(validated)
        return UserVerdict(
            _denied(
                call,
                ErrorCode.USER_TOKEN_REQUIRED,
                f"{call.tool} acts for an end user: send the user's access token in the "
                "NATS header `Authorization: Bearer <JWT>`",
            )
        )
    if isinstance(check, ProviderUnreachable):
        return UserVerdict(
            _denied(
                call,
                ErrorCode.USER_TOKEN_UNVERIFIABLE,
                "the identity provider could not be reached to verify the user's token; "
                "send the call again later under a new call_id",
                retryable=True,
            )
        )
    if isinstance(check, TokenRejected):
        return UserVerdict(_denied(call, check.code, f"user token refused: {check.message}"))
    tenant = claim_text(check.claims, tenant_claim)
    if tenant != call.principal.tenant:
        return UserVerdict(
            _denied(
                call,
                ErrorCode.USER_TOKEN_WRONG_TENANT,
                f"the user's token is not for tenant {call.principal.tenant!r} "
                f"(claim {tenant_claim!r})",
            )
        )
    claimed = call.principal.user
    if claimed and claimed != check.subject:
        return UserVerdict(
            _denied(
                call,
                ErrorCode.USER_MISMATCH,
                f"the call names user {claimed[:128]!r}, but the token is "
                f"{check.subject[:128]!r}'s",
            )
        )
    principal = msgspec.structs.replace(call.principal, user=check.subject)
    return UserVerdict(
        Validated(msgspec.structs.replace(call, principal=principal)), token_for_tool=acts_for_user
    )
