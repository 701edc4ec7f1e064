"""Operator commands: where the audit is looked for, and failures as one line (no servers)."""

from __future__ import annotations

import argparse
import json

import pytest
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from toolgate.cli.audit import Failed, data_dir_of, register, since_of, store_of
from toolgate.services.audit.connection import (
    BAD_CONFIG,
    DEFAULT_CLICKHOUSE_URL,
    UNREACHABLE,
    Store,
    StoreError,
    server_text,
)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    for name in ("TOOLGATE_CLICKHOUSE_URL", "TOOLGATE_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_context(directory, url):  # type: ignore[no-untyped-def]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "context.json").write_text(json.dumps({"clickhouse_url": url}))


def test_the_store_comes_from_flag_then_variable_then_context_then_default(clean_env, monkeypatch):
    default = store_of(None)
    assert default.url == DEFAULT_CLICKHOUSE_URL and default.source.startswith("the default")
    assert str(clean_env / ".toolgate" / "context.json") in default.source
    write_context(clean_env / ".toolgate", "http://127.0.0.1:9/recorded")
    recorded = store_of(None)
    assert recorded.url == "http://127.0.0.1:9/recorded"
    assert "context.json, written by `toolgate up`" in recorded.source
    monkeypatch.setenv("TOOLGATE_CLICKHOUSE_URL", "http://127.0.0.1:9/env")
    assert (store_of(None).url, store_of(None).source) == (
        "http://127.0.0.1:9/env",
        "$TOOLGATE_CLICKHOUSE_URL",
    )
    assert (store_of("http://h:1/f").url, store_of("http://h:1/f").source) == (
        "http://h:1/f",
        "--clickhouse-url",
    )


def test_a_given_data_dir_has_the_context_to_use(clean_env):
    write_context(clean_env / "elsewhere", "http://127.0.0.1:9/there")
    assert store_of(None).url == DEFAULT_CLICKHOUSE_URL
    assert store_of(None, clean_env / "elsewhere").url == "http://127.0.0.1:9/there"


def test_data_dir_and_where_it_came_from(clean_env, monkeypatch):
    assert data_dir_of(None)[1].startswith("the default")
    monkeypatch.setenv("TOOLGATE_DATA_DIR", str(clean_env / "d"))
    assert data_dir_of(None) == (clean_env / "d", "$TOOLGATE_DATA_DIR")
    assert data_dir_of(clean_env / "x") == (clean_env / "x", "--data-dir")


def test_a_bad_url_is_bad_configuration():
    with pytest.raises(StoreError) as raised:
        Store("ftp://somewhere/db", "--clickhouse-url").target()
    assert raised.value.exit_code == BAD_CONFIG
    assert "http:// or https://" in str(raised.value) and "(from --clickhouse-url)" in str(
        raised.value
    )


@pytest.mark.parametrize(
    ("code", "exit_code", "phrase"),
    [
        (81, BAD_CONFIG, "has no database 'toolgate'"),
        (60, BAD_CONFIG, "no audit tables in"),
        (516, BAD_CONFIG, "refused user 'default'"),
        (241, BAD_CONFIG, "refused: Memory limit"),
    ],
)
def test_server_errors_become_one_line_with_what_to_do(code, exit_code, phrase):
    store = Store("http://127.0.0.1:8123/toolgate", "--clickhouse-url")
    text = (
        f"Received ClickHouse exception, code: {code}, server response: Code: {code}. "
        "DB::Exception: Memory limit\n exceeded. (X) (version 26.9.2.1) "
        "(for url http://127.0.0.1:8123)"
    )
    error = store.explain(DatabaseError(text, code=code))
    assert error.exit_code == exit_code and phrase in str(error), str(error)
    assert "\n" not in str(error) and "version 26" not in str(error)
    assert "http://127.0.0.1:8123/toolgate (from --clickhouse-url)" in str(error)


def test_a_lost_connection_is_unreachable():
    store = Store("http://127.0.0.1:8123/toolgate", "--clickhouse-url")
    error = store.explain(
        OperationalError(
            "Error ('Connection aborted.', RemoteDisconnected('closed')) executing HTTP request "
            "attempt 1 (http://127.0.0.1:8123)"
        )
    )
    assert error.exit_code == UNREACHABLE and str(error).startswith("lost ClickHouse at")
    assert "executing HTTP request" not in str(error)


def test_server_text_drops_what_repeats_the_query():
    syntax = (
        "Received ClickHouse exception, code: 62, server response: Code: 62. "
        "DB::Exception: Syntax error: failed at position 7 (1) (line 1, col 7): 1\n "
        "FORMAT Native. Expected one of: token sequence, Dot, token, OR, AND. "
        "(SYNTAX_ERROR) (version 26.9.2.1) (for url http://127.0.0.1:43029)"
    )
    assert (
        server_text(Exception(syntax))
        == "Syntax error: failed at position 7 (1) (line 1, col 7): 1 (SYNTAX_ERROR)"
    )
    unknown = (
        "Code: 47. DB::Exception: Unknown expression identifier `nope`. Maybe you meant: "
        "['note']. In scope SELECT nope FROM events. (UNKNOWN_IDENTIFIER) "
        "(version 26.9.2.1)"
    )
    assert (
        server_text(Exception(unknown))
        == "Unknown expression identifier `nope`. Maybe you meant: ['note']. (UNKNOWN_IDENTIFIER)"
    )


def test_a_bad_since_is_one_line():
    with pytest.raises(Failed) as raised:
        since_of("last tuesday")
    assert raised.value.exit_code == BAD_CONFIG and "\n" not in str(raised.value)
    assert str(raised.value).startswith("--since 'last tuesday' is not a time")
    assert since_of(None) is None


def test_a_bad_flag_is_one_line(capsys):
    parser = argparse.ArgumentParser(prog="toolgate")
    register(parser.add_subparsers(dest="command", required=True))
    with pytest.raises(SystemExit) as raised:
        parser.parse_args(["audit", "replay", "c1", "--limit", "many"])
    assert raised.value.code == BAD_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage" not in err
    assert err.startswith("toolgate audit replay: argument --limit: invalid int value: 'many'")
