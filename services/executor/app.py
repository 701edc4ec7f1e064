"""The executor service: runs real tools, each call at most once.

Consumes: `CallAuthorized` for its tools, one durable per tool
(`executor-<tool>`), so an SRE runs more executors for one tool than another.
Emits: `ExecutionStarted`, then `ExecutionSucceeded` or `ExecutionFailed`
(to the attacher); `ExecutionRefused` (audit only) for a message that is not
a valid authorization of exactly these arguments.

Invariant: redelivery never re-runs a side effect. The outcome of each call
is recorded under (tenant, agent, call_id) (see outcomes.py) before it is published; a
call found `started` but never finished (the executor died mid-run) is run
again only if its tool is declared idempotent, else it fails with
OUTCOME_UNKNOWN.

With an OIDC issuer configured, a tool that acts for the user gets the user's
token (`ToolContext.subject_token`), opened from the sealed copy the validator
stored (runtime/user_tokens.py); a token missing or expired by then ends the call
(USER_TOKEN_REQUIRED / USER_TOKEN_EXPIRED) without running the tool. The sealed
copy is deleted once the call has ended.

The registry is the one the gateway serves (runtime/served_registry.py): a pushed
version changes how a tool runs without a restart, and an executor of every tool (no
--tools) starts consuming a newly pushed tool's durable at once, on a connection of
its own opened with its creds file as it is then (`toolgate tools push` re-issues it
on a locked bus with the new durable's permissions).
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import msgspec
import nats
from faststream import FastStream
from nats.aio.client import Client
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.authorization import load_public_key
from toolgate.contracts.events import (
    CallAuthorized,
    Event,
    ExecutionFailed,
    ExecutionRefused,
    ExecutionStarted,
    ExecutionSucceeded,
    carried_fields,
    decode_event,
    derive_event_id,
    encode_event,
    utc_now,
)
from toolgate.contracts.registry import McpUpstream, Registry, ToolSpec
from toolgate.contracts.tooling import ToolContext, is_inline
from toolgate.runtime import consumers, process, publishing, settling, telemetry
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.runtime.oidc import unverified_expiry
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import Stage, StageRunner
from toolgate.runtime.topology import executor_ack_wait
from toolgate.runtime.user_tokens import SealBroken, SealedTokens, ensure_seal_key
from toolgate.services.executor.logic import (
    Conclude,
    Refuse,
    Replay,
    ToolFunction,
    ToolOutcome,
    is_expired,
    refusal_reason,
    resolve_function,
    run_tool,
    step_for_recorded,
    step_once_claimed,
    user_token_problem,
)
from toolgate.services.executor.outcomes import OutcomeRecord, OutcomeStore

SERVICE = "executor"
log = logging.getLogger("toolgate.executor")


def outcome_key(event: CallAuthorized) -> str:
    """Outcomes are kept per (tenant, agent, call_id): another agent's call_id is another call."""
    principal = event.call.principal
    return subjects.call_key(principal.tenant, principal.agent, event.call_id)


