"""Where ClickHouse is, and a clickhouse-connect client for it.

A URL names everything: ``http[s]://[user[:password]@]host[:port][/database]``.
The database defaults to ``toolgate``; the same code talks to the embedded
server and to a real deployment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

if TYPE_CHECKING:  # clickhouse_connect is imported only when a client is made: the CLI stays fast
    from clickhouse_connect.driver.client import Client

DEFAULT_CLICKHOUSE_URL = "http://127.0.0.1:8123/toolgate"
DEFAULT_DATABASE = "toolgate"


def env_clickhouse_url() -> str:
    """$TOOLGATE_CLICKHOUSE_URL, else what `toolgate up` recorded, else the default."""
    from toolgate.runtime.settings import env_clickhouse_url_or_none

    return env_clickhouse_url_or_none() or DEFAULT_CLICKHOUSE_URL


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
        return cls(host=parts.hostname or "127.0.0.1",
                   port=parts.port or (8443 if secure else 8123), database=database,
                   username=unquote(parts.username or "default"),
                   password=unquote(parts.password or ""), secure=secure)

    def client(self, with_database: bool = True, **settings: object) -> Client:
        import clickhouse_connect

        # No session id: the sink inserts from a worker thread, and ClickHouse
        # refuses concurrent queries within one session.
        return clickhouse_connect.get_client(
            host=self.host, port=self.port, username=self.username, password=self.password,
            database=self.database if with_database else "", secure=self.secure,
            autogenerate_session_id=False, connect_timeout=5, send_receive_timeout=60,
            settings=settings or None)

    def display(self) -> str:
        scheme = "https" if self.secure else "http"
        return f"{scheme}://{self.host}:{self.port}/{self.database}"


def connect(url: str, **settings: object) -> Client:
    return ClickHouseTarget.from_url(url).client(True, **settings)
