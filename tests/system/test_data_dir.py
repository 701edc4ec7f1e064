"""`--data-dir D` means D everywhere, and a bad input ends in one line.

Every case runs the real `toolgate` command as a subprocess, from a folder of
its own with no TOOLGATE_* variables (so nothing but `--data-dir` can point it
at the gateway), against a gateway started as `toolgate up` starts it
(tests/harness.py) on a port of its own, not 4222. The subprocess timeout is a
deadline, not a measure of speed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Gateway, make_test_registry
from tests.system.test_operator_failures import DEADLINE_S, one_line, toolgate
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR
from toolgate.stack.nats_server import free_port

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from tests.conftest import start_gateway

    # (/healthz too: `toolgate status` asks each service's.)
    gateway = start_gateway(tmp_path_factory.mktemp("datadir"), with_http=True)
    yield gateway
    gateway.stop()


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A folder where `toolgate up` never ran."""
    return tmp_path


@pytest.fixture(scope="module")
def nobody() -> str:
    return f"nats://127.0.0.1:{free_port()}"


# ---------------------------------------------------------------- D's context, from anywhere


def test_agents_add_with_data_dir_tells_the_gateway_of_that_folder(
    gateway: Gateway, elsewhere: Path
) -> None:
    """The finding: run from another folder, `agents add --data-dir D` looked for the
    default folder's context, said "active at the next toolgate up", exit 0."""
    where = ["--data-dir", str(gateway.data_dir)]
    added = toolgate(["agents", "add", "acme", "dd-writer", *where], elsewhere)
    assert added.returncode == 0, added.stderr
    assert "active now" in one_line(added)
    creds = added.stdout.strip()
    called = toolgate(["call", "echo", '{"payload": 1}', "--creds", creds, *where], elsewhere)
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["ok"] is True


def test_every_command_finds_the_gateway_through_data_dir(
    gateway: Gateway, elsewhere: Path
) -> None:
    """The NATS URL and each role's creds come from D/context.json, whatever the cwd."""
    where = ["--data-dir", str(gateway.data_dir)]
    called = toolgate(["call", "echo", '{"payload": 2}', "--call-id", "dd-c1", *where], elsewhere)
    assert called.returncode == 0, called.stderr
    fetched = toolgate(["result", "dd-c1", *where], elsewhere)
    assert fetched.returncode == 0, fetched.stderr
    status = toolgate(["status", *where], elsewhere)
    assert status.returncode == 0, status.stderr
    token = toolgate(
        ["approvals", "add-approver", "dd-alice", "--tenant", "acme", *where], elsewhere
    ).stdout.strip()
    # An approver logs in with the creds add-approver wrote for her, and her token.
    mine = ["--creds", str(gateway.data_dir / "creds" / "approvers" / "dd-alice.creds")]
    listed = toolgate(["approvals", "list", "--token", token, *mine, *where], elsewhere)
    assert listed.returncode == 0, listed.stderr


# ---------------------------------------------------------------- told, or exit 3


def test_a_server_that_could_not_be_told_is_exit_3_unless_offline(
    gateway: Gateway, elsewhere: Path, nobody: str
) -> None:
    where = ["--data-dir", str(gateway.data_dir), "--nats-url", nobody]
    added = toolgate(["agents", "add", "acme", "dd-untold", *where], elsewhere)
    assert added.returncode == 3, added.stderr
    line = one_line(added)
    assert "minted" in line and "no running server was told" in line and "--offline" in line
    assert f"no NATS at {nobody}" in line
    token = toolgate(["agents", "token", "acme", "dd-untold", *where], elsewhere)
    assert token.returncode == 3 and "no running server was told" in one_line(token)
    offline = toolgate(["agents", "add", "acme", "dd-later", *where, "--offline"], elsewhere)
    assert offline.returncode == 0 and "--offline" in one_line(offline)
    revoked = toolgate(["agents", "revoke", "acme", "dd-later", *where], elsewhere)
    assert revoked.returncode == 3 and "no running server was told" in one_line(revoked)


# ---------------------------------------------------------------- bad input, one line, exit 2


