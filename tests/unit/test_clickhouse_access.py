"""The embedded server's users and the same users as DDL for an external server."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

from toolgate.runtime.settings import clickhouse_login, write_context
from toolgate.stack.clickhouse_access import (
    LOGINS_FILE,
    access_ddl,
    ensure_logins,
    grants,
    users_xml,
    with_login,
)

ACCESS_DIR = Path(__file__).resolve().parents[2] / "infra" / "clickhouse" / "access"


def test_the_shipped_ddl_is_what_the_code_renders() -> None:
    assert (ACCESS_DIR / "users_single.sql").read_text() == access_ddl()
    assert (ACCESS_DIR / "users_cluster.sql").read_text() == access_ddl(cluster="${cluster}")


def test_the_writer_only_inserts_and_the_auditor_only_reads() -> None:
    writer = " ".join(grants("writer", "toolgate"))
    assert "INSERT ON `toolgate`.event_log" in writer
    assert "SELECT ON `toolgate`.event_log" not in writer
    assert all(word not in writer for word in ("ALTER", "DELETE", "TRUNCATE", "KILL", "FILE"))
    auditor = " ".join(grants("auditor", "toolgate"))
    assert auditor == "GRANT SELECT, SHOW TABLES ON `toolgate`.* TO toolgate_auditor"
    for role in ("writer", "auditor", "admin"):
        text = " ".join(grants(role, "toolgate"))
        assert "KILL" not in text and "CREATE TEMPORARY TABLE" not in text
        assert "READ" not in text and "SYSTEM" not in text


def test_logins_are_generated_once_private_and_kept(tmp_path: Path) -> None:
    first = ensure_logins(tmp_path)
    assert set(first) == {"admin", "writer", "auditor"} and len(set(first.values())) == 3
    assert stat.S_IMODE((tmp_path / LOGINS_FILE).stat().st_mode) == 0o600
    assert ensure_logins(tmp_path) == first
    xml = users_xml(first, "toolgate")
    for password in first.values():
        assert password not in xml
        assert hashlib.sha256(password.encode()).hexdigest() in xml
    # `default` keeps its login (the engine needs it) with nothing but the listener
    default = xml.split("<users>", 1)[1].split("</default>", 1)[0]
    assert "GRANT SYSTEM LISTEN ON *.*" in default and "SELECT ON system.numbers" in default


def test_services_and_commands_find_their_login_through_the_context(tmp_path: Path) -> None:
    logins = ensure_logins(tmp_path / "clickhouse")
    write_context(
        tmp_path,
        {
            "clickhouse_url": "http://127.0.0.1:8123/toolgate",
            "clickhouse_logins": str(tmp_path / "clickhouse" / LOGINS_FILE),
        },
    )
    assert clickhouse_login("writer", tmp_path) == ("toolgate_writer", logins["writer"])
    assert clickhouse_login("nobody", tmp_path) is None
    url = with_login("http://127.0.0.1:8123/toolgate", "auditor", "p/w@x")
    assert url == "http://toolgate_auditor:p%2Fw%40x@127.0.0.1:8123/toolgate"
    assert with_login("http://someone:pw@h:1/db", "writer", "x") == "http://someone:pw@h:1/db"


def test_a_login_is_sent_only_to_the_server_up_recorded(tmp_path: Path) -> None:
    from toolgate.services.audit.connection import login_url

    logins = ensure_logins(tmp_path / "clickhouse")
    write_context(
        tmp_path,
        {
            "clickhouse_url": "http://127.0.0.1:8123/toolgate",
            "clickhouse_logins": str(tmp_path / "clickhouse" / LOGINS_FILE),
        },
    )
    mine = login_url("http://127.0.0.1:8123/toolgate", "auditor", tmp_path)
    assert mine == f"http://toolgate_auditor:{logins['auditor']}@127.0.0.1:8123/toolgate"
    elsewhere = login_url("http://ch.example:8123/toolgate", "auditor", tmp_path)
    assert elsewhere == "http://ch.example:8123/toolgate"
