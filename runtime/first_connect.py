"""The first connect to NATS, ended within its timeout by itself.

Used by the client library (GatewayClient.connect) and the CLI (cli/common.py
connect_nats); each turns a failure into its own error.

Unlimited reconnects start with as many attempts as fill `timeout`, unlimited again
once connected. `asyncio.wait_for` alone is no bound: on Python 3.11 its cancellation
of nats-py's connect loop is lost when it lands as one of nats-py's inner wait_fors
completes, and the loop then retries refused creds for ever. And nats-py returns a
client that never had its PONG when the server closes the socket in the login (a
refused login whose -ERR went with the socket): that is no connection; tried again
within `timeout`.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

import nats
import nats.aio.client
import nats.errors
from nats.aio.client import Client

from toolgate.runtime.creds import nats_servers

# nats-py's own default wait between reconnect attempts.
RECONNECT_WAIT_S = 2.0


class FirstConnectFailed(Exception):
    """No connection within the timeout; `cause` is what to tell (the refusal, if any)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


def login_refusal(errors: list[Exception]) -> Exception | None:
    """The server's refusal of the login among nats-py's errors (a refused login often
    ends in a reset connection: the refusal is the news), else the last error."""
    refused = [e for e in errors if "authoriz" in str(e).lower() or "authentic" in str(e).lower()]
    return refused[-1] if refused else errors[-1] if errors else None


async def first_connect(url: str, options: dict[str, Any], timeout: float) -> Client:
    """Connected within `timeout`, or FirstConnectFailed. What nats-py reports while
    connecting is read for the login's refusal; the options' error_cb (else nats-py's
    own, which logs) is told everything, then as before (nothing is kept after)."""
    errors: list[Exception] = []
    told = options.get("error_cb") or nats.aio.client._default_error_callback

    async def error_cb(exc: Exception) -> None:
        if connecting:
            errors.append(exc)
        await told(exc)

    connecting = True
    try:
        return await _connect({**options, "error_cb": error_cb}, url, timeout, errors)
    finally:
        connecting = False


async def _connect(
    options: dict[str, Any], url: str, timeout: float, errors: list[Exception]
) -> Client:
    unlimited = bool(options.get("allow_reconnect", True)) and (
        options.get("max_reconnect_attempts", 0) < 0
    )
    if unlimited:
        between = max(float(options.get("reconnect_time_wait", RECONNECT_WAIT_S)), 0.01)
        options = {**options, "max_reconnect_attempts": math.ceil(timeout / between) + 1}
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            nc = await asyncio.wait_for(
                nats.connect(nats_servers(url), **options), max(deadline - loop.time(), 0.01)
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            raise FirstConnectFailed(login_refusal(errors) or exc) from None
        if nc.is_connected:
            break
        await nc.close()
        if loop.time() >= deadline:
            cause = ConnectionError("the server closed the connection during the login")
            raise FirstConnectFailed(login_refusal(errors) or cause)
    if unlimited:
        nc.options["max_reconnect_attempts"] = -1  # once connected, it reconnects forever
    return nc
