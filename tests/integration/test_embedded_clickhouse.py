"""The embedded ClickHouse HTTP server (chdb-core) run as a child process."""

from __future__ import annotations

import base64
import json
import os
import signal
import urllib.error
import urllib.parse
import urllib.request

import clickhouse_connect
import pytest

from toolgate.stack.clickhouse_server import (
    ClickHouseServerError,
    EmbeddedClickHouse,
    free_port,
)


def _admin(ch: EmbeddedClickHouse) -> tuple[str, str]:
    parts = urllib.parse.urlsplit(ch.url_for("admin"))
    return urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or "")


# clickhouse-local's `default` database also reads files, which no toolgate user may.
DATABASE = "engine_checks"


def _client(ch: EmbeddedClickHouse):
    user, password = _admin(ch)
    login = {"X-ClickHouse-User": user, "X-ClickHouse-Key": password}
    clickhouse_connect.get_client(host=ch.host, port=ch.port, headers=login).command(
        f"CREATE DATABASE IF NOT EXISTS {DATABASE}"
    )
    return clickhouse_connect.get_client(
        host=ch.host, port=ch.port, headers=login, database=DATABASE
    )


def _http(ch: EmbeddedClickHouse, sql: str) -> bytes:
    user, password = _admin(ch)
    req = urllib.request.Request(
        f"{ch.url}/?database={DATABASE}&query={urllib.parse.quote(sql)}",
        headers={"X-ClickHouse-User": user, "X-ClickHouse-Key": password},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    ch = EmbeddedClickHouse(tmp_path_factory.mktemp("clickhouse"))
    ch.start()
    yield ch
    assert ch.stop() == 0


def test_json_mergetree_roundtrip(server):
    client = _client(server)
    client.command(
        "CREATE TABLE events (id UInt64, kind LowCardinality(String), body JSON) "
        "ENGINE = MergeTree ORDER BY id"
    )
    rows = [
        (i, f"k{i % 3}", {"n": i, "tags": ["a", "b"], "nested": {"s": f"v{i}"}})
        for i in range(10_000)
    ]
    summary = client.insert("events", rows, column_names=["id", "kind", "body"])
    assert summary.written_rows == 10_000

    count, total, distinct_kinds = client.query(
        "SELECT count(), sum(body.n::UInt64), uniqExact(kind) FROM events"
    ).result_rows[0]
    assert (count, total, distinct_kinds) == (10_000, sum(range(10_000)), 3)

    (body,) = client.query("SELECT body FROM events WHERE id = 4242").result_rows[0]
    assert body["nested"]["s"] == "v4242"
    assert body["tags"] == ["a", "b"]
    assert int(body["n"]) == 4242


def test_raw_http(server):
    with urllib.request.urlopen(f"{server.url}/ping", timeout=10) as r:
        assert r.read() == b"Ok.\n"
    # Plain HTTP without a FORMAT gets TabSeparated, as from any ClickHouse server.
    assert _http(server, "SELECT 1") == b"1\n"
    user, password = _admin(server)
    req = urllib.request.Request(
        f"{server.url}/",
        data=b"SELECT 40 + 2 FORMAT JSONEachRow",
        headers={"X-ClickHouse-User": user, "X-ClickHouse-Key": password},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read()) == {"plus(40, 2)": 42}


def _as(ch: EmbeddedClickHouse, sql: str, headers: dict[str, str], query: str = "") -> str:
    """What the server answers (an error's body too) to `sql` sent with these headers."""
    req = urllib.request.Request(f"{ch.url}/{query}", data=sql.encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return f"{r.status} {r.read().decode()}"
    except urllib.error.HTTPError as exc:
        return f"{exc.code} {exc.read().decode()}"


def test_default_reaches_nothing_over_http(server):
    """ClickHouse's passwordless `default` (the engine's own session) cannot stop the
    listener, read toolgate's tables or run anything else over HTTP, however it is named."""
    user, password = _admin(server)
    _client(server).command(
        "CREATE TABLE IF NOT EXISTS secrets (s String) ENGINE = MergeTree ORDER BY s"
    )
    basic_default = {"Authorization": "Basic " + base64.b64encode(b"default:").decode()}
    basic_admin = {"Authorization": "Basic " + base64.b64encode(f"{user}:".encode()).decode()}
    for headers, query in [
        ({}, ""),  # no login: ClickHouse takes it as `default`
        ({}, "?user=default&password="),
        (basic_default, ""),
        ({"X-ClickHouse-User": "default", "X-ClickHouse-Key": ""}, ""),
        (basic_admin, "?user=default"),  # the URL's user would win over Basic auth
        ({"X-ClickHouse-User": user}, "?user=default"),
        ({"X-ClickHouse-User": user, **basic_default}, ""),
    ]:
        for sql in (
            "SYSTEM STOP LISTEN HTTP",
            "SYSTEM START LISTEN HTTP",
            f"SELECT count() FROM {DATABASE}.secrets",
            "SELECT name FROM system.tables",
            "SELECT 1",
        ):
            answer = _as(server, sql, headers, query)
            assert answer.startswith("403 "), (headers, query, sql, answer)
    with urllib.request.urlopen(f"{server.url}/ping", timeout=10) as r:  # still listening
        assert r.read() == b"Ok.\n"
    admin = {"X-ClickHouse-User": user, "X-ClickHouse-Key": password}
    assert _as(server, "SELECT currentUser()", admin) == f"200 {user}\n"


def test_url_and_port(server):
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert server.running()
    assert server.rss_bytes() > 0


def _write_rows(ch: EmbeddedClickHouse, start: int, n: int) -> None:
    client = _client(ch)
    client.command(
        "CREATE TABLE IF NOT EXISTS kept (id UInt64, body JSON) ENGINE = MergeTree ORDER BY id"
    )
    client.insert(
        "kept", [(i, {"i": i}) for i in range(start, start + n)], column_names=["id", "body"]
    )
    client.close()


def _count(ch: EmbeddedClickHouse) -> int:
    return int(_http(ch, "SELECT count() FROM kept"))


def test_data_survives_stop_and_restart(tmp_path):
    first = EmbeddedClickHouse(tmp_path)
    with first:
        _write_rows(first, 0, 1_000)
        # an idle keep-alive connection must not turn the stop into a forced exit
        _client(first).query("SELECT 1")
    assert first.proc is None  # stopped by the context manager
    assert not (tmp_path / "data" / "status").exists()  # clean shutdown removes it

    second = EmbeddedClickHouse(tmp_path)
    with second:
        assert _count(second) == 1_000
        _write_rows(second, 1_000, 500)
        assert _count(second) == 1_500


def test_data_survives_sigkill_and_restart(tmp_path):
    first = EmbeddedClickHouse(tmp_path).start()
    _write_rows(first, 0, 2_000)
    assert first.kill() == -signal.SIGKILL
    # The status file is left behind, but it is not a lock: the next start takes over.
    assert (tmp_path / "data" / "status").exists()

    second = EmbeddedClickHouse(tmp_path).start()
    try:
        assert _count(second) == 2_000
        _write_rows(second, 2_000, 10)
        assert _count(second) == 2_010
    finally:
        assert second.stop() == 0


def test_stop_leaves_no_process(tmp_path):
    ch = EmbeddedClickHouse(tmp_path).start()
    pid = ch.pid
    assert os.getpgid(pid) == pid  # own process group / session
    assert ch.stop() == 0
    assert _gone(pid)
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)  # nothing left in its process group either
    assert ch.stop() is None  # idempotent


def test_second_server_on_same_data_dir_is_refused(server):
    other = EmbeddedClickHouse(server.data_dir)
    with pytest.raises(ClickHouseServerError, match="Another server instance"):
        other.start()
    assert not other.running()
    assert _http(server, "SELECT 1") == b"1\n"  # the first one is unaffected


def test_busy_port_is_refused(server, tmp_path):
    with pytest.raises(ClickHouseServerError, match="already in use"):
        EmbeddedClickHouse(tmp_path, port=server.port).start()


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