class ToolRunner:
    """Executes the authorized calls of one tool."""

    def __init__(
        self,
        spec: ToolSpec,
        function: ToolFunction,
        settings: GatewaySettings,
        publisher: publishing.Publisher,
        pool: ThreadPoolExecutor,
        worker: str,
    ) -> None:
        self.spec = spec
        self.function = function
        self.settings = settings
        self.publisher = publisher
        self.pool = pool
        self.worker = worker
        self.public_key = load_public_key(settings.keys_dir)
        # Where the tool keeps its files (made once: a Path join per call was 2% of the
        # executor's CPU, profiled; a pushed version of the tool keeps its name).
        self.data_dir = settings.tools_data_dir / spec.name
        # This tool's durable holds a delivery this long (runtime/topology.py).
        self.ack_wait_s = executor_ack_wait(spec.timeout_s)
        self.outcomes: OutcomeStore | None = None  # bound once the broker is connected
        # The sealed user tokens (an OIDC issuer is configured and the tool acts for users).
        self.user_tokens: SealedTokens | None = None

    async def process(self, msg: Msg, delivery: settling.Delivery) -> None:
        """A stage's work (runtime/stage.py): the runner settles the message after it."""
        assert self.outcomes is not None
        try:
            event = decode_event(msg.data)
        except Exception as exc:
            await self._refuse_raw(delivery, f"not a CallAuthorized event: {exc}")
            return
        if not isinstance(event, CallAuthorized):
            await self._refuse_raw(delivery, f"expected CallAuthorized, got {type(event).__name__}")
            return
        reason = refusal_reason(event, self.public_key, self.spec.name)
        if reason is not None:
            await self.publisher.emit(
                ExecutionRefused(
                    event_id=derive_event_id(delivery.message_id, "refused"),
                    occurred_at=utc_now(),
                    service=SERVICE,
                    reason=reason,
                    **carried_fields(event),
                )
            )
            return
        sha = event.authorization.arguments_sha256
        key = outcome_key(event)
        attempt = 1
        if self.records_once and not is_expired(event, utc_now()):
            if await self._run_then_record(event, delivery, key):
                return
            claimed = False  # the call has a record already: read it
        else:
            # The common case first: nobody has seen this call, claim it in one round trip.
            claimed = await self.outcomes.claim(key, self._started(sha, attempt))
        if not claimed:
            found = await self.outcomes.get(key)
            if found is None:
                raise RuntimeError("outcome record vanished between claim and read; retrying")
            record, revision = found
            step = step_for_recorded(record, sha, self.spec)
            if isinstance(step, Refuse):
                await self.publisher.emit(
                    ExecutionRefused(
                        event_id=derive_event_id(delivery.message_id, "refused"),
                        occurred_at=utc_now(),
                        service=SERVICE,
                        reason=step.reason,
                        **carried_fields(event),
                    )
                )
                return
            if isinstance(step, Replay):
                await self._replay(step.stored_event, event, delivery, record)
                return
            if isinstance(step, Conclude):
                await self._finish(event, delivery, step.outcome, step.attempt)
                return
            attempt = step.attempt
            if not await self.outcomes.reclaim(key, self._started(sha, attempt), revision):
                raise RuntimeError("another worker changed this call's record; retrying")
        claimed_step = step_once_claimed(event, attempt, utc_now())
        if isinstance(claimed_step, Conclude):
            await self._finish(event, delivery, claimed_step.outcome, claimed_step.attempt)
            return
        subject_token: str | None = None
        if self.user_tokens is not None:
            try:
                subject_token = await self.user_tokens.take(key)
            except SealBroken as exc:  # not ours to open: as good as no token
                log.warning("call %s (%s): %s", event.call_id, key, exc)
            expiry = unverified_expiry(subject_token) if subject_token else None
            problem = user_token_problem(
                subject_token, expiry, time.time(), self.settings.oidc_clock_skew_s
            )
            if problem is not None:
                await self._finish(event, delivery, problem.outcome, attempt)
                return
        await self.publisher.emit(self._execution_started(event, delivery, attempt, self.worker))
        outcome = await self._run(event, subject_token)
        await self._finish(event, delivery, outcome, attempt)

    @property
    def records_once(self) -> bool:
        """Does a call of this tool get one outcome record (`_run_then_record`), not two?"""
        return is_inline(self.function) and self.spec.idempotent and self.user_tokens is None

    async def _run_then_record(
        self, event: CallAuthorized, delivery: settling.Delivery, key: str
    ) -> bool:
        """An inline, idempotent tool (`runs_inline`, `idempotent: true`): one outcome
        record instead of two, and its start and end stored in one round trip.

        Such a tool returns at once, on this task, and a second run has no effect the
        first did not (its declaration). So it runs first, and its outcome is recorded
        with a create (the call's first record, `done` at once: no `started` record
        before it, as nothing but the end of the process can interrupt the run, and
        then nothing was recorded: the redelivery runs it again, which an idempotent
        tool allows). ExecutionStarted and the terminal event are published after the
        record (durable first, as for every tool), together, and stored before the
        input is acked; a crash between the record and them is replayed from the
        record, ExecutionStarted included (`_replay`). False: the call has a record
        already (an earlier delivery's, another message's): this run's outcome is
        dropped and the record decides, as for any tool."""
        assert self.outcomes is not None
        started = self._execution_started(event, delivery, 1, self.worker)
        outcome = await self._run(event)
        terminal = self._terminal(event, delivery, outcome)
        if not await self.outcomes.claim(key, self._done(event, terminal, 1, started.occurred_at)):
            return False
        await self.publisher.emit_all([started, terminal])
        return True

    @staticmethod
    def _execution_started(
        event: CallAuthorized, delivery: settling.Delivery, attempt: int, worker: str
    ) -> ExecutionStarted:
        return ExecutionStarted(
            event_id=derive_event_id(delivery.message_id, f"started/{attempt}"),
            occurred_at=utc_now(),
            service=SERVICE,
            attempt=attempt,
            worker=worker,
            **carried_fields(event),
        )

    def _started(self, sha: str, attempt: int) -> OutcomeRecord:
        return OutcomeRecord(
            state="started", arguments_sha256=sha, attempt=attempt, worker=self.worker
        )

    def _done(
        self,
        event: CallAuthorized,
        terminal: Event,
        attempt: int,
        started_at: datetime | None = None,
    ) -> OutcomeRecord:
        return OutcomeRecord(
            state="done",
            arguments_sha256=event.authorization.arguments_sha256,
            attempt=attempt,
            worker=self.worker,
            event=encode_event(terminal),
            started_at=started_at,
        )

    async def _run(self, event: CallAuthorized, subject_token: str | None = None) -> ToolOutcome:
        with telemetry.tool_span(self.spec.name, event.call_id) as run:  # GenAI execute_tool
            outcome = await self._run_tool(event, subject_token)
            run.finished(outcome.status, outcome.error.code if outcome.error else None)
        return outcome

    async def _run_tool(self, event: CallAuthorized, subject_token: str | None) -> ToolOutcome:
        # While it runs, the consumer keeps the message with `in_progress` (runtime/consumers.py:
        # PullConsumer), so a tool slower than its AckWait is not handed to another worker.
        ctx = ToolContext(
            call_id=event.call_id,
            tool=self.spec.name,
            principal=event.call.principal,
            task_id=event.call.task_id,
            data_dir=self.data_dir,
            settings=self.spec.settings,
            subject_token=subject_token,
        )
        return await run_tool(self.function, event.call.arguments, ctx, self.spec, self.pool)

    @staticmethod
    def _terminal(
        event: CallAuthorized, delivery: settling.Delivery, outcome: ToolOutcome
    ) -> Event:
        common = dict(
            event_id=derive_event_id(delivery.message_id, "outcome"),
            occurred_at=utc_now(),
            service=SERVICE,
            duration_ms=outcome.duration_ms,
            **carried_fields(event),
        )
        terminal: Event
        if outcome.status == "ok":
            terminal = ExecutionSucceeded(output=outcome.output, **common)
        else:
            assert outcome.error is not None
            terminal = ExecutionFailed(status=outcome.status, error=outcome.error, **common)
        return terminal

    async def _finish(
        self, event: CallAuthorized, delivery: settling.Delivery, outcome: ToolOutcome, attempt: int
    ) -> None:
        assert self.outcomes is not None
        terminal = self._terminal(event, delivery, outcome)
        # Durable first, published second: a crash between the two replays, never re-runs.
        await self.outcomes.finish(outcome_key(event), self._done(event, terminal, attempt))
        await self.publisher.emit(terminal)
        if self.user_tokens is not None:  # the tool has run (or never will): not kept
            await self.user_tokens.forget(outcome_key(event))

    async def _replay(
        self,
        stored: bytes,
        event: CallAuthorized,
        delivery: settling.Delivery,
        record: OutcomeRecord,
    ) -> None:
        recorded = decode_event(stored)
        event_id = derive_event_id(delivery.message_id, "outcome")
        # The same stored message redelivered gets the same id (a duplicate the
        # stream and the audit drop); a re-published call gets a new, replayed event.
        replayed = event_id != recorded.event_id
        terminal = msgspec.structs.replace(
            recorded,
            event_id=event_id,
            replayed=replayed,
            occurred_at=utc_now() if replayed else recorded.occurred_at,
        )
        if replayed or not self.records_once:
            await self.publisher.emit(terminal)
            return
        # This very message recorded the outcome and may have died before publishing its
        # start and end (`_run_then_record`): both again, under their own ids.
        started = self._execution_started(event, delivery, record.attempt, record.worker)
        if record.started_at is not None:  # the very event published before, if it was
            started = msgspec.structs.replace(started, occurred_at=record.started_at)
        await self.publisher.emit_all([started, terminal])

    async def _refuse_raw(self, delivery: settling.Delivery, reason: str) -> None:
        await self.publisher.emit(
            ExecutionRefused(
                event_id=derive_event_id(delivery.message_id, "refused"),
                occurred_at=utc_now(),
                service=SERVICE,
                call_id="",
                tool=self.spec.name,
                reason=reason,
            )
        )


