"""`toolgate audit trace|sql|replay|verify` and `toolgate policy test` fail in one line.

Against real servers: the embedded ClickHouse (wrong database, no tables, wrong
user, a refused query), a real nats-server on the ClickHouse URL's port, a port
that accepts and never answers, a port nobody listens on. Each failure is one
line on stderr naming what was tried and what to do, exit 2 (bad input or
configuration) or 3 (could not reach a server), and never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.test_audit_queries import record, stories
from toolgate.cli import audit as audit_cli
from toolgate.cli.main import main
from toolgate.services.audit import progress as progress_module
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR
from toolgate.stack.clickhouse_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
BUNDLE = str(DEFAULT_BUNDLE_DIR)
SINCE = "2026-03-01T08:00:00Z"  # before every recorded story


@pytest.fixture(scope="module")
def recorded(clickhouse_server, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A store with the auditor-query stories in it, and the seal key that signed them."""
    url = clickhouse_server.url_for("admin", "failures")
    keys = tmp_path_factory.mktemp("keys")
    asyncio.run(record(url, keys, stories()))
    return url, keys


@pytest.fixture
def nowhere(monkeypatch, tmp_path) -> str:  # type: ignore[no-untyped-def]
    """An empty folder with no context, no TOOLGATE_* variables; a URL nobody answers."""
    for name in [n for n in os.environ if n.startswith("TOOLGATE_")]:
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    return f"http://127.0.0.1:{free_port()}/toolgate"