def test_a_call_id_that_cannot_name_a_subject_is_bad_input(
    gateway: Gateway, elsewhere: Path
) -> None:
    """Was "no NATS ... is toolgate up running?", exit 3, with NATS up."""
    where = ["--data-dir", str(gateway.data_dir)]
    for args, flag in (
        (["call", "echo", "{}", "--call-id", "has space"], "--call-id"),
        (["result", "has space"], "CALL_ID"),
        (["call", "echo", "{}", "--call-id", "x" * 129], "--call-id"),
    ):
        done = toolgate([*args, *where], elsewhere)
        line = one_line(done)
        assert done.returncode == 2, line
        assert "is not a call_id" in line and flag in line


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--nats-port", "99999"),
        ("--nats-port", "-1"),
        ("--mcp-port", "70000"),
        ("--clickhouse-port", "65536"),
    ],
)
def test_up_on_a_port_that_is_not_one(elsewhere: Path, flag: str, value: str) -> None:
    """Was an OverflowError."""
    done = toolgate(["up", flag, value, "--data-dir", str(elsewhere / "data")], elsewhere)
    line = one_line(done)
    assert done.returncode == 2, line
    assert f"toolgate up: {flag} {value} is not a TCP port" in line


def test_up_with_a_clickhouse_url_where_nothing_answers(elsewhere: Path) -> None:
    """Was "toolgate is up", then the audit restarted every 30-60 s ("nats never answered")."""
    url = f"http://127.0.0.1:{free_port()}/toolgate"
    done = toolgate(
        ["up", "--nats-port", "0", "--clickhouse-url", url, "--data-dir", str(elsewhere / "d")],
        elsewhere,
    )
    line = one_line(done)
    assert done.returncode == 3, line
    assert "toolgate is up" not in done.stdout
    assert f"toolgate up: no ClickHouse answered at {url}" in line and "--clickhouse-url" in line


def test_the_audit_sink_waiting_for_clickhouse_names_clickhouse_not_nats(
    gateway: Gateway, elsewhere: Path
) -> None:
    """Its log line and its /healthz (what `toolgate up` restarts it on) say ClickHouse."""
    url = f"http://127.0.0.1:{free_port()}/toolgate"
    port = free_port()
    log_path = elsewhere / "audit.log"
    with open(log_path, "wb") as log:
        sink = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolgate.cli",
                "serve",
                "audit",
                "--data-dir",
                str(elsewhere / "data"),
                "--nats-url",
                gateway.url,
                "--creds",
                str(gateway.stack.creds_of("audit")),
                "--clickhouse-url",
                url,
                "--http-port",
                str(port),
                "--health-grace",
                "1",
            ],
            cwd=elsewhere,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")},
        )
    try:
        verdict = None
        while verdict is None or verdict["alive"]:  # bounded by the test timeout
            assert sink.poll() is None, log_path.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                    verdict = json.loads(r.read())
            except urllib.error.HTTPError as failing:
                verdict = json.loads(failing.read())
            except OSError:
                pass
        assert verdict["why"][0] == "clickhouse never answered (grace 1 s)", verdict
        assert not any(reason.startswith("nats") and "never" in reason for reason in verdict["why"])
        assert f"ClickHouse at {url}" in log_path.read_text()
    finally:
        sink.terminate()
        sink.wait(DEADLINE_S)


# ---------------------------------------------------------------- the inbox with no gateway


def test_the_inbox_with_no_gateway_ends_in_one_line(elsewhere: Path, nobody: str) -> None:
    """Was silent for 20 s, never opened its port."""
    done = toolgate(
        ["approvals", "inbox", "--nats-url", nobody, "--port", str(free_port())], elsewhere
    )
    line = one_line(done)
    assert done.returncode == 3, line
    assert f"no NATS at {nobody}" in line and "is toolgate up running?" in line
    assert "waiting for NATS" in done.stdout


