"""Registry and policy tooling say what they do, run as an operator types them.

`toolgate up --registry DIR` serves DIR's tools beside the built-in ones (a
directory may not redefine a built-in: refused naming both files), and every
later command in that folder uses the registry `up` recorded: `policy test`
replays calls of DIR's tools, `policy check` (push and test too) refuse a rule
on an argument no tool in its scope takes. A Cedar error names the line and column
of the error itself. The real `toolgate` CLI, in a folder of its own, no
TOOLGATE_* variables, against a real `toolgate up` (embedded NATS and ClickHouse).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from toolgate.contracts.registry import BUILTIN_TOOLS_DIR
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, read_bundle_dir

pytestmark = pytest.mark.system

DEADLINE_S = 120
# A tool of the operator's own (echo's function), with an amount a policy can read.
PAY_OUT = {
    **yaml.safe_load((BUILTIN_TOOLS_DIR / "echo.yaml").read_text()),
    "name": "pay_out",
    "description": "Pay out an amount (echoes its payload; for these tests).",
    "input_schema": {
        "type": "object",
        "properties": {"payload": {}, "amount": {"type": "integer"}},
        "additionalProperties": False,
    },
    "audit": {"arguments": "full", "result": "full"},
}
LIMIT_PAY_OUT = (
    '@id("pay-out-limit")\n'
    'forbid (principal, action, resource == Tool::"pay_out")\n'
    "when { context.arguments has ARG && context.arguments.ARG > 500 };\n"
)


def toolgate(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "toolgate.cli", *args],
        cwd=folder,
        env=clean,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1, f"expected one line on stderr, got:\n{done.stderr}"
    return lines[0]


def bundle(where: Path, **policies: str) -> Path:
    """The default bundle plus `policies` (file name -> text)."""
    where.mkdir(parents=True)
    for name, text in {**read_bundle_dir(DEFAULT_BUNDLE_DIR), **policies}.items():
        (where / name).write_text(text)
    return where


def tools_dir(where: Path, *specs: dict[str, object]) -> Path:
    where.mkdir(parents=True)
    for spec in specs:
        (where / f"{spec['name']}.yaml").write_text(yaml.safe_dump(spec))
    return where


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """`toolgate up --registry tools` running in this folder (its data in .toolgate)."""
    home = tmp_path_factory.mktemp("operator")
    tools_dir(home / "tools", PAY_OUT)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TOOLGATE_")}
    up = subprocess.Popen(
        [sys.executable, "-m", "toolgate.cli", "up", "--registry", "tools", "--nats-port", "0"],
        cwd=home,
        env=clean,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        assert up.stdout is not None
        said = []
        for line in up.stdout:  # bounded by the test timeout
            said.append(line)
            if line.startswith("Press Ctrl-C"):
                break
        assert up.poll() is None, "".join(said)
        yield home
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


def test_registry_dir_adds_to_the_builtin_tools(folder: Path) -> None:
    echo = toolgate(folder, "call", "echo", '{"payload": "built in"}')
    assert echo.returncode == 0, echo.stdout + echo.stderr
    assert json.loads(echo.stdout)["data"] == {"payload": "built in"}
    pay = toolgate(
        folder, "call", "pay_out", '{"payload": "mine", "amount": 900}', "--call-id", "pay-900"
    )
    assert pay.returncode == 0, pay.stdout + pay.stderr
    assert json.loads(pay.stdout)["data"] == {"payload": "mine"}
    context = json.loads((folder / ".toolgate" / "context.json").read_text())
    assert context["registry_dirs"] == [str((folder / "tools").resolve())]
    assert context["builtin_tools"] is True


def test_policy_test_replays_with_the_registry_up_recorded(folder: Path) -> None:
    """A bundle that denies the recorded pay_out of 900 would change it: exit 1."""
    pay = toolgate(
        folder, "call", "pay_out", '{"payload": "x", "amount": 900}', "--call-id", "pay-replay"
    )
    assert pay.returncode == 0, pay.stdout + pay.stderr
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the audit records the decision within a moment
        trace = toolgate(folder, "audit", "trace", "pay-replay")
        if "result attached: ok" in trace.stdout or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert "result attached: ok" in trace.stdout, trace.stdout + trace.stderr
    stricter = bundle(
        folder / "stricter", **{"limit.cedar": LIMIT_PAY_OUT.replace("ARG", "amount")}
    )
    done = toolgate(folder, "policy", "test", str(stricter), "--since", "1h", "--format", "json")
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert "pay-replay" in json.dumps(report), report


def test_policy_check_refuses_an_argument_no_tool_in_scope_takes(folder: Path) -> None:
    good = bundle(folder / "good", **{"limit.cedar": LIMIT_PAY_OUT.replace("ARG", "amount")})
    checked = toolgate(folder, "policy", "check", str(good))
    assert checked.returncode == 0, checked.stderr
    typo = bundle(folder / "typo", **{"limit.cedar": LIMIT_PAY_OUT.replace("ARG", "amonut")})
    for command in ("check", "push", "test"):
        done = toolgate(folder, "policy", command, str(typo))
        line = one_line(done)
        assert done.returncode == 2, (command, line)
        assert "limit.cedar:3:30: " in line, line
        assert "pay-out-limit" in line and "context.arguments.amonut" in line, line
        assert "pay_out takes amount, payload" in line, line
    # push stored nothing: the bundle in force still lets a pay_out of 900 through
    pay = toolgate(folder, "call", "pay_out", '{"payload": "y", "amount": 900}')
    assert pay.returncode == 0, pay.stdout + pay.stderr


def test_cedar_syntax_error_names_the_line_and_column_of_the_error(folder: Path) -> None:
    broken = bundle(
        folder / "broken",
        **{
            "broken.cedar": '@id("broken") permit (principal, action, resource)\n'
            'when { context.risk = "low" };\n'
        },
    )
    done = toolgate(folder, "policy", "check", str(broken))
    line = one_line(done)
    assert done.returncode == 2, line
    assert "broken.cedar:2:21: '=' is not a valid operator" in line, line


def test_a_registry_dir_may_not_redefine_a_builtin_tool(tmp_path: Path) -> None:
    own_echo = {**PAY_OUT, "name": "echo"}
    tools = tools_dir(tmp_path / "tools", own_echo)
    for args in (
        ("up", "--registry", str(tools), "--nats-port", "0", "--no-audit"),
        ("serve", "validator", "--registry", str(tools)),
    ):
        done = toolgate(tmp_path, *args)
        line = one_line(done)
        assert done.returncode == 2, (args, line)
        assert str(tools / "echo.yaml") in line, line
        assert str(BUILTIN_TOOLS_DIR / "echo.yaml") in line and "--no-builtin-tools" in line
    assert not (tmp_path / ".toolgate" / "context.json").exists()


def test_no_builtin_tools_and_no_registry_is_no_tools(tmp_path: Path) -> None:
    for args in (
        ("up", "--no-builtin-tools", "--nats-port", "0", "--no-audit"),
        ("serve", "validator", "--no-builtin-tools"),
    ):
        done = toolgate(tmp_path, *args)
        line = one_line(done)
        assert done.returncode == 2, (args, line)
        assert "no tools" in line and "--registry" in line, line
