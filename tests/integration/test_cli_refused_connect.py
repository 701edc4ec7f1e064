"""A command whose creds the server refuses ends (exit 3, one line): it never waits for ever.

`toolgate call` and `toolgate result` connect with unlimited reconnects (a call may wait
out a server restart), bounded by --connect-timeout. The bound used to be only the
cancellation of nats-py's connect loop by `asyncio.wait_for`; on Python 3.11 that
cancellation is lost when it lands as one of nats-py's own inner `wait_for`s completes
(the inner one returns its result instead of raising), and the loop then retries the
refused login for ever: `toolgate call` with revoked creds hung about 1 run in 3 in
tests/system/test_operator_failures.py (its --connect-timeout, 5 s, is a multiple of the
0.5 s between attempts, so the timeout lands as an attempt's answer arrives).

Here the same connect path (cli/calls.py) runs against a real locked nats-server with a
revoked agent's creds, many times at once with timeouts spread over the attempt period:
every one must end (exit 3). The give-up wait bounds only how long a hang is waited on.
The library's own connect (GatewayClient.connect: the frameworks' sessions, the benches,
an agent platform) had the same pattern and gets the same test: ConnectFailed every time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from toolgate.cli.calls import _connect_client
from toolgate.cli.common import Failed
from toolgate.client.gateway_client import ConnectFailed, GatewayClient
from toolgate.stack import nats_auth
from toolgate.stack.nats_server import EmbeddedNats

TRIES = 30  # at once: ~40% of them hung before the fix
GIVE_UP_S = 60.0


@pytest.fixture
def revoked(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(URL of a locked nats-server, a copy of creds it refuses: a revoked agent's)."""
    data_dir = tmp_path / "data"
    creds, _ = nats_auth.add_agent(data_dir, "acme", "mallory")
    kept = tmp_path / "kept.creds"
    kept.write_bytes(creds.read_bytes())
    nats_auth.revoke_agent(data_dir, "acme", "mallory")
    # Minted and revoked before the server starts: it preloads the revoked account.
    config = nats_auth.create_credentials(data_dir, tools=["echo"]).auth_config
    server = EmbeddedNats(data_dir / "nats", config_file=config).start()
    try:
        yield server.url, kept
    finally:
        server.stop()


def connects_at_once(
    connect: Callable[[float], Awaitable[BaseException | None]], seed: int
) -> list[BaseException | None]:
    """TRIES connects at once, timeouts spread over the attempt period: each one's
    failure (None: connected). In a thread of its own: a connect that never ends cannot
    hold up the test's teardown."""
    draw = random.Random(seed)
    timeouts = [draw.uniform(0.1, 1.2) for _ in range(TRIES)]
    outcomes: list[BaseException | None] = []

    async def every_one() -> None:
        outcomes.extend(await asyncio.gather(*(connect(t) for t in timeouts)))

    tries = threading.Thread(target=asyncio.run, args=(every_one(),), daemon=True)
    tries.start()
    tries.join(GIVE_UP_S)
    assert not tries.is_alive(), "connects with refused creds never ended"
    assert len(outcomes) == TRIES
    return outcomes


def test_refused_creds_end_the_connect_every_time(revoked: tuple[str, Path]) -> None:
    url, kept = revoked

    async def one(timeout: float) -> Failed | None:
        args = argparse.Namespace(nats_url=url, creds=kept, connect_timeout=timeout)
        try:
            client = await _connect_client(args, "call")()
        except Failed as failed:
            return failed
        await client.close()
        return None

    outcomes = connects_at_once(one, seed=22)
    # Refused, or (the shortest timeouts, on a busy machine) no answer in time: exit 3.
    assert all(isinstance(o, Failed) and o.code == 3 for o in outcomes), outcomes
    assert any("authorization refused" in str(o) for o in outcomes), outcomes


def test_refused_creds_end_the_library_connect_every_time(revoked: tuple[str, Path]) -> None:
    url, kept = revoked

    async def one(timeout: float) -> BaseException | None:
        try:
            client = await GatewayClient.connect(url, kept, connect_timeout=timeout)
        except ConnectFailed as failed:
            return failed
        await client.close()
        return None

    outcomes = connects_at_once(one, seed=26)
    assert all(isinstance(o, ConnectFailed) for o in outcomes), outcomes
    assert any("authorization refused" in str(o) for o in outcomes), outcomes
