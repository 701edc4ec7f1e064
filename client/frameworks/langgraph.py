"""LangGraph 1.x: a tool node that is a policy enforcement point, and a file checkpointer.

`GatewayToolNode(session)` takes the place of LangGraph's `ToolNode`: it holds
no tools at all. Each tool call of the last AI message goes to the gateway
(concurrently); each result becomes a `ToolMessage` as in the LangChain
integration. When the gateway says a human must decide, the node raises a
LangGraph `interrupt` carrying the approval requests (call_id, tool,
arguments, arguments hash, why, expiry), so the graph pauses, its state in the
checkpointer. (A graph without a checkpointer cannot be resumed, so there, and
with `pause_for_approval=False`, a call waiting for a human is an error
`ToolMessage` naming the call_id instead: never a success, the tool has not run.)
Resuming (`Command(resume=...)`, in this process or another,
an hour later) re-runs the node: every call keeps its call_id (derived from
the thread, the user, the model's tool call id, the tool and the arguments),
so the gateway answers from its record, and the node waits up to
`resume_wait` seconds for the final result of each call that was pending
(approved: it ran once, in the gateway; denied or expired: that status). The
resume value is never used as a result and nothing runs here: a graph
resumed before a human decided interrupts again.

`SQLiteCheckpointer(path)` persists LangGraph checkpoints in one SQLite file
(stdlib `sqlite3`), so a graph paused in one process resumes in another:
LangGraph's own SQLite saver is a separate package toolgate does not depend
on. It keeps LangGraph's in-memory saver's logic and stores its state after
every write, read-modify-write inside one SQLite transaction (several
processes may share the file; one graph thread should be run by one process
at a time, as with any LangGraph checkpointer).

    pip install 'toolgate[langgraph]'
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from langchain_core.messages import AIMessage, AnyMessage
from langchain_core.runnables import RunnableConfig, RunnableLambda
from langgraph.checkpoint.memory import InMemorySaver

from .session import GatewaySession
from .tool_calls import (
    APPROVAL_INTERRUPT,
    DEFAULT_RESUME_WAIT_S,
    ModelToolCall,
    can_pause,
    pause_for,
)
from .tool_messages import thread_of

__all__ = ["APPROVAL_INTERRUPT", "GatewayToolNode", "SQLiteCheckpointer"]

T = TypeVar("T")


class GatewayToolNode(RunnableLambda):
    """A LangGraph node answering the last AI message's tool calls through the gateway."""

    def __init__(
        self,
        session: GatewaySession,
        *,
        name: str = "tools",
        messages_key: str = "messages",
        resume_wait: float = DEFAULT_RESUME_WAIT_S,
        pause_for_approval: bool = True,
    ) -> None:
        super().__init__(self._node, afunc=self._anode, name=name)
        self.session = session
        self.messages_key = messages_key
        self.resume_wait = resume_wait
        # False (or no checkpointer): a pending call is an error message, not a pause.
        self.pause_for_approval = pause_for_approval

    def _calls(self, state: Any, config: RunnableConfig) -> list[ModelToolCall]:
        messages: Sequence[AnyMessage]
        if isinstance(state, list):
            messages = state
        elif isinstance(state, dict):
            messages = state.get(self.messages_key) or []
        else:
            messages = getattr(state, self.messages_key, None) or []
        last = next((m for m in reversed(messages) if isinstance(m, AIMessage)), None)
        if last is None:
            raise ValueError(f"{self.name}: no AI message in state[{self.messages_key!r}]")
        namespace = thread_of(config)
        return [ModelToolCall(dict(c), self.session, namespace) for c in last.tool_calls]

    def _pause(self, calls: list[ModelToolCall], config: RunnableConfig) -> bool:
        return self.pause_for_approval and can_pause(config) and pause_for(calls)

    def _update(self, calls: list[ModelToolCall]) -> dict[str, Any]:
        return {self.messages_key: [c.message() for c in calls]}

    async def _anode(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
        calls = self._calls(state, config)
        outcomes = await asyncio.gather(*(c.decide() for c in calls))
        for call, outcome in zip(calls, outcomes, strict=True):
            call.outcome = outcome
        while self._pause(calls, config):
            waiting_calls = [c for c in calls if c.waiting]
            finals = await asyncio.gather(*(c.final(self.resume_wait) for c in waiting_calls))
            for call, final in zip(waiting_calls, finals, strict=True):
                call.outcome = final
        return self._update(calls)

    def _node(self, state: Any, config: RunnableConfig) -> dict[str, Any]:
        # interrupt() must run here, in the graph's thread and context; only the gateway
        # steps go over to the session's loop.
        run: Callable[[Any], Any] = self.session.run_sync
        calls = self._calls(state, config)
        for call in calls:
            call.outcome = run(call.decide())
        while self._pause(calls, config):
            for call in calls:
                if call.waiting:
                    call.outcome = run(call.final(self.resume_wait))
        return self._update(calls)


# ---------------------------------------------------------------------------- checkpointer


class SQLiteCheckpointer(InMemorySaver):
    """LangGraph checkpoints in one SQLite file: a paused graph resumes in another process."""

    def __init__(self, path: Path | str, **options: Any) -> None:
        super().__init__(**options)
        self.path = Path(path)
        self._lock = threading.RLock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS toolgate_langgraph_state "
            "(id INTEGER PRIMARY KEY CHECK (id = 1), state BLOB NOT NULL)"
        )
        self._seen_version: int | None = None
        with self._lock:
            self._refresh()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # Every read first takes what another process may have committed.
    def get_tuple(self, config: RunnableConfig) -> Any:
        with self._lock:
            self._refresh()
            return super().get_tuple(config)

    def list(self, config: RunnableConfig | None, **kwargs: Any) -> Any:
        with self._lock:
            self._refresh()
            return iter(list(super().list(config, **kwargs)))

    def put(self, *args: Any, **kwargs: Any) -> Any:
        return self._write(lambda: super(SQLiteCheckpointer, self).put(*args, **kwargs))

    def put_writes(self, *args: Any, **kwargs: Any) -> None:
        self._write(lambda: super(SQLiteCheckpointer, self).put_writes(*args, **kwargs))

    def delete_thread(self, thread_id: str) -> None:
        self._write(lambda: super(SQLiteCheckpointer, self).delete_thread(thread_id))

    def _write(self, change: Callable[[], T]) -> T:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")  # no other writer until COMMIT
            try:
                self._load()
                done = change()
                self._db.execute(
                    "INSERT OR REPLACE INTO toolgate_langgraph_state (id, state) VALUES (1, ?)",
                    (self._encode(),),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                self._seen_version = None
                raise
            self._seen_version = self._version()
            return done

    def _version(self) -> int:
        return int(self._db.execute("PRAGMA data_version").fetchone()[0])

    def _refresh(self) -> None:
        version = self._version()
        if version != self._seen_version:
            self._load()
            self._seen_version = version

    def _load(self) -> None:
        row = self._db.execute("SELECT state FROM toolgate_langgraph_state WHERE id = 1").fetchone()
        self.storage = defaultdict(lambda: defaultdict(dict))
        self.writes = defaultdict(dict)
        self.blobs = {}
        if row is None:
            return
        state = msgspec.msgpack.decode(row[0])
        for thread, ns, cid, checkpoint, metadata, parent in state["storage"]:
            self.storage[thread][ns][cid] = (tuple(checkpoint), tuple(metadata), parent)
        for thread, ns, cid, task, idx, write in state["writes"]:
            task_id, channel, value, path = write
            self.writes[(thread, ns, cid)][(task, idx)] = (task_id, channel, tuple(value), path)
        for thread, ns, channel, version, value in state["blobs"]:
            self.blobs[(thread, ns, channel, version)] = tuple(value)

    def _encode(self) -> bytes:
        return msgspec.msgpack.encode(
            {
                "storage": [
                    [thread, ns, cid, *entry]
                    for thread, spaces in self.storage.items()
                    for ns, checkpoints in spaces.items()
                    for cid, entry in checkpoints.items()
                ],
                "writes": [
                    [*outer, *inner, list(write)]
                    for outer, writes in self.writes.items()
                    for inner, write in writes.items()
                ],
                "blobs": [[*key, list(value)] for key, value in self.blobs.items()],
            }
        )