@pytest.fixture
def silent_port() -> Iterator[int]:
    """Accepts connections and never says a word."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


def run(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str, command: str) -> str:
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"toolgate {command}: "), err
    assert "Traceback" not in err
    return err


def every_command(url: str, keys: Path) -> list[tuple[str, list[str]]]:
    """Each operator command that reads the audit, pointed at `url`."""
    at = ["--clickhouse-url", url]
    return [
        ("audit trace", ["audit", "trace", "ok-0", *at]),
        ("audit sql", ["audit", "sql", "SELECT count() FROM calls", *at]),
        ("audit replay", ["audit", "replay", "--since", "7d", *at]),
        ("audit verify", ["audit", "verify", "--public-key", str(keys / "audit-seal.pub"), *at]),
        ("policy test", ["policy", "test", BUNDLE, "--since", "7d", *at]),
    ]


# -- could not reach ClickHouse: exit 3 -------------------------------------------------------


def test_no_clickhouse_at_the_url(capsys, nowhere, recorded):
    for command, argv in every_command(nowhere, recorded[1]):
        code, out, err = run(capsys, *argv)
        assert (code, out) == (3, ""), (command, err)
        assert (
            f"no ClickHouse answered at {nowhere} (from --clickhouse-url): connection "
            "refused; check the URL" in one_line(err, command)
        )


def test_no_clickhouse_at_the_default_says_to_start_the_gateway(capsys, nowhere, monkeypatch):
    monkeypatch.setattr(audit_cli, "DEFAULT_CLICKHOUSE_URL", nowhere)
    code, _, err = run(capsys, "audit", "trace", "c1")
    assert code == 3
    line = one_line(err, "audit trace")
    assert (
        "(from the default: no --clickhouse-url, no $TOOLGATE_CLICKHOUSE_URL, no ClickHouse "
        f"recorded in {Path.cwd() / '.toolgate' / 'context.json'})" in line
    )
    assert "run `toolgate up` in this folder first" in line


def test_a_recorded_clickhouse_that_is_gone(capsys, nowhere, monkeypatch, tmp_path):
    """The context of a `toolgate up` that has stopped: the command says whose URL it was."""
    data = tmp_path / "state"
    data.mkdir()
    (data / "context.json").write_text(json.dumps({"clickhouse_url": nowhere}))
    monkeypatch.setenv("TOOLGATE_DATA_DIR", str(data))
    code, _, err = run(capsys, "policy", "test", BUNDLE)
    assert code == 3
    line = one_line(err, "policy test")
    assert f"(from {data / 'context.json'}, written by `toolgate up`)" in line
    assert "is that `toolgate up` still running?" in line
    monkeypatch.setenv("TOOLGATE_CLICKHOUSE_URL", "http://127.0.0.1:1/x")  # the variable wins
    code, _, err = run(capsys, "audit", "sql", "SELECT 1")
    assert code == 3 and "at http://127.0.0.1:1/x (from $TOOLGATE_CLICKHOUSE_URL)" in err


def test_a_port_that_never_answers_gives_up_at_the_connect_timeout(
    capsys, nowhere, silent_port, recorded
):
    url = f"http://127.0.0.1:{silent_port}/toolgate"
    for command, argv in every_command(url, recorded[1]):
        code, _, err = run(capsys, *argv, "--connect-timeout", "0.3")
        assert code == 3, (command, err)
        assert "no answer within 0.3 s" in one_line(err, command)


def test_a_port_that_is_not_clickhouse(capsys, nowhere, nats_server):
    code, _, err = run(
        capsys,
        "audit",
        "trace",
        "c1",
        "--clickhouse-url",
        f"http://127.0.0.1:{nats_server.port}/toolgate",
    )
    assert code == 3
    assert "something answered, not in HTTP" in one_line(err, "audit trace")


# -- bad configuration: exit 2 ----------------------------------------------------------------


def test_a_url_that_is_not_one(capsys, nowhere):
    code, _, err = run(capsys, "audit", "sql", "SELECT 1", "--clickhouse-url", "ftp://host/db")
    assert code == 2 and "a ClickHouse URL is http:// or https://" in one_line(err, "audit sql")


def test_no_such_database(capsys, nowhere, clickhouse_server, recorded):
    url = clickhouse_server.url_for("admin", "no_such_db")
    for command, argv in every_command(url, recorded[1]):
        code, _, err = run(capsys, *argv)
        assert code == 2, (command, err)
        assert (
            f"ClickHouse at {clickhouse_server.url}/no_such_db (from --clickhouse-url) has no "
            "database 'no_such_db'" in one_line(err, command)
        )


def test_a_database_without_the_audit_tables(capsys, nowhere, clickhouse_server, recorded):
    url = clickhouse_server.url_for("admin", "bare")
    ClickHouseTarget.from_url(url).client(with_database=False).command(
        "CREATE DATABASE IF NOT EXISTS bare"
    )
    for command, argv in every_command(url, recorded[1]):
        if command == "audit sql":
            continue  # a query of its own: ClickHouse's answer is the message (below)
        code, _, err = run(capsys, *argv)
        assert code == 2, (command, err)
        line = one_line(err, command)
        shown = f"{clickhouse_server.url}/bare"  # the password is never shown
        assert f"no audit tables in {shown}" in line and "`toolgate audit schema`" in line


def test_a_user_clickhouse_does_not_know(capsys, nowhere, clickhouse_server):
    url = clickhouse_server.url.replace("http://", "http://mallory:secret@") + "/failures"
    code, _, err = run(capsys, "audit", "trace", "c1", "--clickhouse-url", url)
    assert code == 2
    line = one_line(err, "audit trace")
    assert "refused user 'mallory'" in line and "secret" not in line


def test_a_query_clickhouse_refuses(capsys, nowhere, recorded):
    url = recorded[0]
    code, out, err = run(capsys, "audit", "sql", "SELEC tool FROM calls", "--clickhouse-url", url)
    assert (code, out) == (2, "")
    assert "ClickHouse refused the query: Syntax error" in one_line(err, "audit sql")
    code, _, err = run(capsys, "audit", "sql", "DROP TABLE event_log", "--clickhouse-url", url)
    assert code == 2 and "(audit sql is read-only)" in one_line(err, "audit sql")
    code, _, err = run(capsys, "audit", "sql", "  ", "--clickhouse-url", url)
    assert code == 2 and "give a query" in one_line(err, "audit sql")


def test_verify_outside_the_data_dir(capsys, nowhere, recorded, tmp_path):
    """It used to die with a FileNotFoundError traceback."""
    code, _, err = run(capsys, "audit", "verify", "--clickhouse-url", recorded[0])
    assert code == 2
    line = one_line(err, "audit verify")
    assert f"no audit seal public key at {Path.cwd() / '.toolgate/keys/audit-seal.pub'}" in line
    assert "no --data-dir, no $TOOLGATE_DATA_DIR" in line
    assert "give --data-dir DIR or --public-key FILE" in line
    bad = tmp_path / "not-a-key.pub"
    bad.write_text("hello")
    code, _, err = run(
        capsys, "audit", "verify", "--public-key", str(bad), "--clickhouse-url", recorded[0]
    )
    assert code == 2 and "is not a readable Ed25519 public key in PEM" in one_line(
        err, "audit verify"
    )


def test_bad_input(capsys, nowhere, recorded):
    url = ["--clickhouse-url", recorded[0]]
    cases = [
        (
            "audit replay",
            ["audit", "replay", "--since", "yesterday", *url],
            "--since 'yesterday' is not a time: give 90s, 30m, 24h, 7d or an ISO 8601 time",
        ),
        ("audit replay", ["audit", "replay", *url], "give a CALL_ID or --since"),
        ("audit replay", ["audit", "replay", "c1", "--limit", "0", *url], "--limit 0"),
        ("audit replay", ["audit", "replay", "c1", "--timeout", "0", *url], "--timeout 0"),
        (
            "audit trace",
            ["audit", "trace", "c1", "--connect-timeout", "-1", *url],
            "--connect-timeout -1",
        ),
        (
            "policy test",
            ["policy", "test", BUNDLE, "--since", "3 days", *url],
            "--since '3 days' is not a time",
        ),
        (
            "policy test",
            ["policy", "test", "/nonexistent/bundle", *url],
            "policy bundle /nonexistent/bundle rejected (1 problem(s), first: ",
        ),
        (
            "policy test",
            ["policy", "test", BUNDLE, "--registry", "/nonexistent/tools", *url],
            "tool registry: /nonexistent/tools",
        ),
    ]
    for command, argv, phrase in cases:
        code, out, err = run(capsys, *argv)
        assert (code, out) == (2, ""), (argv, err)
        assert phrase in one_line(err, command), (phrase, err)
    with pytest.raises(SystemExit) as raised:  # argparse's own checks, also one line
        main(["audit", "replay", "c1", "--limit", "lots", *url])
    assert raised.value.code == 2
    one_line(capsys.readouterr().err, "audit replay")


def test_trace_of_a_call_id_two_agents_used_names_both(capsys, nowhere, recorded):
    code, out, err = run(capsys, "audit", "trace", "shared", "--clickhouse-url", recorded[0])
    assert (code, out) == (2, "")
    assert "acme.researcher, acme.writer" in one_line(err, "audit trace")


# -- could not reach NATS (replay): exit 3 ------------------------------------------------------


def test_replay_without_a_gateway(capsys, nowhere, recorded):
    nats_url = f"nats://127.0.0.1:{free_port()}"
    code, out, err = run(
        capsys,
        "audit",
        "replay",
        "ok-0",
        "--clickhouse-url",
        recorded[0],
        "--nats-url",
        nats_url,
        "--connect-timeout",
        "0.5",
    )
    assert (code, out) == (3, "")
    assert f"no NATS at {nats_url}" in one_line(err, "audit replay")
    for bad in ("ftp://host:4222", "nats://", "nats://127.0.0.1:port"):
        code, _, err = run(
            capsys, "audit", "replay", "ok-0", "--clickhouse-url", recorded[0], "--nats-url", bad
        )
        assert code == 2 and f"--nats-url {bad!r} is not a NATS URL" in one_line(
            err, "audit replay"
        )
    code, _, err = run(
        capsys,
        "audit",
        "replay",
        "ok-0",
        "--clickhouse-url",
        recorded[0],
        "--nats-url",
        nats_url,
        "--creds",
        "/nonexistent/admin.creds",
    )
    assert code == 2
    assert "no credentials file at /nonexistent/admin.creds" in one_line(err, "audit replay")


# -- the real command line: one line, no traceback ----------------------------------------------


def test_the_toolgate_command_itself(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    env["PYTHONPATH"] = str(REPO_ROOT.parent) + os.pathsep + env.get("PYTHONPATH", "")
    cases = [
        (["audit", "verify"], {}, 2, "no audit seal public key at"),
        (
            ["audit", "trace", "c1"],
            {"TOOLGATE_CLICKHOUSE_URL": f"http://127.0.0.1:{free_port()}/toolgate"},
            3,
            "no ClickHouse answered",
        ),
        (["policy", "test", BUNDLE, "--since", "soon"], {}, 2, "is not a time"),
    ]
    for argv, extra, status, phrase in cases:
        done = subprocess.run(
            [sys.executable, "-m", "toolgate.cli", *argv],
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
        )  # a guard against a hang, not a measurement
        assert done.returncode == status, done.stderr
        assert done.stdout == "" and phrase in one_line(done.stderr, " ".join(argv[:2]))


# -- progress ---------------------------------------------------------------------------------


def test_progress_of_verify_and_policy_test(capsys, nowhere, recorded, monkeypatch):
    url, keys = recorded
    verify = [
        "audit",
        "verify",
        "--public-key",
        str(keys / "audit-seal.pub"),
        "--clickhouse-url",
        url,
        "--without-seals",  # no NATS here
    ]
    policy = ["policy", "test", BUNDLE, "--since", SINCE, "--clickhouse-url", url]
    monkeypatch.setattr(progress_module, "INTERVAL_S", 1e9)  # quick: nothing on stderr
    code, out, err = run(capsys, *verify)
    assert (code, err) == (0, "") and out.startswith("OK")
    code, _, err = run(capsys, *policy)
    assert (code, err) == (0, "")
    monkeypatch.setattr(progress_module, "INTERVAL_S", 0.0)  # slow: a line per step
    # verify runs inside ClickHouse (a few queries): no rows pass through to count
    code, out, err = run(capsys, *verify)
    assert (code, err) == (0, "") and out.startswith("OK")
    code, out, err = run(capsys, *policy)
    decided = int(out.split(": ")[1].split()[0])
    assert err.splitlines()[-1].startswith(
        f"toolgate policy test: {decided}/{decided} decisions replayed (100%)"
    )
