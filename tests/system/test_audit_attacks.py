"""An attacker with a local shell, against a real gateway's embedded ClickHouse and NATS.

Each attack of issue #10: a forged insert as the writer is named by verify;
table functions (file, url) and KILL QUERY are refused to every toolgate user
and to `default` (which reaches nothing over HTTP, not even SYSTEM STOP LISTEN);
the audit role cannot purge or delete its seals; a chain
deleted together with its checkpoints, a removed checkpoint and a truncated
tail are each named by verify against the JetStream seals; a SIGKILLed
embedded server is restarted and the audit goes on.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.harness import Gateway, make_test_registry
from toolgate.cli.audit import register
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal
from toolgate.services.audit.connection import ClickHouseTarget, connect

pytestmark = pytest.mark.system  # a whole gateway as processes (so slow too)

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
SEARCH = {"query": "agents state", "source_type": "any", "limit": 2}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("attacked")
    gateway = Gateway(
        data_dir=base / "data", registry_dir=make_test_registry(base / "registry"), with_audit=True
    ).start()
    yield gateway
    gateway.stop()


async def calls(gateway: Gateway, n: int) -> None:
    async with await gateway.client() as client:
        for _ in range(n):
            assert (await client.call("search_sources", SEARCH, principal=ALICE)).ok


async def audited(gateway: Gateway, timeout: float = 90.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not (
        await gateway.settled(subjects.CALLS_STREAM, "audit")
        and await gateway.settled(subjects.EVENTS_STREAM, "audit")
    ):
        assert asyncio.get_running_loop().time() < deadline, "the audit did not catch up"
        await asyncio.sleep(0.3)


def verify(gateway: Gateway, capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="toolgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        ["audit", "verify", "--data-dir", str(gateway.data_dir), "--nats-url", gateway.url]
        + ["--clickhouse-url", gateway.audit_url(), *extra]
    )
    code = int(args.func(args))
    return code, capsys.readouterr().out


def refused(url: str, sql: str) -> str:
    """ClickHouse's answer to `sql` as that URL's user: the error text, or '' if it ran."""
    try:
        connect(url).command(sql)
    except Exception as exc:  # the test reads the text
        return str(exc)
    return ""


def test_table_functions_and_kill_query_are_refused_to_everyone(attacked: Gateway) -> None:
    asyncio.run(calls(attacked, 1))
    default = attacked.stack.audit_url  # no login: ClickHouse's `default`
    for role, url in [
        ("writer", attacked.audit_url("writer")),
        ("auditor", attacked.audit_url("auditor")),
        ("admin", attacked.audit_url("admin")),
        ("default", default),
    ]:
        for sql in (
            "SELECT * FROM file('/etc/hostname', 'LineAsString')",
            "SELECT * FROM url('http://127.0.0.1:9/', 'LineAsString')",
        ):
            assert "ACCESS_DENIED" in refused(url, sql), (role, sql)
        if role != "admin":  # the admin stops the server, so it may end the keep-alive
            kill = "KILL QUERY WHERE query LIKE '%toolgate_hold_listener%' SYNC"
            assert "ACCESS_DENIED" in refused(url, kill), role
    # default reads and writes nothing; the auditor writes nothing; the writer reads nothing
    assert "ACCESS_DENIED" in refused(default, "SELECT count() FROM event_log")
    assert "ACCESS_DENIED" in refused(default, "CREATE TABLE x (a UInt8) ENGINE = Memory")
    auditor = attacked.audit_url("auditor")
    assert "ACCESS_DENIED" in refused(
        auditor, "INSERT INTO chain_checkpoints (chain_id) VALUES ('x')"
    )
    assert "ACCESS_DENIED" in refused(auditor, "ALTER TABLE event_log DELETE WHERE 1")
    writer = attacked.audit_url("writer")
    assert "ACCESS_DENIED" in refused(writer, "SELECT count() FROM event_log")
    assert "ACCESS_DENIED" in refused(writer, "ALTER TABLE event_log DELETE WHERE 1")
    assert "ACCESS_DENIED" in refused(writer, "TRUNCATE TABLE chain_checkpoints")
    # the server still answers: nothing above stopped it
    with urllib.request.urlopen(f"{attacked.stack.clickhouse.url}/ping", timeout=5) as r:  # type: ignore[union-attr]
        assert r.read().startswith(b"Ok.")


def test_a_forged_insert_as_the_writer_is_named(attacked: Gateway, capsys) -> None:
    asyncio.run(audited(attacked))
    code, out = verify(attacked, capsys)
    assert code == 0, out
    writer = connect(attacked.audit_url("writer"))
    writer.command(
        "INSERT INTO event_log (event_id, call_id, event_type, chain_id, chain_seq, chain_hash) "
        "VALUES ('forged-1', 'c-forged', 'ExecutionSucceeded', '', 0, '')"
    )
    # A forged event_id that would clear the auditor's screen is shown, not obeyed.
    writer.command(
        "INSERT INTO event_log (event_id, call_id, event_type, chain_id, chain_seq, chain_hash) "
        "VALUES ('forged-2\x1b[2J\u202e', 'c-forged', 'ExecutionSucceeded', '', 0, '')"
    )
    code, out = verify(attacked, capsys)
    assert code == 1 and "INSERTED" in out and "forged-1" in out, out
    assert "forged-2\\u001b[2J\\u202e" in out and "\x1b" not in out and "\u202e" not in out
    connect(attacked.audit_url("admin")).command(
        "ALTER TABLE event_log DELETE WHERE event_id LIKE 'forged-%' SETTINGS mutations_sync = 1"
    )


def test_the_audit_role_cannot_delete_or_purge_its_seals(attacked: Gateway) -> None:
    async def attempt() -> list[str]:
        errors = []
        nc = await attacked.connect("audit")
        js = nc.jetstream()
        for action in (
            js.purge_stream(subjects.AUDIT_SEALS_STREAM),
            js.delete_msg(subjects.AUDIT_SEALS_STREAM, 1),
            js.delete_stream(subjects.AUDIT_SEALS_STREAM),
        ):
            try:
                await action
                errors.append("")
            except Exception as exc:
                errors.append(repr(exc))
        await nc.close()
        admin = await attacked.connect("admin")
        try:  # not even the operator deletes or purges a message: only the whole stream
            await admin.jetstream().delete_msg(subjects.AUDIT_SEALS_STREAM, 1)
            errors.append("")
        except Exception as exc:
            errors.append(repr(exc))
        info = await admin.jetstream().stream_info(subjects.AUDIT_SEALS_STREAM)
        await admin.close()
        assert info.state.messages > 0
        return errors

    assert all(asyncio.run(attempt())), "a seal could be deleted or purged"


def test_deleting_a_chain_with_its_checkpoints_is_named_against_the_seals(
    attacked: Gateway, capsys
) -> None:
    # A new chain: restart the sink, then audit a few calls on it.
    sink = attacked.service("audit")
    sink.stop()
    sink.start()
    asyncio.run(calls(attacked, 3))
    asyncio.run(audited(attacked))
    admin = connect(attacked.audit_url("admin"))
    chains = [
        r[0]
        for r in admin.query(
            "SELECT chain_id FROM event_log GROUP BY chain_id ORDER BY min(recorded_at)"
        ).result_rows
    ]
    assert len(chains) >= 2
    older = chains[0]
    code, out = verify(attacked, capsys)
    assert code == 0, out
    # Remove the older chain and every checkpoint of it: ClickHouse alone cannot tell.
    for table in ("event_log", "chain_checkpoints"):
        admin.command(
            f"ALTER TABLE {table} DELETE WHERE chain_id = {{c:String}} SETTINGS mutations_sync = 1",
            parameters={"c": older},
        )
    code, out = verify(attacked, capsys, "--without-seals")
    assert code == 0, out
    code, out = verify(attacked, capsys)
    assert code == 1, out
    assert f"DELETED   chain {older}" in out and "every row of this signed chain is gone" in out


def test_a_removed_checkpoint_and_a_truncated_tail_are_named(attacked: Gateway, capsys) -> None:
    asyncio.run(calls(attacked, 2))
    asyncio.run(audited(attacked))
    admin = connect(attacked.audit_url("admin"))
    chain, last = admin.query(
        "SELECT chain_id, max(chain_seq) FROM event_log GROUP BY chain_id "
        "ORDER BY max(recorded_at) DESC LIMIT 1"
    ).result_rows[0]
    first_mark = admin.query(
        "SELECT min(chain_seq) FROM chain_checkpoints "
        "WHERE chain_id = {c:String} AND chain_seq > 0",
        parameters={"c": chain},
    ).result_rows[0][0]
    admin.command(
        "ALTER TABLE chain_checkpoints DELETE "
        "WHERE chain_id = {c:String} AND chain_seq = {s:UInt64} SETTINGS mutations_sync = 1",
        parameters={"c": chain, "s": first_mark},
    )
    admin.command(
        "ALTER TABLE event_log DELETE WHERE chain_id = {c:String} AND chain_seq = {s:UInt64} "
        "SETTINGS mutations_sync = 1",
        parameters={"c": chain, "s": last},
    )
    admin.command(
        "ALTER TABLE chain_checkpoints DELETE "
        "WHERE chain_id = {c:String} AND chain_seq >= {s:UInt64} SETTINGS mutations_sync = 1",
        parameters={"c": chain, "s": last},
    )
    code, out = verify(attacked, capsys)
    assert code == 1, out
    assert f"DELETED   chain {chain} seq {first_mark}:" in out and "(removed)" in out, out
    assert f"DELETED   chain {chain} seq {last}:" in out or f"seq {last}-" in out, out


def test_a_sigkilled_clickhouse_is_restarted_and_the_audit_goes_on(attacked: Gateway) -> None:
    clickhouse = attacked.stack.clickhouse
    assert clickhouse is not None
    before = clickhouse.restarts
    clickhouse.kill()
    asyncio.run(calls(attacked, 2))  # served meanwhile; audited once ClickHouse is back
    attacked.stack.restart_dead()  # what `toolgate up` runs every half second
    assert clickhouse.running() and clickhouse.restarts == before + 1
    asyncio.run(audited(attacked, timeout=120))
    target = ClickHouseTarget.from_url(attacked.audit_url("auditor"))
    dupes = (
        target.client().query("SELECT count() - uniqExact(event_id) FROM events").result_rows[0][0]
    )
    assert dupes == 0


def test_the_sink_role_may_measure_its_own_lag(attacked: Gateway) -> None:
    from toolgate.services.audit.lag import audit_lag

    async def measure() -> list:
        nc = await attacked.connect("audit")  # what the sink's lag watcher logs in as
        try:
            return await audit_lag(nc)
        finally:
            await nc.close()

    sink = attacked.service("audit").process
    assert sink is not None
    os.kill(sink.pid, signal.SIGSTOP)  # behind on purpose: the oldest unwritten is read
    try:
        asyncio.run(calls(attacked, 1))
        behind = asyncio.run(measure())
    finally:
        os.kill(sink.pid, signal.SIGCONT)
    assert {lag.stream for lag in behind} == {subjects.CALLS_STREAM, subjects.EVENTS_STREAM}
    assert all(lag.unwritten > 0 and lag.oldest_unwritten_s > 0 for lag in behind)
    asyncio.run(audited(attacked))
    caught_up = asyncio.run(measure())
    assert all(lag.unwritten == 0 and lag.oldest_unwritten_s == 0 for lag in caught_up)


def test_default_cannot_stop_the_listener_and_a_hung_server_is_restarted(
    attacked: Gateway,
) -> None:
    clickhouse = attacked.stack.clickhouse
    assert clickhouse is not None and clickhouse.pid is not None
    before = clickhouse.restarts
    # The passwordless `default` (the engine's own session) is not reachable over HTTP.
    assert "ACCESS_DENIED" in refused(attacked.stack.audit_url, "SYSTEM STOP LISTEN HTTP")
    attacked.stack.restart_dead()
    assert clickhouse.restarts == before and clickhouse.running()
    # A server that stops answering (here: frozen) is restarted all the same.
    os.kill(clickhouse.pid, signal.SIGSTOP)
    for _ in range(20):  # `toolgate up` runs this every half second
        attacked.stack.restart_dead()
        if clickhouse.restarts > before:
            break
    assert clickhouse.restarts == before + 1 and clickhouse.running()
    asyncio.run(calls(attacked, 1))
    asyncio.run(audited(attacked, timeout=120))
    dupes = connect(attacked.audit_url("auditor")).query(
        "SELECT count() - uniqExact(event_id) FROM events"
    )
    assert dupes.result_rows[0][0] == 0


def test_a_checkpoint_forged_by_the_writer_is_named(attacked: Gateway, capsys) -> None:
    asyncio.run(audited(attacked))  # (earlier tests of this module left their findings)
    code, out = verify(attacked, capsys)
    assert "FORGED" not in out, out
    admin = connect(attacked.audit_url("admin"))
    chain, last = admin.query(
        "SELECT chain_id, max(chain_seq) FROM event_log GROUP BY chain_id "
        "ORDER BY max(recorded_at) DESC LIMIT 1"
    ).result_rows[0]
    # The writer may insert checkpoints (the sink must), but cannot sign one: a "final"
    # checkpoint claimed early, to hide later rows as inserted, names itself.
    connect(attacked.audit_url("writer")).command(
        "INSERT INTO chain_checkpoints (chain_id, chain_seq, chain_hash, final, writer, "
        "key_id, signature) VALUES ({c:String}, 1, 'x', 1, 'mallory', 'k', 'c2ln')",
        parameters={"c": chain},
    )
    code, out = verify(attacked, capsys)
    assert code == 1 and f"FORGED    chain {chain} seq 1:" in out, out
    assert last > 1
    admin.command(
        "ALTER TABLE chain_checkpoints DELETE WHERE writer = 'mallory' SETTINGS mutations_sync = 1"
    )
