"""The vote protocol: a core NATS request/reply on `toolgate.approvals.vote`.

Votes are commands whose answer an approver must see at once (counted, or
refused and why), so they are a request/reply, not a stream: the approvals
service (queue group `approvals`, any replica) authenticates the token,
applies the vote to the KV state with an optimistic update, publishes the
resulting events with publish acks, and only then replies. The durable
record is the KV state and the events stream. A request whose reply is lost
is retried with the same `vote_id`, which the state recognises: the retry is
answered again instead of being refused as a second vote.
"""

from __future__ import annotations

from typing import Final

import msgspec

from toolgate.services.approvals.logic import Decision, VoteOutcome

VOTE_SUBJECT: Final = "toolgate.approvals.vote"
QUEUE_GROUP: Final = "approvals"
MAX_REQUEST_BYTES: Final = 64 * 1024


class VoteRequest(msgspec.Struct, frozen=True, kw_only=True):
    call_id: str
    decision: Decision
    arguments_sha256: str
    reason: str
    token: str
    vote_id: str
    # The name the voter claims (CLI `--approver`); when given it must own the token.
    approver: str | None = None


request_encoder = msgspec.json.Encoder()
request_decoder = msgspec.json.Decoder(VoteRequest)
reply_decoder = msgspec.json.Decoder(VoteOutcome)


def encode(message: msgspec.Struct) -> bytes:
    return request_encoder.encode(message)
