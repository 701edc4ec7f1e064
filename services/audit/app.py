"""The audit sink service (`toolgate serve audit`).

Consumes: every message of TOOLGATE_CALLS (the raw call, recorded as a
`CallRequested` row) and of TOOLGATE_EVENTS (`toolgate.evt.>`: decisions,
approvals, executions, results, dead letters), durable `audit` on each.
Emits: nothing on NATS; rows into ClickHouse `event_log` and signed
checkpoints into `chain_checkpoints` (see writer.py for the order of effects).

A batch stage of the stage runner (runtime/stage.py `BatchStage`): its durables
are its rows of the handler table (runtime/topology.py), one consumer each; a
batch (up to BATCH_ROWS messages, or what came within FLUSH_S) is one ClickHouse
insert, acked as a whole once its rows and seal are stored, and kept `in progress`
by the runner's heartbeat while it waits for ClickHouse. Several replicas may
run: they share the durable consumers, and each writes a hash chain of its own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from faststream import FastStream
from nats.aio.msg import Msg

from toolgate.contracts import subjects
from toolgate.contracts.registry import Registry
from toolgate.runtime import process
from toolgate.runtime.served_registry import ServedRegistry, start_registry
from toolgate.runtime.settings import GatewaySettings
from toolgate.runtime.stage import BatchStage, StageRunner
from toolgate.runtime.topology import AUDIT_ACK_WAIT_S
from toolgate.services.audit.chain import Checkpoint, ensure_seal_key, seal_bytes
from toolgate.services.audit.connection import ClickHouseTarget, login_url
from toolgate.services.audit.lag import WARN_AFTER_S, audit_lag
from toolgate.services.audit.rows import RowBuilder
from toolgate.services.audit.writer import AuditWriter

SERVICE = "audit"
log = logging.getLogger("toolgate.audit")

# ClickHouse wants thousands of rows about once a second per table.
BATCH_ROWS = 2000
FLUSH_S = 1.0
# The topology's (runtime/topology.py).
ACK_WAIT_S = AUDIT_ACK_WAIT_S
MAX_ACK_PENDING = 20_000
LAG_CHECK_S = 10.0


async def watch_lag(nc: Any, writer: AuditWriter, every_s: float = LAG_CHECK_S) -> None:
    """A WARNING line while the oldest unwritten message is older than WARN_AFTER_S: the
    audit is behind (ClickHouse down or slow); the calls are still served."""
    while not writer.stopping:
        await asyncio.sleep(every_s)
        try:
            lags = await audit_lag(nc)
        except Exception as exc:  # NATS restarting: ask again later
            log.info("audit lag unknown: %r", exc)
            continue
        for lag in lags:
            if lag.oldest_unwritten_s > WARN_AFTER_S:
                log.warning("audit behind: %s", lag.line())


def build_app(
    settings: GatewaySettings,
    clickhouse_url: str,
    *,
    batch_rows: int = BATCH_ROWS,
    flush_s: float = FLUSH_S,
) -> FastStream:
    return build_sink(settings, clickhouse_url, batch_rows=batch_rows, flush_s=flush_s)[0]


def build_sink(
    settings: GatewaySettings,
    clickhouse_url: str,
    *,
    batch_rows: int = BATCH_ROWS,
    flush_s: float = FLUSH_S,
) -> tuple[FastStream, AuditWriter]:
    """The app and its writer (whose counters the tests and the benchmark read)."""
    served = ServedRegistry(settings)  # the pushed registry, followed
    builder = RowBuilder(served.current, settings.max_call_bytes)
    writer = AuditWriter(
        ClickHouseTarget.from_url(login_url(clickhouse_url, "writer", settings.data_dir)),
        builder,
        ensure_seal_key(settings.keys_dir),
        process.worker_name(SERVICE),
    )
    runner = StageRunner(SERVICE, settings)

    async def write(batch: list[Msg]) -> None:
        await writer.write(batch)

    # Every row of the table is a source (one durable per stream). An audit that gives
    # up on a message dead-letters it (recorded in turn); it never ends a call.
    runner.add_batch(
        BatchStage(
            write,
            max_messages=batch_rows,
            max_wait_s=flush_s,
            end_call=False,
            max_ack_pending=MAX_ACK_PENDING,
            ack_wait_s=ACK_WAIT_S,
        )
    )
    runner.alongside("lag", lambda: watch_lag(runner.broker.connection, writer))
    app = runner.app()

    app.on_startup(writer.start)  # schema and genesis first, waiting for ClickHouse

    @app.on_startup
    async def bind_bus() -> None:
        js = (await runner.broker.connect()).jetstream()
        await start_registry(served, js)

        def use_registry(registry: Registry) -> None:
            writer.builder = RowBuilder(registry, settings.max_call_bytes)

        served.follow(use_registry)

        async def publish_seal(checkpoint: Checkpoint) -> None:
            await js.publish(
                subjects.AUDIT_SEALS_SUBJECT,
                seal_bytes(checkpoint),
                stream=subjects.AUDIT_SEALS_STREAM,
                headers={
                    "Nats-Msg-Id": f"{checkpoint.chain_id}:{checkpoint.chain_seq}:"
                    f"{int(checkpoint.final)}"
                },
            )

        writer.publish_seal = publish_seal
        await writer.publish_seals()  # the genesis, signed before the bus was there

    @app.on_shutdown  # before the consumers stop: a batch stuck waiting for ClickHouse
    async def stop_writing() -> None:  # gives up (stays un-acked and is redelivered)
        writer.stopping = True

    runner.run_consumers(app)  # the batch in hand finishes (acked) before what follows

    @app.on_shutdown
    async def close_writer() -> None:
        await served.stop()
        await writer.close()  # its final seal goes to JetStream too, before the bus closes

    return app, writer
