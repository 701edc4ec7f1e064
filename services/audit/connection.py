"""Where ClickHouse is, and a clickhouse-connect client for it.

A URL names everything: ``http[s]://[user[:password]@]host[:port][/database]``.
The database defaults to ``toolgate``; the same code talks to the embedded
server and to a real deployment.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlsplit, urlunsplit

if TYPE_CHECKING:  # clickhouse_connect is imported only when a client is made: the CLI stays fast
    from clickhouse_connect.driver.client import Client

DEFAULT_CLICKHOUSE_URL = "http://127.0.0.1:8123/toolgate"
DEFAULT_DATABASE = "toolgate"


def env_clickhouse_url() -> str:
    """$TOOLGATE_CLICKHOUSE_URL, else what `toolgate up` recorded, else the default."""
    from toolgate.runtime.settings import env_clickhouse_url_or_none

    return env_clickhouse_url_or_none() or DEFAULT_CLICKHOUSE_URL


def login_url(url: str, role: str, data_dir: Path | None = None) -> str:
    """`url` logging in as `role` (writer, auditor, admin) with the password `toolgate up`
    generated, when the URL names no user and is the server that `toolgate up` recorded
    (a password is never sent anywhere else); else `url` as it is."""
    from toolgate.runtime.settings import clickhouse_login, read_context

    parts = urlsplit(url if "://" in url else f"http://{url}")
    recorded = read_context(data_dir).get("clickhouse_url")
    if parts.username or not isinstance(recorded, str):
        return url
    if urlsplit(recorded).netloc != parts.netloc:
        return url
    login = clickhouse_login(role, data_dir)
    if login is None:
        return url
    user, password = (quote(x, safe="") for x in login)
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{parts.netloc}"))


@dataclass(frozen=True)
class ClickHouseTarget:
    host: str
    port: int
    database: str
    username: str
    password: str
    secure: bool

    @classmethod
    def from_url(cls, url: str) -> ClickHouseTarget:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"{url}: a ClickHouse URL is http:// or https://")
        secure = parts.scheme == "https"
        database = parts.path.strip("/") or DEFAULT_DATABASE
        if not database.replace("_", "").isalnum():
            raise ValueError(f"{url}: database name {database!r} must be letters, digits, _")
        return cls(
            host=parts.hostname or "127.0.0.1",
            port=parts.port or (8443 if secure else 8123),
            database=database,
            username=unquote(parts.username or "default"),
            password=unquote(parts.password or ""),
            secure=secure,
        )

    def client(self, with_database: bool = True, **settings: object) -> Client:
        return self.patient_client(60.0, with_database, **settings)

    def patient_client(
        self, answer_within_s: float, with_database: bool = True, **settings: object
    ) -> Client:
        """A client that waits `answer_within_s` for a query's answer (`client`: a minute)."""
        import clickhouse_connect

        # No session id: the sink inserts from a worker thread, and ClickHouse
        # refuses concurrent queries within one session. The login goes in the
        # X-ClickHouse-User/Key headers, not Basic auth: every ClickHouse takes them, and
        # the embedded server answers nothing else (stack/clickhouse_access.py).
        return clickhouse_connect.get_client(
            host=self.host,
            port=self.port,
            username=None,
            password="",
            headers={"X-ClickHouse-User": self.username, "X-ClickHouse-Key": self.password},
            database=self.database if with_database else "",
            secure=self.secure,
            autogenerate_session_id=False,
            connect_timeout=5,
            send_receive_timeout=answer_within_s,
            settings=settings or None,
        )

    def display(self) -> str:
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.host}:{self.port}/{self.database}"


def connect(url: str, **settings: object) -> Client:
    return ClickHouseTarget.from_url(url).client(True, **settings)


# -- failing clearly ---------------------------------------------------------------------
# Exit codes of the operator commands (see cli/main.py): 2 bad input or configuration,
# 3 could not reach a server.
BAD_CONFIG = 2
UNREACHABLE = 3
DEFAULT_CONNECT_TIMEOUT_S = 5.0
_AUTH_CODES = {192, 193, 194, 516}  # UNKNOWN_USER, WRONG_PASSWORD, REQUIRED_PASSWORD, AUTH_FAILED
_UNKNOWN_DATABASE, _UNKNOWN_TABLE = 81, 60


class StoreError(Exception):
    """An audit command cannot use the ClickHouse it was pointed at. The message is one
    line saying what was tried and what to do; `exit_code` is BAD_CONFIG or UNREACHABLE."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(one_line(message))
        self.exit_code = exit_code


def one_line(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def server_text(exc: BaseException) -> str:
    """What ClickHouse said, without the driver's wrapping, version and URL trailers."""
    text = str(exc)
    if "DB::Exception:" in text:
        text = text.split("DB::Exception:", 1)[1]
    text = re.sub(r"\s*\((?:version [^)]*\)?|for url [^)]*)\)", "", text)
    text = re.sub(r"HTTPConnectionPool\([^)]*\): ", "", text)
    text = re.sub(r"(?:url: )?/\?query_id=[\w-]+ ", "", text)
    # The parts that repeat the query or list every token the parser would take.
    text = re.sub(r"(?s)\s*(?:FORMAT Native\.\s*)?Expected one of:.*?(?=\([A-Z_]+\)|$)", " ", text)
    text = re.sub(r"(?s)\s*In scope .*?(?=\([A-Z_]+\)\s*$|$)", " ", text)
    text = re.sub(r"^Error (.*) executing HTTP request attempt \d+ \([^)]*\)$", r"\1", text.strip())
    return one_line(text.strip(), 300)


