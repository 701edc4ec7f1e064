"""The embedded JetStream store is encrypted at rest: a call's headers (an end user's
bearer token among them) are not readable from a copy of the store's files."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import nats

from toolgate.stack.nats_server import STORE_KEY_FILE, EmbeddedNats, nats_server_binary

TOKEN = "eyJhbGciOiJSUzI1NiJ9.SECRET-USER-TOKEN-PAYLOAD.signature"


def files_holding(root: Path, needle: bytes) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


async def publish_and_read(url: str, subject: str, first: bool) -> bytes:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        if first:
            await js.add_stream(name="CALLS", subjects=["calls.>"])
        await js.publish(subject, b"{}", headers={"Authorization": f"Bearer {TOKEN}"})
        stored = await js.get_msg("CALLS", 1)
        return (stored.headers or {}).get("Authorization", "").encode()
    finally:
        await nc.close()


def test_a_token_in_a_stored_header_is_not_in_the_store_files(tmp_path: Path) -> None:
    data = tmp_path / "nats"
    server = EmbeddedNats(data).start()
    try:
        header = asyncio.run(publish_and_read(server.url, "calls.acme.bot", first=True))
    finally:
        server.stop()
    assert header == f"Bearer {TOKEN}".encode()
    assert files_holding(data / "jetstream", b"SECRET-USER-TOKEN") == []
    key = data / STORE_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "SECRET-USER-TOKEN" not in (data / "nats-server.conf").read_text()
    assert key.read_text().strip() not in (data / "nats-server.conf").read_text()
    # Started again with the same data dir, it reads what it stored.
    server = EmbeddedNats(data).start()
    try:
        header = asyncio.run(publish_and_read(server.url, "calls.acme.bot", first=False))
    finally:
        server.stop()
    assert header == f"Bearer {TOKEN}".encode()


def test_a_store_written_in_the_clear_is_encrypted_when_the_server_starts(
    tmp_path: Path,
) -> None:
    import subprocess
    import time

    from toolgate.stack.processes import free_port

    data = tmp_path / "nats"
    store = data / "jetstream"
    store.mkdir(parents=True)
    port = free_port()
    old = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(store)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(200):
            try:
                asyncio.run(publish_and_read(f"nats://127.0.0.1:{port}", "calls.a.b", first=True))
                break
            except Exception:
                time.sleep(0.1)
    finally:
        old.terminate()
        old.wait(timeout=10)
    assert files_holding(store, b"SECRET-USER-TOKEN") != []  # the old store: in the clear
    server = EmbeddedNats(data).start()
    try:
        header = asyncio.run(publish_and_read(server.url, "calls.a.b", first=False))
    finally:
        server.stop()
    assert header == f"Bearer {TOKEN}".encode()
    assert files_holding(store, b"SECRET-USER-TOKEN") == []
