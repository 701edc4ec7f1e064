"""The audit of a real gateway: every event once, and the auditor's commands on it."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
from collections import Counter
from collections.abc import Iterator

import pytest
import yaml
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from tests.harness import Gateway, make_test_registry
from toolgate.cli.audit import register
from toolgate.client.gateway_client import new_call_id
from toolgate.contracts import subjects
from toolgate.contracts.calls import Principal, ToolCall
from toolgate.contracts.events import decode_event
from toolgate.services.executor.tools.save_evidence import read_evidence

pytestmark = pytest.mark.system

ALICE = Principal(tenant="acme", user="u-alice", agent="researcher", session="s-1")
SEARCH = {"query": "OpenAI Agents SDK state management", "source_type": "official", "limit": 3}


@pytest.fixture(scope="module")
def audited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    base = tmp_path_factory.mktemp("audited")
    gateway = Gateway(
        data_dir=base / "data", registry_dir=make_test_registry(base / "registry"), with_audit=True
    ).start()
    yield gateway
    gateway.stop()


async def stream_event_ids(gateway: Gateway) -> set[str]:
    """The distinct event ids in the events stream, read in batches by an ephemeral consumer."""
    nc = await gateway.connect()
    try:
        js = nc.jetstream()
        last = (await js.stream_info(subjects.EVENTS_STREAM)).state.last_seq
        sub = await js.pull_subscribe(
            f"{subjects.EVENTS_PREFIX}.>",
            stream=subjects.EVENTS_STREAM,
            # An ephemeral consumer is deleted after 5 s without a request by default: a
            # loaded loop between two fetches then got 503 (no responders) from the server.
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
                inactive_threshold=300.0,
            ),
        )
        ids: set[str] = set()
        seen = 0
        while seen < last:
            for msg in await sub.fetch(1000, timeout=10):
                ids.add(decode_event(msg.data).event_id)
                seen = msg.metadata.sequence.stream
        await sub.unsubscribe()
        return ids
    finally:
        await nc.close()


async def stored_messages(gateway: Gateway) -> int:
    """How many messages the calls and events streams hold (cheap: no reading)."""
    nc = await gateway.connect()
    js = nc.jetstream()
    total = sum(
        [
            (await js.stream_info(s)).state.messages
            for s in (subjects.CALLS_STREAM, subjects.EVENTS_STREAM)
        ]
    )
    await nc.close()
    return total


async def expected_rows(gateway: Gateway) -> int:
    """Distinct event ids in the events stream, plus one row per stored call message."""
    nc = await gateway.connect()
    calls = (await nc.jetstream().stream_info(subjects.CALLS_STREAM)).state.messages
    await nc.close()
    return len(await stream_event_ids(gateway)) + calls


async def wait_until_audited(gateway: Gateway, timeout: float = 90.0) -> int:
    expected = await expected_rows(gateway)
    client = gateway.audit_client()
    deadline = asyncio.get_running_loop().time() + timeout
    while client.query("SELECT count() FROM events").result_rows[0][0] < expected:
        assert asyncio.get_running_loop().time() < deadline, "audit did not catch up"
        await asyncio.sleep(0.3)
    return expected


def operator_bus(gateway: Gateway) -> list[str]:
    """The flags of a command that talks to the gateway's locked bus as the operator
    (it may publish on any agent's calls subject and read any agent's results)."""
    return ["--nats-url", gateway.url, "--creds", str(gateway.stack.creds_of("admin"))]


def agent_bus(gateway: Gateway, tenant: str, agent: str) -> list[str]:
    """The same, logged in as one agent: it may replay only its own calls."""
    creds = asyncio.run(gateway.agent_creds(tenant, agent))
    return ["--nats-url", gateway.url, "--creds", str(creds)]


def audit_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="toolgate")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["audit", *argv])
    return int(args.func(args))


@pytest.fixture(scope="module")
def story(audited: Gateway) -> dict[str, str]:
    """A few calls of every kind, audited."""
    ids = {name: new_call_id() for name in ("search", "invalid", "broken", "denied", "saved")}

    async def run() -> None:
        async with await audited.client() as client:
            await client.call("search_sources", SEARCH, principal=ALICE, call_id=ids["search"])
            await client.call(
                "search_sources", {**SEARCH, "limit": 50}, principal=ALICE, call_id=ids["invalid"]
            )
            await client.call("broken_output", {}, principal=ALICE, call_id=ids["broken"])
            await client.call(
                "save_evidence",
                {"task_id": "other", "claim": "c", "source_url": "https://x.org"},
                principal=ALICE,
                task_id="mine",
                call_id=ids["denied"],
            )
            saved = await client.call(
                "save_evidence",
                {"task_id": "mine", "claim": "c", "source_url": "https://x.org"},
                principal=ALICE,
                task_id="mine",
                call_id=ids["saved"],
            )
            assert saved.status == "ok", saved
        nc = await audited.connect()
        await nc.jetstream().publish(subjects.calls_subject(ALICE.tenant, ALICE.agent), b"{garbage")
        await nc.close()
        await wait_until_audited(audited)

    asyncio.run(run())
    return ids


def test_every_event_reaches_clickhouse_exactly_once(audited, story):
    expected = asyncio.run(wait_until_audited(audited))
    client = audited.audit_client()
    count, distinct = client.query("SELECT count(), uniqExact(event_id) FROM events").result_rows[0]
    assert count == distinct == expected
    stream_ids = asyncio.run(stream_event_ids(audited))
    stored = {
        r[0]
        for r in client.query(
            "SELECT event_id FROM events WHERE source_stream = 'TOOLGATE_EVENTS'"
        ).result_rows
    }
    assert stored == stream_ids
    final = dict(client.query("SELECT call_id, final_status FROM calls").result_rows)
    assert final[story["search"]] == "ok"
    assert final[story["invalid"]] == "invalid_arguments"
    assert final[story["broken"]] == "invalid_tool_result"
    assert final[story["denied"]] == "denied"
    assert final[story["saved"]] == "ok"


def test_trace_prints_the_story_in_order(audited, story, capsys):
    assert audit_cli("trace", story["search"], "--clickhouse-url", audited.audit_url()) == 0
    out = capsys.readouterr().out
    order = [
        "requested search_sources by agent researcher",
        "arguments validated",
        "policy decision: allowed",
        "execution started",
        "execution finished, succeeded",
        "result checked against the output_schema: valid",
        "result attached: ok",
    ]
    positions = [out.index(phrase) for phrase in order]
    assert positions == sorted(positions), out
    audit_cli("trace", story["broken"], "--clickhouse-url", audited.audit_url())
    assert "INVALID (OUTPUT_SCHEMA_VIOLATION)" in capsys.readouterr().out


def test_sql_is_read_only_and_formats(audited, story, capsys):
    url = audited.audit_url()
    sql = f"SELECT call_id, final_status FROM calls WHERE call_id = '{story['invalid']}'"
    assert audit_cli("sql", sql, "--format", "json", "--clickhouse-url", url) == 0
    assert json.loads(capsys.readouterr().out) == {
        "call_id": story["invalid"],
        "final_status": "invalid_arguments",
    }
    assert audit_cli("sql", "SELECT 1 AS n", "--format", "csv", "--clickhouse-url", url) == 0
    assert capsys.readouterr().out == "n\n1\n"
    assert audit_cli("sql", "TRUNCATE TABLE event_log", "--clickhouse-url", url) == 2
    assert "read-only" in capsys.readouterr().err.lower()


def evidence_rows(gateway: Gateway) -> list[dict[str, object]]:
    return read_evidence(gateway.data_dir / "tools" / "save_evidence", "acme", "mine")


def audited_event_types(gateway: Gateway, call_id: str) -> Counter[str]:
    """The events of a call and of any re-run of it (rp-<call_id>-...), by type."""
    asyncio.run(wait_until_audited(gateway))
    rows = (
        gateway.audit_client()
        .query(
            "SELECT event_type FROM events WHERE call_id = {id:String} "
            "OR startsWith(call_id, {rerun:String})",
            parameters={"id": call_id, "rerun": f"rp-{call_id}"},
        )
        .result_rows
    )
    return Counter(r[0] for r in rows)


def test_replay_re_decides_and_runs_nothing(audited, story, capsys):
    """Invariant 11: replaying a recorded save_evidence call decides it again here (today's
    registry, today's bundle): no second evidence row, nothing published (no new
    CallRequested or ExecutionStarted), the same decision, exit 0. It used to publish a
    new call, store a second row and say DIFFERENT result, exit 1."""
    url = audited.audit_url()
    rows = evidence_rows(audited)
    assert [r["call_id"] for r in rows] == [story["saved"]]
    events = audited_event_types(audited, story["saved"])
    stored = asyncio.run(stored_messages(audited))
    assert audit_cli("replay", story["saved"], *operator_bus(audited), "--clickhouse-url", url) == 0
    out = capsys.readouterr().out
    assert out.startswith("decision comparison: 1 recorded call(s) decided again"), out
    assert "nothing was published, no tool ran" in out
    assert f"acme.researcher {story['saved']} (save_evidence): SAME decision" in out
    assert "recorded: allowed by " in out and "today:    allowed by " in out
    assert evidence_rows(audited) == rows
    assert asyncio.run(stored_messages(audited)) == stored
    assert audited_event_types(audited, story["saved"]) == events
    assert events["CallRequested"] == events["ExecutionStarted"] == 1
    # docs/audit.md's example: every save_evidence call of the last hour, the denied one too.
    assert (
        audit_cli(
            "replay",
            "--since",
            "1h",
            "--tool",
            "save_evidence",
            *operator_bus(audited),
            "--clickhouse-url",
            url,
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("SAME decision") == 2, out
    assert "denied: denied TASK_SCOPE_VIOLATION by task-scope" in out
    assert "2 same decision(s), 0 different, 0 not compared" in out
    assert evidence_rows(audited) == rows
    assert asyncio.run(stored_messages(audited)) == stored
    # Rejected by validation then, and now: the same rejection.
    assert (
        audit_cli("replay", story["invalid"], *operator_bus(audited), "--clickhouse-url", url) == 0
    )
    assert (
        "rejected by validation: invalid_arguments SCHEMA_VALIDATION_FAILED"
        in capsys.readouterr().out
    )


def test_replay_under_another_registry_names_what_changed(audited, story, capsys, tmp_path):
    """Today's registry may differ from the one the call was decided under: the replay
    says so per field, exit 1 (and still runs nothing)."""
    registry = make_test_registry(tmp_path / "registry")
    evidence = registry / "save_evidence.yaml"
    evidence.write_text(evidence.read_text() + "\nrequires_approval: true\n")
    search = registry / "search_sources.yaml"
    spec = yaml.safe_load(search.read_text())
    spec["input_schema"]["properties"]["limit"]["maximum"] = 2
    search.write_text(yaml.safe_dump(spec))
    rows, stored = evidence_rows(audited), asyncio.run(stored_messages(audited))
    argv = [*operator_bus(audited), "--clickhouse-url", audited.audit_url()]
    assert (
        audit_cli(
            "replay", story["saved"], "--registry", str(registry), "--no-builtin-tools", *argv
        )
        == 1
    )
    out = capsys.readouterr().out
    assert f"registry ({registry})" in out
    line = next(x for x in out.splitlines() if story["saved"] in x)
    assert "DIFFERENT decision: decision allow -> approval" in line, out
    assert "approvers needed - -> 1" in line
    assert "today:    approval required (1 approver(s))" in out
    assert (
        audit_cli(
            "replay", story["search"], "--registry", str(registry), "--no-builtin-tools", *argv
        )
        == 1
    )
    out = capsys.readouterr().out
    assert (
        "DIFFERENT decision: decision allow -> rejected; status - -> invalid_arguments; "
        "error code - -> SCHEMA_VALIDATION_FAILED" in out
    ), out
    assert evidence_rows(audited) == rows
    assert asyncio.run(stored_messages(audited)) == stored


def test_execute_refuses_a_tool_that_is_not_read_only(audited, story, capsys):
    """Re-running a tool is asked for by name (--execute), and only a read_only tool may be
    re-run: save_evidence is refused in one line, exit 2, before anything is sent."""
    rows, stored = evidence_rows(audited), asyncio.run(stored_messages(audited))
    argv = [*operator_bus(audited), "--clickhouse-url", audited.audit_url()]
    for selection in ([story["saved"]], ["--since", "1h"]):
        assert audit_cli("replay", *selection, "--execute", *argv) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1, captured
        assert captured.err.startswith("toolgate audit replay: --execute runs tools again, and ")
        assert "save_evidence" in captured.err and "not declared read_only: true" in captured.err
    assert evidence_rows(audited) == rows
    assert asyncio.run(stored_messages(audited)) == stored


def test_execute_runs_a_read_only_call_again_as_a_new_call(audited, story, capsys):
    url = audited.audit_url()
    assert (
        audit_cli(
            "replay", story["search"], "--execute", *operator_bus(audited), "--clickhouse-url", url
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("result comparison: 1 recorded call(s) of read_only tools run again")
    assert "SAME result" in out and f"rp-{story['search']}-" in out
    asyncio.run(wait_until_audited(audited))
    client = audited.audit_client()
    [(call_id, tenant, agent, payload)] = client.query(
        "SELECT call_id, tenant, agent, payload FROM events WHERE event_type = 'CallRequested' "
        f"AND startsWith(call_id, 'rp-{story['search']}')"
    ).result_rows
    assert json.loads(payload)["call"]["context"] == {"replay_of": story["search"]}
    # A new call of the same agent, on that agent's calls subject.
    assert (tenant, agent) == (ALICE.tenant, ALICE.agent)
    statuses = [
        r[0]
        for r in client.query(
            f"SELECT event_type FROM events WHERE call_id = '{call_id}'"
        ).result_rows
    ]
    assert {"ArgumentsValidated", "CallAuthorized", "ResultAttached"} <= set(statuses)
    # By time and filters: the one ok search_sources call (earlier replays are left out).
    assert (
        audit_cli(
            "replay",
            "--since",
            "2000-01-01T00:00:00",
            "--tool",
            "search_sources",
            "--status",
            "ok",
            "--execute",
            *operator_bus(audited),
            "--clickhouse-url",
            url,
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("SAME result") == 1 and f'"call_id": "{story["search"]}"' in out
    # A call whose arguments were kept only as a hash cannot be replayed, and says why.
    echo = ToolCall(call_id=new_call_id(), tool="echo", arguments={"payload": "x"}, principal=ALICE)

    async def submit() -> None:
        async with await audited.client() as client:
            await client.submit(echo)
        await wait_until_audited(audited)

    asyncio.run(submit())
    for mode in ([], ["--execute"]):
        assert (
            audit_cli(
                "replay", echo.call_id, *mode, *operator_bus(audited), "--clickhouse-url", url
            )
            == 1
        )
        assert "arguments were not recorded (audit: hash)" in capsys.readouterr().out


def test_an_agent_re_executes_its_own_calls_and_no_one_elses(audited, story, capsys):
    url = audited.audit_url()
    assert (
        audit_cli(
            "replay",
            story["search"],
            "--execute",
            *agent_bus(audited, "acme", "researcher"),
            "--clickhouse-url",
            url,
        )
        == 0
    )
    assert "SAME result" in capsys.readouterr().out
    # Another agent's creds cannot publish acme.researcher's call: refused before sending.
    assert (
        audit_cli(
            "replay",
            story["search"],
            "--execute",
            *agent_bus(audited, "acme", "writer"),
            "--clickhouse-url",
            url,
        )
        == 1
    )
    out = capsys.readouterr().out
    assert "cannot replay: a call of acme.researcher" in out and "acme.writer" in out
    assert "SAME result" not in out
    # Re-deciding reads today's bundle, which an agent may not: one line, exit 2.
    assert (
        audit_cli(
            "replay",
            story["search"],
            *agent_bus(audited, "acme", "researcher"),
            "--clickhouse-url",
            url,
        )
        == 2
    )
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "speak for agent acme.researcher, and re-deciding reads" in captured.err


def test_replay_defaults_to_what_toolgate_up_recorded(audited, story, capsys, monkeypatch):
    """No --nats-url, no --creds: the gateway's URL and the operator's creds, from the
    context `toolgate up` wrote (the default agent could replay only its own calls), in
    $TOOLGATE_DATA_DIR or --data-dir."""
    for name in ("TOOLGATE_NATS_URL", "TOOLGATE_NATS_CREDS", "TOOLGATE_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    url = audited.audit_url()
    assert audit_cli("replay", story["search"], "--data-dir", str(audited.data_dir)) == 0
    assert "SAME decision" in capsys.readouterr().out
    monkeypatch.setenv("TOOLGATE_DATA_DIR", str(audited.data_dir))
    assert audit_cli("replay", story["search"], "--clickhouse-url", url) == 0
    assert "SAME decision" in capsys.readouterr().out
    assert (
        audit_cli("replay", story["search"], "--execute", "--clickhouse-url", audited.audit_url())
        == 0
    )
    assert "SAME result" in capsys.readouterr().out


def test_a_call_id_used_by_two_agents_is_two_calls(audited, story, capsys):
    """The same call_id from another agent is another call: traced and replayed apart."""
    url = audited.audit_url()
    shared = new_call_id()

    async def both() -> None:
        async with (
            await audited.client("acme", "researcher") as researcher,
            await audited.client("acme", "writer") as writer,
        ):
            first = await researcher.call(
                "search_sources", SEARCH, user="u-alice", session="s-1", call_id=shared
            )
            second = await writer.call(
                "search_sources",
                {**SEARCH, "limit": 50},
                user="u-carol",
                session="s-2",
                call_id=shared,
            )
        assert (first.status, second.status) == ("ok", "invalid_arguments")
        await wait_until_audited(audited)

    asyncio.run(both())
    assert audit_cli("trace", shared, "--clickhouse-url", url) == 2
    assert "acme.researcher, acme.writer" in capsys.readouterr().err
    assert (
        audit_cli("trace", shared, "--tenant", "acme", "--agent", "writer", "--clickhouse-url", url)
        == 0
    )
    out = capsys.readouterr().out
    assert "requested search_sources by agent writer for user u-carol" in out
    assert "arguments rejected: invalid_arguments" in out and "researcher" not in out
    # Each decided again as its own agent's call, beside its own recorded decision.
    assert audit_cli("replay", shared, *operator_bus(audited), "--clickhouse-url", url) == 0
    out = capsys.readouterr().out
    assert out.count("SAME decision") == 2
    assert f"acme.writer {shared} (search_sources): SAME decision" in out
    assert "rejected by validation: invalid_arguments SCHEMA_VALIDATION_FAILED" in out
    # And re-run (search_sources is read_only), each compared with its own recorded result.
    assert (
        audit_cli("replay", shared, "--execute", *operator_bus(audited), "--clickhouse-url", url)
        == 0
    )
    assert capsys.readouterr().out.count("SAME result") == 2


def test_verify_finds_the_chains_intact(audited, story, capsys):
    code = audit_cli(
        "verify", "--data-dir", str(audited.data_dir), "--clickhouse-url", audited.audit_url()
    )
    out = capsys.readouterr().out
    assert code == 0 and out.strip().splitlines()[-1].startswith("OK"), out


def test_verify_and_policy_test_need_no_flags_where_toolgate_up_ran(
    audited, story, capsys, monkeypatch, tmp_path
):
    """In the folder where `toolgate up` ran (its state in ./.toolgate), the seal key and the
    ClickHouse URL come from there: no flag, no variable."""
    from toolgate.cli.main import main
    from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR

    for name in [n for n in os.environ if n.startswith("TOOLGATE_")]:
        monkeypatch.delenv(name)
    (tmp_path / ".toolgate").symlink_to(audited.data_dir)
    monkeypatch.chdir(tmp_path)
    assert audit_cli("verify") == 0
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("OK")
    assert (
        main(["policy", "test", str(DEFAULT_BUNDLE_DIR), "--since", "1h", "--format", "json"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["calls"] >= 2


def test_replay_shows_progress_when_it_takes_a_while(audited, story, capsys, monkeypatch):
    from toolgate.services.audit import progress

    monkeypatch.setattr(progress, "INTERVAL_S", 0.0)  # every step counts as "a while"
    assert (
        audit_cli(
            "replay",
            "--since",
            "1h",
            "--tool",
            "search_sources",
            "--status",
            "ok",
            *operator_bus(audited),
            "--clickhouse-url",
            audited.audit_url(),
        )
        == 0
    )
    err = capsys.readouterr().err.splitlines()
    assert (
        err
        and err[-1].startswith("toolgate audit replay: ")
        and "calls re-decided (100%)" in err[-1]
    ), err


def test_replay_with_no_gateway_is_one_line(audited, story, capsys):
    from toolgate.stack.clickhouse_server import free_port

    nats_url = f"nats://127.0.0.1:{free_port()}"
    assert (
        audit_cli(
            "replay",
            story["search"],
            "--nats-url",
            nats_url,
            "--connect-timeout",
            "0.5",
            "--clickhouse-url",
            audited.audit_url(),
        )
        == 3
    )
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"toolgate audit replay: no NATS at {nats_url}")


def test_malformed_call_is_recorded(audited, story):
    client = audited.audit_client()
    [(note, payload)] = client.query(
        "SELECT note, payload FROM events WHERE event_type = 'CallRequested' "
        "AND note LIKE 'not a decodable%'"
    ).result_rows
    # Its size and SHA-256, no excerpt: an undecoded message may carry anything.
    assert json.loads(payload) == {"bytes": 8, "sha256": hashlib.sha256(b"{garbage").hexdigest()}


NO_EVIDENCE = """
@id("no-evidence-today")
@error_code("POLICY_DENIED")
@reason("no evidence is saved today")
forbid (principal, action, resource)
when { context.tool == Tool::"save_evidence" };
"""


def test_replay_under_a_pushed_bundle_names_what_changed(audited, story, capsys, tmp_path):
    """Today's bundle is the one the policy service would load from the policies bucket
    (signature checked): a bundle pushed since the call makes the replay exit 1, naming
    the decision, status, error code and policies that changed. (Last in this module: it
    pushes the default bundle back when done.)"""
    from toolgate.cli.main import main
    from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR

    bundle = tmp_path / "bundle"
    shutil.copytree(DEFAULT_BUNDLE_DIR, bundle)
    (bundle / "no_evidence.cedar").write_text(NO_EVIDENCE)
    push = ["--data-dir", str(audited.data_dir), *operator_bus(audited)]
    assert main(["policy", "push", str(bundle), *push]) == 0
    said = capsys.readouterr().out  # "pushed policy bundle VERSION to ... (revision N, ..."
    pushed, revision = said.split()[3], said.split("(revision ")[1].split(",")[0]
    try:
        rows, stored = evidence_rows(audited), asyncio.run(stored_messages(audited))
        argv = [*push, "--clickhouse-url", audited.audit_url()]
        assert audit_cli("replay", story["saved"], *argv) == 1
        out = capsys.readouterr().out
        assert (
            f"today's policy bundle {pushed} (toolgate_policies/active revision {revision})" in out
        )
        line = next(x for x in out.splitlines() if story["saved"] in x)
        assert (
            "DIFFERENT decision: decision allow -> deny; status - -> denied; "
            "error code - -> POLICY_DENIED; policies " in line
        ), out
        assert line.endswith("-> no-evidence-today"), line
        assert (
            f"today:    denied: denied POLICY_DENIED by no-evidence-today under bundle {pushed}"
            in out
        )
        # A call the new policy does not touch decides the same.
        assert audit_cli("replay", story["search"], *argv) == 0
        assert evidence_rows(audited) == rows
        assert asyncio.run(stored_messages(audited)) == stored
    finally:
        assert main(["policy", "push", str(DEFAULT_BUNDLE_DIR), *push]) == 0


TERMINAL_ORDERS = "u\x1b]0;PWNED\x07\x1b[2J\x1b[31mapproved by security team\x1b[0m"
OBEYED = ("\x1b", "\x07", "\x9b", "\u202e", "\u2066", "\u200f")


def test_a_user_that_drives_the_terminal_is_shown_escaped(audited, story, capsys):
    """The red team's `user`: through the gateway, then trace and sql print it as escapes."""
    call_id = new_call_id()
    mallory = Principal(
        tenant="acme", user=TERMINAL_ORDERS + "\u202eevil\u2066", agent="researcher", session="s"
    )

    async def run() -> None:
        async with await audited.client() as client:
            await client.call("search_sources", SEARCH, principal=mallory, call_id=call_id)
        await wait_until_audited(audited)

    asyncio.run(run())
    url = audited.audit_url()
    assert audit_cli("trace", call_id, "--clickhouse-url", url) == 0
    trace = capsys.readouterr().out
    assert "for user u\\u001b]0;PWNED\\u0007\\u001b[2J\\u001b[31mapproved" in trace
    assert "\\u202eevil\\u2066" in trace
    sql = f"SELECT user, tool FROM events WHERE call_id = '{call_id}' LIMIT 1"
    assert audit_cli("sql", sql, "--clickhouse-url", url) == 0
    table = capsys.readouterr().out
    assert "u\\u001b]0;PWNED\\u0007\\u001b[2J" in table
    assert audit_cli("sql", sql, "--format", "json", "--clickhouse-url", url) == 0
    out = capsys.readouterr().out
    assert json.loads(out)["user"] == mallory.user
    for text in (trace, table, out):
        assert [ch for ch in OBEYED if ch in text] == []
