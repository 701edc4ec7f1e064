"""The audit's seals in JetStream: every checkpoint the sinks signed, kept where the
ClickHouse writer cannot delete them (stream TOOLGATE_AUDIT_SEALS: deny_delete,
deny_purge; only the operator may delete the stream itself)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from toolgate.contracts import subjects
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.services.audit.chain import Checkpoint, seal_of


class SealsUnavailable(Exception):
    """The seal stream could not be read (no NATS, refused creds, no such stream)."""


@asynccontextmanager
async def connected(nats_url: str, creds: Path | None, timeout_s: float) -> AsyncIterator[Client]:
    """A connection for one operator command; SealsUnavailable if none within the time."""
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                nats_servers(nats_url),
                **connect_options(creds),
                allow_reconnect=False,
                connect_timeout=timeout_s,
            ),
            timeout_s + 1,
        )
    except Exception as exc:  # said in one line by the caller
        raise SealsUnavailable(f"no NATS at {nats_url}: {exc!r}") from None
    try:
        yield nc
    finally:
        await nc.close()


async def read_seals(
    nats_url: str, creds: Path | None, timeout_s: float = 5.0
) -> tuple[list[Checkpoint], int]:
    """Every seal in stream order, and how many messages were not seals."""
    async with connected(nats_url, creds, timeout_s) as nc:
        return await _read(nc, nats_url, timeout_s)


async def _read(nc: Client, nats_url: str, timeout_s: float) -> tuple[list[Checkpoint], int]:
    try:
        js = nc.jetstream()
        try:
            info = await js.stream_info(subjects.AUDIT_SEALS_STREAM)
        except NotFoundError:
            stream = subjects.AUDIT_SEALS_STREAM
            raise SealsUnavailable(f"no stream {stream} at {nats_url}") from None
        total = info.state.messages
        seals: list[Checkpoint] = []
        bad = 0
        if total == 0:
            return seals, bad
        sub = await js.subscribe(
            subjects.AUDIT_SEALS_SUBJECT, stream=subjects.AUDIT_SEALS_STREAM, ordered_consumer=True
        )
        try:
            while len(seals) + bad < total:
                msg = await sub.next_msg(timeout=timeout_s)
                try:
                    seals.append(seal_of(msg.data))
                except ValueError:
                    bad += 1
        finally:
            await sub.unsubscribe()
        return seals, bad
    except SealsUnavailable:
        raise
    except Exception as exc:
        raise SealsUnavailable(f"reading {subjects.AUDIT_SEALS_STREAM}: {exc!r}") from None
