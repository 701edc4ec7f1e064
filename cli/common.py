"""What every command shares: a failure as one line with its exit code, the checks of
what a command line gives (NATS URL, call_id, port, creds file), and a NATS connection
that either comes within its timeout or fails in that one line (and, for a command that
runs for long, keeps reconnecting and says so in one line)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from toolgate.runtime import settings as env

NATS_SCHEMES = ("nats", "tls", "ws", "wss")


CONNECT_TIMEOUT_S = 5.0


class Failed(Exception):
    """A command cannot go on: `str()` is the one line to print, `code` the exit status."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(line)
        self.code = code


def check_nats_url(url: str, flag: str = "--nats-url") -> str:
    """`url` if it can name a NATS server (or, comma-separated, a cluster's nodes);
    else Failed (exit 2)."""
    for one in url.split(",") or [url]:
        parts = urlsplit(one if "://" in one else f"nats://{one}")
        try:
            parts.port  # noqa: B018 (raises on a port that is not a number)
        except ValueError:
            parts = parts._replace(netloc="")
        if parts.scheme not in NATS_SCHEMES or not parts.hostname:
            raise Failed(f"{url!r} is not a NATS URL: expected nats://HOST:PORT ({flag})", 2)
    return url


def check_call_id(call_id: str, command: str, flag: str) -> str:
    """`call_id` if it can name a result subject; else Failed (exit 2)."""
    from toolgate.contracts.calls import is_valid_call_id

    if not is_valid_call_id(call_id):
        raise Failed(
            f"{command}: {call_id!r} is not a call_id: 1 to 128 letters, digits, _ or - "
            f"(it names the result subject; {flag})",
            2,
        )
    return call_id


def check_port(port: int, flag: str) -> int:
    """`port` if a server can listen on it (0: any free port); else Failed (exit 2)."""
    if not 0 <= port <= 65535:
        raise Failed(f"{flag} {port} is not a TCP port: 1 to 65535, or 0 for any free port", 2)
    return port


def check_creds(path: Path | None, flag: str = "--creds") -> Path | None:
    """`path` if it is a readable NATS creds file (or None); else Failed (exit 2)."""
    if path is None:
        return None
    from toolgate.runtime.creds import read_creds

    try:
        read_creds(Path(path).read_text())
    except IsADirectoryError:
        raise Failed(f"{path} is a directory, not a NATS creds file ({flag})", 2) from None
    except FileNotFoundError:
        raise Failed(
            f"no creds file at {path} ({flag}; `toolgate agents list` shows the agents' creds)", 2
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise Failed(f"cannot read the creds file {path}: {exc} ({flag})", 2) from None
    except ValueError:
        raise Failed(
            f"{path} is not a NATS creds file (user JWT and nkey seed) ({flag})", 2
        ) from None
    return Path(path)


def nats_url_source(url: str) -> str:
    """Where --nats-url came from, for a message that says what was tried."""
    if os.environ.get("TOOLGATE_NATS_URL") == url:
        return "$TOOLGATE_NATS_URL"
    recorded = env.read_context().get("nats_url")
    if recorded == url:
        return f"recorded by `toolgate up` in {_context_path()}"
    if url == env.DEFAULT_NATS_URL and recorded is None:
        return f"the default: no `toolgate up` recorded one in {_context_path()}"
    return "--nats-url"


def _context_path() -> Path:
    """DATA_DIR/context.json: where every default of this command line came from."""
    return env.env_data_dir() / env.CONTEXT_FILE


def _nobody_up_here(url: str) -> Failed:
    """Refused at the default URL with no context: another gateway's NATS (or not toolgate's)."""
    return Failed(
        f"authorization refused at {url}: no `toolgate up` is recorded in "
        f"{_context_path()}, so the NATS at {url} belongs to another gateway or is not "
        "toolgate's: run this from the folder where that gateway's `toolgate up` ran, or "
        "give --data-dir DIR (or --nats-url and --creds)",
        2,
    )


def connect_failure(url: str, cause: BaseException | str) -> Failed:
    """The one line for a NATS that is not there or says no, exit 3."""
    text = str(cause) or type(cause).__name__
    lowered = text.lower()
    if "authorization" in lowered or "authentication" in lowered or "revoked" in lowered:
        if not env.read_context() and nats_url_source(url).startswith("the default"):
            return _nobody_up_here(url)
        return Failed(
            f"authorization refused at {url}: wrong, revoked or missing creds (--creds)", 3
        )
    if "permissions violation" in lowered:
        return Failed(
            f"permission denied at {url}: {text.removeprefix('nats: ')} (these "
            "creds may not do this: --creds)",
            3,
        )
    if isinstance(cause, TimeoutError) or lowered in ("timeouterror", "nats: timeout"):
        reason = "nothing answered as NATS in time"
    elif "refused" in lowered or "connect call failed" in lowered:
        reason = "connection refused"
    elif "name or service not known" in lowered or "nodename nor servname" in lowered:
        reason = "unknown host"
    else:
        reason = text.removeprefix("nats: ")
    return Failed(
        f"no NATS at {url} ({reason}; URL from {nats_url_source(url)}): is "
        "toolgate up running? (--nats-url)",
        3,
    )


async def connect_nats(url: str, creds: Path | None, timeout: float, **options: Any) -> Any:
    """One NATS connection within `timeout`, or Failed: for a command that runs once."""
    from toolgate.runtime.creds import connect_options
    from toolgate.runtime.first_connect import FirstConnectFailed, first_connect

    async def quiet(exc: Exception) -> None:  # instead of nats-py's tracebacks
        pass

    options = {
        "connect_timeout": timeout,
        "allow_reconnect": False,
        "error_cb": quiet,
        **connect_options(creds),
        **options,
    }
    # Bounded by itself, even with unlimited reconnects (runtime/first_connect.py).
    try:
        return await first_connect(url, options, timeout)
    except FirstConnectFailed as failed:
        raise connect_failure(url, failed.cause) from None


class _OneLineNatsErrors(logging.Filter):
    """A long-running service logs a NATS it cannot reach as one line, not a traceback
    per attempt (it keeps reconnecting); the same line at most every 30 s."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self.last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        import nats.errors

        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, (OSError, TimeoutError, nats.errors.Error)):
            return True
        line = f"{connect_failure(self.url, exc)}; reconnecting"
        now = time.monotonic()
        if now - self.last.get(line, -1e9) < 30:
            return False
        self.last[line] = now
        record.msg, record.args, record.exc_info, record.exc_text = line, None, None, None
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_nats_tracebacks(url: str) -> None:
    one_line = _OneLineNatsErrors(url)
    for handler in logging.getLogger().handlers:
        handler.addFilter(one_line)
