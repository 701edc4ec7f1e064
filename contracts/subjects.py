"""Subjects and streams, declared as data. Handlers never spell a subject.

Public (agents depend on them): `toolgate.calls`, `toolgate.results.<call_id>`
and `toolgate.results.<call_id>.pending`. Everything under `toolgate.evt.` is
internal: `toolgate.evt.<EventType>.<tool>`, so a consumer can filter by event
and by tool (one executor durable per tool).
"""

from __future__ import annotations

import re
from typing import Final

from .events import Event

TOOL_NAME_PATTERN: Final = re.compile(r"^[a-z][a-z0-9_]{0,63}$")

CALLS: Final = "toolgate.calls"
RESULTS_PREFIX: Final = "toolgate.results"
EVENTS_PREFIX: Final = "toolgate.evt"
UNKNOWN_TOOL_TOKEN: Final = "_unknown"

CALLS_STREAM: Final = "TOOLGATE_CALLS"
EVENTS_STREAM: Final = "TOOLGATE_EVENTS"
RESULTS_STREAM: Final = "TOOLGATE_RESULTS"
OUTCOMES_BUCKET: Final = "toolgate_outcomes"
EVIDENCE_BUCKET: Final = "toolgate_evidence"
APPROVALS_BUCKET: Final = "toolgate_approvals"


def results_subject(call_id: str) -> str:
    return f"{RESULTS_PREFIX}.{call_id}"


def pending_subject(call_id: str) -> str:
    return f"{RESULTS_PREFIX}.{call_id}.pending"


def event_subject(event_type: type[Event] | str, tool: str) -> str:
    name = event_type if isinstance(event_type, str) else event_type.__name__
    # A tool name the model invented may hold dots or wildcards: never put it in a subject.
    token = tool if TOOL_NAME_PATTERN.fullmatch(tool) else UNKNOWN_TOOL_TOKEN
    return f"{EVENTS_PREFIX}.{name}.{token}"


def event_filter(event_type: type[Event], tool: str = "*") -> str:
    """The subject filter a consumer of `event_type` (for one tool, or all) uses."""
    return f"{EVENTS_PREFIX}.{event_type.__name__}.{tool}"


def subject_of(event: Event) -> str:
    return event_subject(type(event), event.tool)
