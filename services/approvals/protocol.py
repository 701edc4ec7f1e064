"""How approvers talk to the approvals service: core NATS request/reply under
`toolgate.approvals.`, and nothing else.

Approvers (the CLI, the web inbox) live in the NATS account APPROVERS,
which imports only this service from TOOLGATE: they cannot read the
approvals bucket or the events stream. Each approver is a NATS user of its
own whose replies come to an inbox prefix only it may read; the import
shares who asks (header `Nats-Request-Info`, written by the server). Every
request carries the approver's token; the service (queue group `approvals`,
any replica) authenticates it, requires it to be the token of the approver
whose NATS user asks (the web inbox's user excepted: it speaks for any
approver by token), and answers with the calls of that approver's tenants
only. A call of
another tenant is answered exactly as a call that does not exist
(UNKNOWN_CALL), so an approver learns neither its arguments nor that it is
there.

    subject                     request         reply
    toolgate.approvals.whoami   WhoamiRequest   WhoamiReply (the token's name and tenants)
    toolgate.approvals.list     ListRequest     ListReply (open calls, soonest expiry first)
    toolgate.approvals.show     ShowRequest     ShowReply (one call, any state)
    toolgate.approvals.vote     VoteRequest     VoteOutcome
    toolgate.approvals.history  HistoryRequest  HistoryReply (decided calls, latest first)

A call is addressed as its call key `TENANT.AGENT.CALL_ID` (call_ids are
unique only per agent); a bare `CALL_ID` is accepted when exactly one call
the approver may see has it (else AMBIGUOUS_CALL, listing the keys).

Votes are commands whose answer an approver must see at once (counted, or
refused and why), so they are a request/reply, not a stream: the service
applies the vote to the KV state with an optimistic update, publishes the
resulting events with publish acks, and only then replies. The durable
record is the KV state and the events stream. A request whose reply is lost
is retried with the same `vote_id`, which the state recognises: the retry is
answered again instead of being refused as a second vote.

Every reply has `ok` (`accepted` for a vote), `code` (a Refusal code when
not ok) and `message`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any, Final, Literal

import msgspec

from toolgate.contracts import subjects
from toolgate.contracts.calls import ToolCall, is_valid_call_id
from toolgate.services.approvals.logic import (
    ApprovalState,
    Approver,
    Decision,
    Status,
    Vote,
    VoteOutcome,
)

PREFIX: Final = subjects.APPROVALS_PREFIX
WHOAMI_SUBJECT: Final = f"{PREFIX}.whoami"
LIST_SUBJECT: Final = f"{PREFIX}.list"
SHOW_SUBJECT: Final = f"{PREFIX}.show"
VOTE_SUBJECT: Final = f"{PREFIX}.vote"
HISTORY_SUBJECT: Final = f"{PREFIX}.history"
HISTORY_LIMIT: Final = 200
# What the service subscribes to (an unknown operation is answered BAD_REQUEST).
SERVICE_SUBJECTS: Final = f"{PREFIX}.>"
QUEUE_GROUP: Final = "approvals"
MAX_REQUEST_BYTES: Final = 64 * 1024
# A list reply stays under the server's max_payload; what does not fit is counted.
REPLY_HEADROOM_BYTES: Final = 16 * 1024


# Set by nats-server itself on a request that crossed the APPROVERS account's import
# (`share`): who sent it. A header a client writes there is replaced by the server's.
REQUEST_INFO_HEADER: Final = "Nats-Request-Info"
# The web inbox's NATS user (role `inbox`) speaks for any approver, by token.
INBOX_TAG: Final = "role:inbox"


# ---------------------------------------------------------------- who asks


class Requester(msgspec.Struct, frozen=True, kw_only=True):
    """The NATS identity a request came from, as the server tells it."""

    account: str = ""
    user: str = ""  # the user's public key
    tags: tuple[str, ...] = ()

    @property
    def is_inbox(self) -> bool:
        return INBOX_TAG in self.tags


def requester_of(headers: Mapping[str, str] | None) -> Requester | None:
    """Who sent a request, from the server's `Nats-Request-Info` header; None when there
    is none (a request from inside TOOLGATE's own account, or an unlocked bus). A header
    that cannot be read names nobody (an empty user), so it is refused."""
    raw = (headers or {}).get(REQUEST_INFO_HEADER)
    if raw is None:
        return None
    try:
        info = json.loads(raw)
        if not isinstance(info, dict):
            raise ValueError("not an object")
        tags = info.get("tags") or []
        return Requester(
            account=str(info.get("acc") or ""),
            user=str(info.get("user") or ""),
            tags=tuple(str(t) for t in tags) if isinstance(tags, list) else (),
        )
    except ValueError:
        return Requester()


# ---------------------------------------------------------------- requests


class WhoamiRequest(msgspec.Struct, frozen=True, kw_only=True):
    token: str


class ListRequest(msgspec.Struct, frozen=True, kw_only=True):
    token: str


class ShowRequest(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    call: str  # TENANT.AGENT.CALL_ID, or a bare CALL_ID


class VoteRequest(msgspec.Struct, frozen=True, kw_only=True):
    token: str
    call: str  # TENANT.AGENT.CALL_ID, or a bare CALL_ID
    decision: Decision
    arguments_sha256: str
    reason: str
    vote_id: str
    # The name the voter claims (CLI `--approver`); when given it must own the token.
    approver: str | None = None


class HistoryRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Decided calls (granted, denied, expired) the approver may see, latest first.
    Every filter is optional; `approver` matches anyone who voted on the call."""

    token: str
    tool: str = ""
    decision: Literal["", "granted", "denied", "expired"] = ""
    approver: str = ""
    since: datetime | None = None  # decided at or after
    until: datetime | None = None  # decided before
    limit: int = 50


# ---------------------------------------------------------------- replies


class ToolInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the registry says of a call's tool, for the approver: what it does, its risk,
    and for an upstream MCP tool which server it calls and the pinned definition."""

    description: str = ""
    risk: str = ""
    # An upstream MCP tool: its server (URL, or the command of a stdio server), the
    # tool's own name there, and the sha256 of the definition the operator pinned.
    server: str = ""
    upstream_tool: str = ""
    pin: str = ""


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """Who a token belongs to, and whose calls it sees."""

    name: str
    tenants: list[str] = []
    all_tenants: bool = False

    @classmethod
    def of(cls, approver: Approver) -> Identity:
        return cls(
            name=approver.name, tenants=list(approver.tenants), all_tenants=approver.all_tenants
        )

    def approver(self) -> Approver:
        return Approver(self.name, tuple(self.tenants), self.all_tenants)


class ApprovalView(msgspec.Struct, frozen=True, kw_only=True):
    """What an approver is shown of one call's approval (the state without its
    bookkeeping)."""

    key: str  # TENANT.AGENT.CALL_ID
    call_id: str
    tenant: str
    agent: str
    call: ToolCall
    arguments_sha256: str
    policy_version: str
    policy_ids: list[str] = []
    risk: str
    required_approvals: int
    requested_at: datetime
    expires_at: datetime
    requester: str
    request_reason: str = ""
    status: Status
    votes: list[Vote] = []
    decided_at: datetime | None = None
    # From the service's registry (None: the tool is not in it any more).
    tool_info: ToolInfo | None = None

    @property
    def approvers(self) -> list[str]:
        return [v.approver for v in self.votes if v.decision == "approve"]


def view_of(state: ApprovalState, tool_info: ToolInfo | None = None) -> ApprovalView:
    return ApprovalView(
        key=state.key,
        call_id=state.call_id,
        tenant=state.tenant,
        agent=state.agent,
        call=state.call,
        arguments_sha256=state.arguments_sha256,
        policy_version=state.policy_version,
        policy_ids=list(state.policy_ids),
        risk=state.risk,
        required_approvals=state.required_approvals,
        requested_at=state.requested_at,
        expires_at=state.expires_at,
        requester=state.requester,
        request_reason=state.request_reason,
        status=state.status,
        votes=list(state.votes),
        decided_at=state.decided_at,
        tool_info=tool_info,
    )


class WhoamiReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    code: str = ""
    message: str = ""
    approver: Identity | None = None


class ListReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    code: str = ""
    message: str = ""
    approver: Identity | None = None
    calls: list[ApprovalView] = []
    # Open calls that did not fit in this reply (look at them with `show`).
    omitted: int = 0


class ShowReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    code: str = ""
    message: str = ""
    approval: ApprovalView | None = None


class HistoryReply(msgspec.Struct, frozen=True, kw_only=True):
    ok: bool
    code: str = ""
    message: str = ""
    calls: list[ApprovalView] = []
    # Matching decided calls left out (past the limit, or too large for one reply).
    omitted: int = 0


# ---------------------------------------------------------------- call references


class CallRef(msgspec.Struct, frozen=True):
    """A call as an approver names it: (tenant, agent, call_id), or a bare call_id."""

    call_id: str
    tenant: str | None = None
    agent: str | None = None

    @property
    def key(self) -> str | None:
        if self.tenant is None or self.agent is None:
            return None
        return subjects.call_key(self.tenant, self.agent, self.call_id)


def parse_call_ref(text: str) -> CallRef | None:
    """`TENANT.AGENT.CALL_ID` or `CALL_ID`; None if it is neither."""
    parts = text.strip().split(".")
    if len(parts) == 1 and is_valid_call_id(parts[0]):
        return CallRef(parts[0])
    if (
        len(parts) == 3
        and subjects.is_identity_token(parts[0])
        and subjects.is_identity_token(parts[1])
        and is_valid_call_id(parts[2])
    ):
        return CallRef(parts[2], parts[0], parts[1])
    return None


# ---------------------------------------------------------------- codecs

encoder = msgspec.json.Encoder()
request_decoders: Final[dict[str, msgspec.json.Decoder[Any]]] = {
    WHOAMI_SUBJECT: msgspec.json.Decoder(WhoamiRequest),
    LIST_SUBJECT: msgspec.json.Decoder(ListRequest),
    SHOW_SUBJECT: msgspec.json.Decoder(ShowRequest),
    VOTE_SUBJECT: msgspec.json.Decoder(VoteRequest),
    HISTORY_SUBJECT: msgspec.json.Decoder(HistoryRequest),
}
reply_decoder = msgspec.json.Decoder(VoteOutcome)
whoami_reply_decoder = msgspec.json.Decoder(WhoamiReply)
list_reply_decoder = msgspec.json.Decoder(ListReply)
show_reply_decoder = msgspec.json.Decoder(ShowReply)
history_reply_decoder = msgspec.json.Decoder(HistoryReply)


def encode(message: msgspec.Struct) -> bytes:
    return encoder.encode(message)
