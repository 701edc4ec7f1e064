"""Fail fast, say why: each operator mistake ends a command in one line and a known exit code.

Every case runs the real `toolgate` command as a subprocess, in a folder of its
own with no TOOLGATE_* variables, against real servers: a gateway started as
`toolgate up` starts it (tests/harness.py), a port nobody listens on, a port
that accepts and never says a word. Each must end (the subprocess timeout is a
deadline, not a measure of speed) with exactly one line on stderr naming what
was tried and what to do, no traceback, and the exit status `toolgate --help`
documents: 1 a clear failure, 2 bad input or configuration, 3 could not reach
the gateway or it refused the creds. Long-running services are the exception:
they keep trying, one line at a time, until stopped.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import Gateway
from tests.waiting import wait_until
from toolgate.stack.nats_server import free_port

pytestmark = pytest.mark.system

DEADLINE_S = 90


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    exit_code: int
    says: tuple[str, ...]  # each in the one stderr line
    env: tuple[tuple[str, str], ...] = ()


def toolgate(
    args: list[str], cwd: Path, env: dict[str, str] | None = None, deadline: float = DEADLINE_S
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli", *args],
        cwd=cwd,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=deadline,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    return lines[0]


def check(done: subprocess.CompletedProcess[str], case: Case) -> None:
    line = one_line(done)
    assert done.returncode == case.exit_code, (done.returncode, line)
    for text in case.says:
        assert text in line, (text, line)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """A running gateway; its data dir holds the context, keys and creds `toolgate up` made."""
    from tests.conftest import start_gateway

    gateway = start_gateway(tmp_path_factory.mktemp("failures"))
    yield gateway
    gateway.stop()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """A folder where `toolgate up` never ran."""
    return tmp_path


@pytest.fixture(scope="module")
def nobody() -> str:
    """A NATS URL nobody listens on."""
    return f"nats://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def silent_url() -> Iterator[str]:
    """Accepts TCP connections and never says a word (no NATS INFO)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"nats://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture(scope="module")