def test_ctrl_c_ends_the_inbox_waiting_for_nats_at_once(elsewhere: Path) -> None:
    """A port that accepts and never speaks: it waits (bounded); Ctrl-C ends the wait."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        inbox = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "toolgate.cli",
                "approvals",
                "inbox",
                "--nats-url",
                f"nats://127.0.0.1:{silent.getsockname()[1]}",
                "--port",
                str(free_port()),
                "--connect-timeout",
                "3600",
            ],
            cwd=elsewhere,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")},
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        assert inbox.stdout is not None
        try:
            assert "waiting for NATS" in inbox.stdout.readline()
            inbox.send_signal(signal.SIGINT)
            _, err = inbox.communicate(timeout=DEADLINE_S)  # not 3600 s: Ctrl-C ended it
        finally:
            if inbox.poll() is None:
                inbox.kill()
                inbox.wait()
    assert inbox.returncode == 130 and "Traceback" not in err, err


# ---------------------------------------------------------------- whose gateway is it


def test_a_call_from_a_fresh_folder_at_another_gateways_4222(elsewhere: Path) -> None:
    """Was "wrong, revoked or missing creds": no context here, so the NATS at the default
    URL is someone else's."""
    from toolgate.stack import nats_auth
    from toolgate.stack.nats_server import EmbeddedNats
    from toolgate.stack.processes import port_is_free

    if not port_is_free(4222):
        pytest.skip("port 4222 is taken on this machine")
    other = elsewhere / "other-gateway"
    creds = nats_auth.create_credentials(other)
    server = EmbeddedNats(other / "nats", port=4222, config_file=creds.auth_config).start()
    fresh = elsewhere / "fresh"
    fresh.mkdir()
    bundle = shutil.copytree(DEFAULT_BUNDLE_DIR, fresh / "policy")
    # `policy push`, `policy rollback` and `tools list` said "cannot connect to NATS at
    # ...: Error: nats: 'Authorization Violation'", exit 3.
    commands = [
        ["call", "echo", "{}"],
        ["policy", "push", str(bundle)],
        ["policy", "rollback", "1"],
        ["tools", "list"],
    ]
    try:
        done = [toolgate(command, fresh) for command in commands]
        # And `toolgate up` there stops before it writes a data dir: it had minted a
        # whole one (operator keys, agents) that later commands of the folder used.
        up = toolgate(["up"], fresh)
    finally:
        server.stop()
    for command, result in zip(commands, done, strict=True):
        line = one_line(result)
        assert result.returncode == 2, (command, line)
        assert "no `toolgate up` is recorded in .toolgate/context.json" in line, command
        assert "belongs to another gateway or is not toolgate's" in line and "--data-dir" in line
    assert up.returncode == 2, one_line(up)
    assert "port 4222 is in use" in one_line(up)
    assert not (fresh / ".toolgate").exists()


def test_a_second_up_on_a_running_gateways_data_dir(gateway: Gateway, elsewhere: Path) -> None:
    """Was an obscure ClickHouse error."""
    done = toolgate(["up", "--nats-port", "0", "--data-dir", str(gateway.data_dir)], elsewhere)
    line = one_line(done)
    assert done.returncode == 2, line
    assert f"a gateway already runs in {gateway.data_dir} (pid {os.getpid()})" in line


# ---------------------------------------------------------------- a curious local process


def readable_by_others(root: Path) -> list[Path]:
    """Files under `root` another local user could open for reading: the file is
    world-readable and every folder from `root` down to it world-searchable."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        if not stat.S_IMODE(here.stat().st_mode) & stat.S_IXOTH:
            dirs.clear()  # nothing below it can be reached
            continue
        for name in files:
            path = here / name
            if path.is_file() and stat.S_IMODE(path.lstat().st_mode) & stat.S_IROTH:
                found.append(path)
    return found


def test_another_local_user_reads_nothing_of_the_data_dir(tmp_path: Path) -> None:
    """The finding: the audit's ClickHouse files (every call's arguments and result,
    readable around ClickHouse's logins), the logs and what tools wrote were 0644 in
    0755 folders under a 0755 data dir. A data dir left over from before (0755) is
    closed at the next start too."""
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o755)
    os.chmod(data_dir, 0o755)  # whatever the umask: as an older `toolgate up` left it
    registry = make_test_registry(tmp_path / "registry")
    gateway = Gateway(data_dir=data_dir, registry_dir=registry, with_audit=True).start()
    try:
        where = ["--data-dir", str(data_dir)]
        called = toolgate(["call", "echo", '{"payload": "secret-7"}', *where], tmp_path)
        assert called.returncode == 0, called.stderr
        assert (data_dir / "clickhouse" / "data").is_dir()
        assert readable_by_others(data_dir) == []
        assert readable_by_others(data_dir / "clickhouse") == []
    finally:
        gateway.stop()