@dataclass(frozen=True)
class Store:
    """Where an operator command looks for the audit: the URL and where it came from."""

    url: str
    source: str  # "--clickhouse-url", "$TOOLGATE_CLICKHOUSE_URL", the context file, ...
    hint: str = "check the URL"  # what to do when nothing answers there

    def target(self) -> ClickHouseTarget:
        try:
            return ClickHouseTarget.from_url(self.url)
        except ValueError as exc:
            raise StoreError(
                f"{exc} (from {self.source}): give a URL such as "
                "--clickhouse-url http://127.0.0.1:8123/toolgate",
                BAD_CONFIG,
            ) from None

    def open(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S, **settings: object) -> Client:
        """A client, once a ClickHouse answered within `timeout_s`; else StoreError."""
        target = self.target()
        self.probe(target, timeout_s)
        try:
            return target.client(True, **settings)
        except Exception as exc:
            raise self.explain(exc, target) from None

    def probe(self, target: ClickHouseTarget, timeout_s: float) -> None:
        """GET /ping (no login needed): tells "nothing there" from "not ClickHouse" quickly,
        where the driver would wait out its read timeout on a silent port."""
        import http.client
        import socket
        import urllib.error
        import urllib.request

        scheme = "https" if target.secure else "http"
        where = f"{target.display()} (from {self.source})"
        try:
            with urllib.request.urlopen(
                f"{scheme}://{target.host}:{target.port}/ping", timeout=timeout_s
            ) as response:
                said = response.read(64)
        except urllib.error.HTTPError as exc:
            raise StoreError(
                f"{where} answered HTTP {exc.code} to /ping: not a ClickHouse "
                f"HTTP port; {self.hint}",
                UNREACHABLE,
            ) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, ConnectionRefusedError):
                why = "connection refused"
            elif isinstance(reason, socket.gaierror):
                why = f"cannot resolve host {target.host!r}"
            elif isinstance(reason, TimeoutError):
                why = f"no answer within {timeout_s:g} s"
            elif isinstance(exc, http.client.HTTPException):
                why = f"something answered, not in HTTP ({type(exc).__name__})"
            else:
                why = one_line(str(reason) or type(reason).__name__, 200)
            raise StoreError(
                f"no ClickHouse answered at {where}: {why}; {self.hint}", UNREACHABLE
            ) from None
        if not said.startswith(b"Ok."):
            raise StoreError(
                f"{where} answered /ping with {said[:20]!r}: not a ClickHouse "
                f"HTTP port; {self.hint}",
                UNREACHABLE,
            )

    def explain(self, exc: BaseException, target: ClickHouseTarget | None = None) -> StoreError:
        """A driver error as one line and an exit code."""
        from clickhouse_connect.driver.exceptions import Error, OperationalError

        target = target or self.target()
        where = f"{target.display()} (from {self.source})"
        if isinstance(exc, StoreError):
            return exc
        code = getattr(exc, "code", None)
        if isinstance(exc, OperationalError) or not isinstance(exc, Error):
            return StoreError(
                f"lost ClickHouse at {where}: {server_text(exc)}; {self.hint}", UNREACHABLE
            )
        if code == _UNKNOWN_DATABASE:
            return StoreError(
                f"ClickHouse at {where} has no database {target.database!r}: the audit "
                "database is the URL's path (`toolgate up` audits into /toolgate, created "
                "when the audit sink starts)",
                BAD_CONFIG,
            )
        if code == _UNKNOWN_TABLE:
            return StoreError(
                f"no audit tables in {where} ({server_text(exc).split('. ')[0]}): the audit "
                "sink creates "
                "them when it starts (`toolgate up`, `toolgate serve audit`), or run "
                "`toolgate audit schema`",
                BAD_CONFIG,
            )
        if code in _AUTH_CODES:
            return StoreError(
                f"ClickHouse at {where} refused user {target.username!r}: "
                f"{server_text(exc)} (user and password go in the URL: "
                "http://USER:PASSWORD@HOST:PORT/DATABASE)",
                BAD_CONFIG,
            )
        return StoreError(f"ClickHouse at {where} refused: {server_text(exc)}", BAD_CONFIG)

    @contextmanager
    def errors(self) -> Iterator[None]:
        """Driver errors of the queries inside, as StoreError."""
        from clickhouse_connect.driver.exceptions import Error

        try:
            yield
        except (Error, OSError) as exc:
            raise self.explain(exc) from None