def bad_creds(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("creds") / "bad.creds"
    path.write_text("this is not a creds file\n")
    return path


# ---------------------------------------------------------------- no gateway at all


def test_no_nats(folder: Path, nobody: str) -> None:
    """Nothing listens: every one-shot command says where it looked and exits 3."""
    said = ("no NATS at " + nobody, "connection refused", "is toolgate up running?", "(--nats-url)")
    for args in (
        ["call", "echo", "{}"],
        ["result", "call_1"],
        ["approvals", "list", "--token", "t"],
        ["approvals", "approve", "acme.a.c1", "--reason", "r", "--token", "t"],
        ["bench", "-n", "1", "--burst", "1", "--nats-url", nobody],
    ):
        check(
            toolgate([*args, "--nats-url", nobody] if args[0] != "bench" else args, folder),
            Case(tuple(args), 3, said),
        )


def test_no_nats_names_where_the_url_came_from(folder: Path, nobody: str) -> None:
    done = toolgate(["call", "echo", "{}"], folder, {"TOOLGATE_NATS_URL": nobody})
    check(done, Case((), 3, (nobody, "URL from $TOOLGATE_NATS_URL")))


def test_up_with_an_unreachable_nats(folder: Path, nobody: str) -> None:
    done = toolgate(["up", "--nats-url", nobody, "--no-audit"], folder)
    check(done, Case((), 3, ("toolgate up: no NATS answered at " + nobody, "--nats-url")))


def test_serve_keeps_trying_in_one_line(folder: Path, nobody: str) -> None:
    """A service is not a command: with no NATS it keeps trying, saying so, until stopped."""
    said = folder / "serve.out"
    with open(said, "wb") as out:
        service = subprocess.Popen(
            [sys.executable, "-m", "toolgate.cli", "serve", "validator", "--nats-url", nobody],
            cwd=folder,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")},
            # Ctrl-C reaches it even when the tests were started in the background
            # (a shell's `&` leaves SIGINT ignored, and children inherit that).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        # Up and refused once (however long its imports take on a loaded machine)...
        wait_until(lambda: "trying again" in said.read_text() or service.poll() is not None)
        # ...then still there after more tries (it tries every 2 s, says so every 30 s).
        time.sleep(5)
        assert service.poll() is None, said.read_text()
    finally:
        service.send_signal(signal.SIGINT)
        service.wait(timeout=DEADLINE_S)
    output = said.read_text()
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if line.strip()]
    assert len(lines) == 1 and f"no NATS at {nobody}" in lines[0] and "trying again" in lines[0], (
        lines
    )


# ---------------------------------------------------------------- wrong URLs


@pytest.mark.parametrize(
    "args",
    [
        ["call", "echo", "{}", "--nats-url", "http://127.0.0.1:4222"],
        ["result", "c1", "--nats-url", "nats://host:port"],
        ["approvals", "list", "--token", "t", "--nats-url", "https://example.com"],
        ["up", "--nats-url", "http://127.0.0.1:4222"],
        ["serve", "attacher", "--nats-url", "http://127.0.0.1:4222"],
        ["agents", "add", "acme", "a", "--nats-url", "http://x", "--offline"],
    ],
)
def test_not_a_nats_url(folder: Path, args: list[str]) -> None:
    if args[0] == "agents":  # --offline never talks to NATS: it mints and says so
        done = toolgate(args, folder)
        assert done.returncode == 0 and "--offline" in one_line(done)
        return
    check(
        toolgate(args, folder),
        Case((), 2, ("is not a NATS URL: expected nats://HOST:PORT", "(--nats-url)")),
    )


def test_something_else_on_the_port(folder: Path, silent_url: str) -> None:
    done = toolgate(
        ["call", "echo", "{}", "--nats-url", silent_url, "--connect-timeout", "2"], folder
    )
    check(done, Case((), 3, (f"no NATS at {silent_url}", "nothing answered as NATS in time")))


# ---------------------------------------------------------------- creds


def test_creds_files_that_cannot_work(gateway: Gateway, folder: Path, bad_creds: Path) -> None:
    url = gateway.url
    approver = gateway.stack.creds_of("inbox")
    assert approver is not None
    cases = [
        (
            ["call", "echo", "{}", "--creds", str(folder / "missing.creds")],
            2,
            ("no creds file at", "(--creds"),
        ),
        (
            ["call", "echo", "{}", "--creds", str(bad_creds)],
            2,
            ("is not a NATS creds file", "(--creds)"),
        ),
        (["call", "echo", "{}", "--creds", str(folder)], 2, ("is a directory",)),
        (
            ["call", "echo", "{}", "--creds", str(approver)],
            2,
            ("is not an agent's creds", "toolgate agents add"),
        ),
        (["result", "c1", "--creds", str(bad_creds)], 2, ("is not a NATS creds file",)),
        (
            ["approvals", "list", "--token", "t", "--creds", str(bad_creds)],
            2,
            ("is not a NATS creds file",),
        ),
        (
            ["serve", "validator", "--creds", str(folder / "missing.creds")],
            2,
            ("no creds file at",),
        ),
        # A locked bus and no creds at all: the server says no.
        (["call", "echo", "{}"], 3, (f"authorization refused at {url}", "(--creds)")),
    ]
    for args, code, says in cases:
        check(toolgate([*args, "--nats-url", url], folder), Case(tuple(args), code, says))


def test_revoked_creds_are_refused(gateway: Gateway, folder: Path) -> None:
    kept = folder / "kept.creds"
    creds = gateway.data_dir / "creds" / "agents" / "acme.mallory.creds"
    env = {"TOOLGATE_DATA_DIR": str(gateway.data_dir)}
    added = toolgate(["agents", "add", "acme", "mallory"], folder, env)
    assert added.returncode == 0, added.stderr
    shutil.copy(creds, kept)
    assert (
        toolgate(["call", "echo", '{"payload": 1}', "--creds", str(kept)], folder, env).returncode
        == 0
    )
    revoked = toolgate(["agents", "revoke", "acme", "mallory"], folder, env)
    assert revoked.returncode == 0, revoked.stderr
    done = toolgate(["call", "echo", "{}", "--creds", str(kept)], folder, env)
    check(
        done,
        Case(
            (),
            3,
            (
                f"authorization refused at {gateway.url}",
                "wrong, revoked or missing creds",
                "(--creds)",
            ),
        ),
    )


def test_creds_of_another_role_reach_no_approvals_service(gateway: Gateway, folder: Path) -> None:
    agent = gateway.stack.creds_of("agent")
    done = toolgate(
        [
            "approvals",
            "list",
            "--token",
            "t",
            "--timeout",
            "1",
            "--nats-url",
            gateway.url,
            "--creds",
            str(agent),
        ],
        folder,
    )
    check(
        done,
        Case(
            (),
            3,
            (f"no approvals service answered at {gateway.url}", "are --creds the approver's?"),
        ),
    )


# ---------------------------------------------------------------- data dir and registry


def test_missing_data_dir_and_registry(folder: Path) -> None:
    missing = str(folder / "no-such-dir")
    cases = [
        (
            ["agents", "list", "--data-dir", missing],
            2,
            ("no gateway data dir at", "run toolgate up first", "--data-dir"),
        ),
        (
            ["agents", "add", "acme", "a", "--data-dir", missing],
            2,
            ("no gateway data dir at", "--offline"),
        ),
        (["agents", "revoke", "acme", "a", "--data-dir", missing], 2, ("no gateway data dir",)),
        (
            ["approvals", "add-approver", "alice", "--tenant", "acme", "--data-dir", missing],
            2,
            ("no gateway data dir at", "approvers.yaml"),
        ),
        (
            ["up", "--registry", missing],
            2,
            ("toolgate up: no registry directory at", "(--registry)"),
        ),
        (
            ["up", "--data-dir", "/proc/no/such", "--no-audit"],
            2,
            ("toolgate up: cannot use /proc/no/such as the data dir", "(--data-dir)"),
        ),
        (["serve", "validator", "--registry", missing], 2, ("registry error",)),
    ]
    for args, code, says in cases:
        check(toolgate(args, folder), Case(tuple(args), code, says))


def test_up_on_a_port_in_use(folder: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = toolgate(["up", "--nats-port", str(port), "--no-audit"], folder)
    check(done, Case((), 2, (f"port {port} is in use", "--nats-port 0")))


def test_up_on_a_cluster_whose_second_port_is_in_use(folder: Path) -> None:
    """`--nats-cluster 3 --nats-port P` takes P, P+1 and P+2: each is checked first."""
    from toolgate.stack.processes import port_is_free

    with socket.socket() as taken:
        while True:  # a free P whose next two ports are free too; then take P+1
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                first = probe.getsockname()[1]
            if first < 65000 and port_is_free(first + 1) and port_is_free(first + 2):
                break
        taken.bind(("127.0.0.1", first + 1))
        taken.listen(1)
        done = toolgate(
            ["up", "--nats-cluster", "3", "--nats-port", str(first), "--no-audit"], folder
        )
    check(done, Case((), 2, (f"port {first + 1} is in use", "--nats-port 0")))


# ---------------------------------------------------------------- bad input, no answer


def test_bad_input_and_clear_failures(gateway: Gateway, folder: Path) -> None:
    env = {"TOOLGATE_DATA_DIR": str(gateway.data_dir)}  # what `toolgate up` recorded
    cases = [
        (["call", "echo", "not json"], 2, ("arguments are not JSON",)),
        (["call", "echo", "[1, 2]"], 2, ("arguments must be a JSON object",)),
        (["result", "never-called"], 1, ("no result stored for never-called",)),
        (["approvals", "list"], 2, ("an approver token is needed",)),
        (
            # (The inbox's NATS user speaks for any approver, by token.)
            [
                "approvals",
                "show",
                "acme.a.c1",
                "--token",
                "tgap_wrong",
                "--creds",
                str(gateway.stack.creds_of("inbox")),
            ],
            1,
            ("refused (INVALID_TOKEN)",),
        ),
        (["agents", "revoke", "acme", "nobody"], 2, ("no agent acme.nobody",)),
        (
            # A tool that answers no sooner than its 0.5 s timeout: an echo can be done
            # before the CLI looks once more after its 1 ms (seen once in a full run).
            ["call", "slow_backend", '{"sleep_s": 5}', "--timeout", "0.001"],
            3,
            ("no result for", "toolgate result", "--timeout"),
        ),
    ]
    for args, code, says in cases:
        check(toolgate(args, folder, env), Case(tuple(args), code, says))