def build_app(
    settings: GatewaySettings, tools: list[str] | None = None, concurrency: int = 8
) -> FastStream:
    # The pushed registry, followed (runtime/served_registry.py): an executor of every tool
    # (no --tools) starts consuming a pushed tool's calls as soon as it is served.
    served = ServedRegistry(settings)
    registry = served.local
    names = tools or registry.names()
    unknown = [name for name in names if registry.get(name) is None]
    if unknown:
        raise SystemExit(f"executor: no such tool(s) in the registry: {', '.join(unknown)}")
    worker = process.worker_name(SERVICE)
    runner = StageRunner(SERVICE, settings, tools=names)
    broker, publisher = runner.broker, runner.publisher
    pool = ThreadPoolExecutor(max_workers=concurrency * len(names) + 4, thread_name_prefix="tool")
    tool_runners: list[ToolRunner] = []
    added: list[tuple[Client, list[consumers.PullConsumer]]] = []  # pushed tools' consumers
    stores: list[tuple[OutcomeStore, SealedTokens | None]] = []  # bound once connected

    def stage_for(tool_runner: ToolRunner) -> Stage:
        name = tool_runner.spec.name
        return Stage(
            runner.durable_for(subjects.event_filter(CallAuthorized, name), tools=[name]),
            tool_runner.process,
            # An inline tool holds no thread while its call waits on NATS round
            # trips: it gets the stages' usual slots, not the thread budget.
            concurrency=max(concurrency, consumers.CONCURRENCY)
            if is_inline(tool_runner.function)
            else concurrency,
            max_ack_pending=max(concurrency * 4, 64),
            ack_wait_s=tool_runner.ack_wait_s,
        )

    for name in names:
        spec = registry.get(name)
        assert spec is not None
        tool_runner = ToolRunner(spec, resolve_function(spec), settings, publisher, pool, worker)
        tool_runners.append(tool_runner)
        runner.add(stage_for(tool_runner))

    def bind(tool_runner: ToolRunner) -> None:
        outcomes, tokens = stores[0]
        tool_runner.outcomes = outcomes
        if tool_runner.spec.acts_for_user:
            tool_runner.user_tokens = tokens

    async def follow(served_now: Registry) -> None:
        """A new registry version: changed tools run as now declared; an executor of every
        tool starts consuming each new one (a connection of its own, logged in with the
        creds file as it is now: `toolgate tools push` re-issues it with the new tools'
        durables on a locked bus)."""
        new: list[ToolRunner] = []
        known = {tool_runner.spec.name: tool_runner for tool_runner in tool_runners}
        for spec in served_now:
            tool_runner = known.get(spec.name)
            if tool_runner is not None:
                if tool_runner.spec != spec:
                    tool_runner.function = resolve_function(spec)
                    tool_runner.spec = spec
                    if spec.mcp is not None:
                        open_upstream_sessions([spec.mcp])
                continue
            if tools:
                continue  # an executor of named tools runs only those
            tool_runner = ToolRunner(
                spec, resolve_function(spec), settings, publisher, pool, worker
            )
            bind(tool_runner)
            new.append(tool_runner)
        if not new:
            return
        nc = await nats.connect(
            nats_servers(settings.nats_url),
            name=worker,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1,
            **connect_options(settings.nats_creds),
        )
        started = []
        for tool_runner in new:
            consumer = runner.started_later(stage_for(tool_runner), [tool_runner.spec.name])
            started.append(await consumers.PullConsumer(nc, consumer).start())
            tool_runners.append(tool_runner)
            if tool_runner.spec.mcp is not None:
                open_upstream_sessions([tool_runner.spec.mcp])
            log.info("executor: now running %s (%s)", tool_runner.spec.name, served.describe())
        added.append((nc, started))

    app = runner.app()

    @app.on_startup
    async def bind_outcome_store() -> None:
        # Connect before the subscribers start, so no message meets an unbound store.
        await broker.connect()
        kv = await publishing.jetstream(broker).key_value(subjects.OUTCOMES_BUCKET)
        tokens = None
        if settings.oidc_issuer:
            sealed = await publishing.jetstream(broker).key_value(subjects.USER_TOKENS_BUCKET)
            tokens = SealedTokens(sealed, ensure_seal_key(settings.keys_dir))
        stores.append((OutcomeStore(kv), tokens))
        for tool_runner in tool_runners:
            bind(tool_runner)
        upstreams = [r.spec.mcp for r in tool_runners if r.spec.mcp is not None]
        if upstreams:  # kept sessions: start the servers now, not at the first call
            open_upstream_sessions(upstreams)

    @app.after_startup
    async def follow_registry() -> None:
        await start_registry(served, publishing.jetstream(broker))
        await follow(served.current)
        served.on_change(follow)

    runner.run_consumers(app)

    @app.on_shutdown
    async def close_upstream_sessions() -> None:
        # After the consumers stopped (hooks run in order): kept MCP sessions end with
        # the executor (stdio servers are stopped).
        await served.stop()
        for nc, started in added:
            await asyncio.gather(*(consumer.stop() for consumer in started))
            await nc.close()
        if any(r.spec.mcp is not None for r in tool_runners):
            from toolgate.services.executor.upstream_mcp import close_sessions

            await close_sessions()

    return app


def open_upstream_sessions(upstreams: list[McpUpstream]) -> None:
    from toolgate.services.executor.upstream_mcp import open_sessions

    open_sessions(upstreams)
