"""Every example of README.md and of every docs page runs as written, so no page can rot.

Each page is read top to bottom as a reader in a fresh folder of their own
would follow it (tests/docs/readme.py says how its blocks and comments are
read): shell blocks run in bash in a temporary folder, long-running commands
(`toolgate up`, `toolgate serve`, a call that waits for a human) in the
background as in shells of their own, Python blocks with this interpreter,
`file` blocks saved where they say; JSON, Cedar and YAML blocks are checked
against the code. A page that needs a gateway starts one itself, as its
reader does. Liberties taken, and only these:

- the install commands (`python3 -m venv`, `pip install`, activating the
  venv) are not re-run, and `.venv/bin/toolgate` is the `toolgate` of this
  test's environment;
- `toolgate up` gets `--nats-port 0`, so this can run beside a gateway on 4222;
- a `toolgate up` block stops the one running first, as the page says (Ctrl-C);
- the audit page names placeholders that the table PLACEHOLDERS below fills
  in from its own run;
- the pages GUESTS below names, which offer to run against a gateway already
  running ("or use a running one, from its folder"), run so: in the folder of
  the page they follow, against its gateway (their `toolgate up` block is that
  page's, checked to be running there), one after another.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from tests.docs.readme import (
    CHECKED,
    RUNNABLE,
    Block,
    Command,
    all_blocks,
    json_documents,
    matches,
    page_name,
    pages,
    python_prints,
    read_blocks,
    shell_commands,
    split_comment,
)
from tests.harness import REPO_ROOT
from toolgate.contracts.calls import ToolCall, ToolResult
from toolgate.contracts.registry_bundle import ToolListing

BIN = Path(sys.executable).parent
# Words a reader replaces (docs/audit.md), filled in from that page's own run:
# acme.writer's call (the audit block also traces it as that agent's), and the
# bundle `toolgate up --example refund` wrote.
PLACEHOLDERS = {"CALL_ID": "call_02", "DIR": ".toolgate/examples/refund/policy"}
# Commands whose documented exit statuses are all an answer, not a failure: 1 is
# "decisions would change" for policy test.
ANSWERS = {
    "toolgate policy test": {0, 1},
}
INSTALL = re.compile(
    r"^\s*(python3 -m venv\b|\.venv/bin/pip install\b|pip install\b"
    r"|(\.|source) \.venv/bin/activate\s*$)"
)
BLOCK_DEADLINE_S = 300.0
READY_DEADLINE_S = 180.0


# ---------------------------------------------------------------- the page, without a stack


def blocks() -> list[Block]:
    """Every block of every page."""
    return all_blocks(REPO_ROOT)


def page_blocks(page: str) -> list[Block]:
    return read_blocks(REPO_ROOT / page, page)


def test_every_page_is_read() -> None:
    names = [page_name(path, REPO_ROOT) for path in pages(REPO_ROOT)]
    assert names[0] == "README.md" and "docs/index.md" in names and "docs/tools.md" in names


def test_every_block_is_run_or_checked_or_says_why_not() -> None:
    found = blocks()
    assert found, "no code blocks in README.md or docs/"
    for block in found:
        assert block.language in {*RUNNABLE, *CHECKED, ""} or block.file, (
            f"{block.where}: a ```{block.language} block nobody runs or checks"
        )
        if block.ready_at or block.output_of or block.file:
            assert block.not_run is None, block.where
    for path in pages(REPO_ROOT):
        page = page_name(path, REPO_ROOT)
        not_run = [b for b in found if b.not_run and b.page == page]
        assert len(not_run) <= 3, [f"{b.where}: {b.not_run}" for b in not_run]
    outputs = [b for b in found if b.output_of]
    assert all(b.language == "json" for b in outputs), [b.where for b in outputs]


def test_no_example_puts_an_approver_token_on_a_command_line() -> None:
    """The README passed the approver's token as `--token "$ALICE"`: every local user
    reads a command line (`ps`), and the web inbox logs in with the token alone. The
    environment ($TOOLGATE_APPROVER_TOKEN) is the owner's only."""
    on_a_command_line = re.compile(r"--token[ =]")
    found = [
        f"{block.where}: {command.text}"
        for block in blocks()
        if RUNNABLE.get(block.language) == "sh"
        for command in shell_commands(block.text)
        if on_a_command_line.search(command.text)
    ]
    assert found == []


def test_json_examples_are_wire_messages() -> None:
    """A JSON block that is not a command's output is a ToolCall, a ToolResult or an
    agent's ToolListing (docs/registry.md)."""
    checked = 0
    for block in blocks():
        if block.language != "json" or block.output_of or block.webhook_payload or block.file:
            continue
        for document in json_documents(block.text):
            raw = json.dumps(document).encode()
            kind: type[Any] = (
                ToolCall
                if "tool" in document
                else ToolListing
                if "tools" in document
                else ToolResult
            )
            try:
                msgspec.json.decode(raw, type=kind, strict=True)
            except msgspec.ValidationError as exc:
                pytest.fail(f"{block.where}: not a {kind.__name__}: {exc}")
            checked += 1
    assert checked >= 3


def shipped_policy_ids() -> set[str]:
    ids: set[str] = set()
    for path in (REPO_ROOT / "infra").rglob("*.cedar"):
        ids.update(re.findall(r'@id\("([^"]+)"\)', path.read_text(encoding="utf-8")))
    return ids


def test_cedar_examples_name_shipped_policies() -> None:
    shipped = shipped_policy_ids()
    for block in blocks():
        if block.language == "cedar" and not block.file:  # a file is checked by its page's run
            named = re.findall(r'@id\("([^"]+)"\)', block.text)
            assert named, block.where
            assert set(named) <= shipped, f"{block.where}: {set(named) - shipped} not shipped"


def test_cedar_example_2_is_the_shipped_file() -> None:
    """Worked example 2 quotes infra/policies/examples/refund_payment.cedar, policy for policy."""
    shipped = (REPO_ROOT / "infra/policies/examples/refund_payment.cedar").read_text()
    code = "\n".join(line for line in shipped.splitlines() if not line.startswith("//"))
    block = next(b for b in blocks() if b.language == "cedar" and "refund_payment" in b.text)
    assert " ".join(block.text.split()) in " ".join(code.split())


def test_yaml_examples_parse() -> None:
    for block in blocks():
        if block.language == "yaml":
            assert isinstance(yaml.safe_load(block.text), dict), block.where


@pytest.mark.parametrize(
    ("line", "code", "comment"),
    [
        ("toolgate agents list   # prints acme", "toolgate agents list", "prints acme"),
        (
            'toolgate call x \'{"a": "#1"}\'  # ok: fine',
            'toolgate call x \'{"a": "#1"}\'',
            "ok: fine",
        ),
        ("echo a#b", "echo a#b", ""),
    ],
)
def test_shell_comments(line: str, code: str, comment: str) -> None:
    assert split_comment(line) == (code, comment)


def test_shell_commands_join_continuations_and_read_expectations() -> None:
    commands = shell_commands(
        "toolgate call t '{}' \\\n  --user u   # denied: not yours\n"
        "# a comment\n\nls   # prints x y\n"
    )
    assert [c.text for c in commands] == ["toolgate call t '{}' \\\n  --user u", "ls"]
    assert commands[0].expect_status == "denied" and commands[0].expected_exit == 1
    assert commands[1].prints == "x y" and commands[1].expected_exit == 0


def test_a_file_block_is_saved_where_it_says_and_nowhere_else(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("## Adding a tool\n\n<!-- test: file tools/t.yaml -->\n```yaml\nname: t\n```\n")
    (block,) = read_blocks(page, "docs/page.md")
    assert (block.file, block.text, block.where) == (
        "tools/t.yaml",
        "name: t\n",
        "docs/page.md:4 (Adding a tool)",
    )
    reader = Reader(tmp_path / "home", {})
    reader.save(block)
    assert (tmp_path / "home" / "tools" / "t.yaml").read_text() == "name: t\n"
    for outside in ("../t.yaml", "/etc/t.yaml"):
        page.write_text(f"<!-- test: file {outside} -->\n```yaml\nname: t\n```\n")
        with pytest.raises(ValueError, match="unknown directive"):
            read_blocks(page)


def test_installing_and_activating_the_venv_is_not_rerun() -> None:
    line = "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && toolgate up"
    assert Reader.as_run(line) == "toolgate up --nats-port 0"
    assert Reader.as_run("source .venv/bin/activate") == ""


def test_documented_output_matching() -> None:
    assert matches({"a": 1, "b": ["x", "..."]}, {"a": 1, "b": ["x", "y", "z"], "c": 2})
    assert matches({"a": "..."}, {"a": {"deep": True}})
    assert not matches({"a": 1}, {"a": 2})
    assert not matches({"b": ["x"]}, {"b": ["x", "y"]})
    assert not matches({"a": 1}, {})


# ---------------------------------------------------------------- the page, against a stack


@dataclass
class Background:
    block: Block
    command: str
    process: subprocess.Popen[bytes]
    out: Path
    err: Path

    def output(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def stop(self, deadline: float = 90.0) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)  # Ctrl-C in its shell
        try:
            return self.process.wait(deadline)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
            raise AssertionError(
                f"{self.block.where}: {self.command!r} did not stop on "
                f"Ctrl-C within {deadline}s:\n{self.output()[-3000:]}"
            ) from None


@dataclass
class Reader:
    """A reader at a terminal in `home`, following the page."""

    home: Path
    env: dict[str, str]
    up: Background | None = None
    services: list[Background] = field(default_factory=list)
    last_background: Background | None = None
    last_stdout: str = ""
    ran: int = 0
    # The page being read (its commands' logs go under .readme/PAGE/), and whether it
    # joins the gateway already running here (GUESTS) instead of starting one.
    page: str = ""
    joining: bool = False

    @property
    def notes(self) -> Path:
        return self.home / ".readme" / self.page.replace("/", "_")

    # -------------------------------------------------------------- commands as they run

    @staticmethod
    def as_run(command: str) -> str:
        parts = [p for p in command.split("&&") if not INSTALL.match(p)]
        text = "&&".join(parts).strip()
        text = re.sub(r"(^|\s)\.venv/bin/toolgate(?=\s|$)", r"\1toolgate", text)
        if (
            re.match(r"^toolgate up\b", text)
            and "--nats-port" not in text
            and "--nats-url" not in text
        ):
            text = text.replace("toolgate up", "toolgate up --nats-port 0", 1)
        for word, value in PLACEHOLDERS.items():
            text = re.sub(rf"\b{word}\b", value, text)
        return text

    def shell(self, block: Block) -> None:
        commands = shell_commands(block.text)
        logs = self.notes / f"block{block.line}"
        logs.mkdir(parents=True)
        script = ["set +e"]
        for number, command in enumerate(commands):
            run = self.as_run(command.text)
            if not run:  # only install commands: nothing to run here (nor to check)
                continue
            allowed = self.allowed_exits(run, command)
            check = " -o ".join(f'"$rc" = "{code}"' for code in sorted(allowed))
            script.append(
                f"{{ {run}\n}} >{logs}/{number}.out 2>{logs}/{number}.err "
                f"</dev/null; rc=$?; echo $rc >{logs}/{number}.rc; "
                f"[ {check} ] || exit 0"
            )
        subprocess.run(
            ["bash", "-c", "\n".join(script)],
            cwd=self.home,
            env=self.env,
            timeout=BLOCK_DEADLINE_S,
            check=True,
        )
        for number, command in enumerate(commands):
            self.check_command(block, command, logs, number)

    def allowed_exits(self, run: str, command: Command) -> set[int]:
        for prefix, codes in ANSWERS.items():
            if run.startswith(prefix):
                return codes
        return {command.expected_exit}

    def check_command(self, block: Block, command: Command, logs: Path, number: int) -> None:
        if not self.as_run(command.text):
            return
        rc_file = logs / f"{number}.rc"
        assert rc_file.exists(), f"{block.where}: {command.text!r} never ran (one before failed)"
        exit_code = int(rc_file.read_text())
        stdout = (logs / f"{number}.out").read_text(errors="replace")
        stderr = (logs / f"{number}.err").read_text(errors="replace")
        said = (
            f"{block.where}: {command.text!r} exited {exit_code}\n"
            f"--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}"
        )
        assert exit_code in self.allowed_exits(self.as_run(command.text), command), said
        if command.prints is not None:
            assert command.prints in stdout, f"does not print {command.prints!r}: {said}"
        if command.expect_status is not None:
            assert json.loads(stdout)["status"] == command.expect_status, said
        self.last_stdout = stdout
        self.ran += 1

    def save(self, block: Block) -> None:
        """A file the page shows: the reader saves it where the page says."""
        assert block.file is not None
        path = self.home / block.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text)

    def python(self, block: Block) -> None:
        path = self.notes / f"block{block.line}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(block.text)
        done = subprocess.run(
            [sys.executable, str(path)],
            cwd=self.home,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_DEADLINE_S,
        )
        said = (
            f"{block.where}: exited {done.returncode}\n--- stdout\n{done.stdout[-3000:]}"
            f"\n--- stderr\n{done.stderr[-3000:]}"
        )
        assert done.returncode == 0, said
        for text in python_prints(block.text):
            assert text in done.stdout, f"does not print {text!r}: {said}"
        self.last_stdout = done.stdout
        self.ran += 1

    def background(self, block: Block) -> None:
        assert block.ready_at is not None
        for number, command in enumerate(shell_commands(block.text)):
            run = self.as_run(command.text)
            if not run:
                continue  # only install commands
            is_up = run.startswith("toolgate up")
            if is_up and self.joining:  # the gateway this page offers to use: running here
                assert run == "toolgate up --nats-port 0", f"{block.where}: {run!r}"
                assert self.up is not None and self.up.process.poll() is None, (
                    f"{block.where}: no gateway runs in this folder to use"
                )
                assert block.ready_at in self.up.output(), block.where
                self.joining = False
                self.ran += 1
                continue
            if is_up and self.up is not None:
                assert self.up.stop() == 0, (
                    f"toolgate up did not stop cleanly: {self.up.output()[-3000:]}"
                )
                self.up = None
            logs = self.notes
            logs.mkdir(parents=True, exist_ok=True)
            out, err = logs / f"bg{block.line}.{number}.out", logs / f"bg{block.line}.{number}.err"
            with open(out, "wb") as stdout, open(err, "wb") as stderr:
                process = subprocess.Popen(
                    ["bash", "-c", run],
                    cwd=self.home,
                    env=self.env,
                    stdout=stdout,
                    stderr=stderr,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            started = Background(block, run, process, out, err)
            if is_up:
                self.up = started
            else:
                self.services.append(started)
            deadline = time.monotonic() + READY_DEADLINE_S
            while block.ready_at not in started.output():
                assert process.poll() is None, (
                    f"{block.where}: {run!r} ended ({process.returncode}) before it said "
                    f"{block.ready_at!r}:\n{started.output()[-3000:]}"
                )
                assert time.monotonic() < deadline, (
                    f"{block.where}: {run!r} never said {block.ready_at!r}:\n"
                    f"{started.output()[-3000:]}"
                )
                time.sleep(0.2)
            if not is_up:
                self.last_background = started
            self.ran += 1

    def output(self, block: Block) -> None:
        documented = json_documents(block.text)
        assert len(documented) == 1, block.where
        if block.output_of == "background block":
            waited = self.last_background
            assert waited is not None, f"{block.where}: no background block before it"
            try:
                exit_code = waited.process.wait(BLOCK_DEADLINE_S)
            except subprocess.TimeoutExpired:
                raise AssertionError(
                    f"{block.where}: {waited.command!r} is still running:\n"
                    f"{waited.output()[-3000:]}"
                ) from None
            self.services.remove(waited)
            stdout = waited.out.read_text()
            assert exit_code == 0, (
                f"{block.where}: {waited.command!r} exited {exit_code}:\n{waited.output()[-3000:]}"
            )
        else:
            stdout = self.last_stdout
        actual = json.loads(stdout)
        assert matches(documented[0], actual), (
            f"{block.where}: printed\n{json.dumps(actual, indent=2)}\nnot as documented"
        )

    def stop_services(self) -> list[str]:
        """Ctrl-C in each shell still running something other than `toolgate up`."""
        problems = []
        for service in reversed(self.services):
            code = service.stop()
            if code not in (0, -signal.SIGINT, 130):
                problems.append(
                    f"{service.command!r} exited {code} on Ctrl-C:\n{service.output()[-2000:]}"
                )
        self.services = []
        return problems

    def stop_all(self) -> None:
        problems = self.stop_services()
        if self.up is not None:
            code = self.up.stop()
            if code != 0:
                problems.append(f"toolgate up exited {code} on Ctrl-C:\n{self.up.output()[-2000:]}")
        assert not problems, "\n".join(problems)


def reader_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TOOLGATE_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env["PATH"] = os.pathsep.join([str(BIN), env.get("PATH", "")])
    return env


def runnable(block: Block) -> bool:
    return not block.not_run and not block.output_of and block.language in RUNNABLE


def pages_that_run() -> list[str]:
    names = [page_name(path, REPO_ROOT) for path in pages(REPO_ROOT)]
    return [name for name in names if any(runnable(b) and not b.file for b in page_blocks(name))]


# Pages run after another page, in its folder and against its gateway, because they offer
# to (`toolgate up` in a fresh folder, "or use a running one, from its folder"; "with a
# gateway running in a folder"): each `toolgate up` started costs ~15 CPU-s. None of
# them needs an empty store: clients.md's calls take new call_ids, identities.md adds,
# uses and revokes its own agent acme.writer (no other page here uses it),
# observability.md asks `toolgate status` (exit 0 whatever the counts), scaling.md
# starts copies of services beside the running ones and stops them.
GUESTS = {
    "docs/getting-started.md": (
        "docs/clients.md",
        "docs/identities.md",
        "docs/operations/observability.md",
        "docs/operations/scaling.md",
    ),
}


def runs() -> list[str]:
    """The pages that start a run of their own (the others are GUESTS of one of them)."""
    guests = {page for pages in GUESTS.values() for page in pages}
    return [page for page in pages_that_run() if page not in guests]


def test_guests_run_and_offer_a_running_gateway() -> None:
    hosts = runs()
    for host, guests in GUESTS.items():
        assert host in hosts
        for page in guests:
            assert page in pages_that_run(), page
            ups = [b for b in page_blocks(page) if b.ready_at and "toolgate up" in b.text]
            assert [b.text for b in ups] == ["toolgate up\n"], page  # the one it may skip
            assert not any(b.file for b in page_blocks(page)), page


# The runs are spread over PAGE_GROUPS test files, tests/docs/test_pages_N.py: pytest-xdist
# hands out whole files (addopts' `--dist loadfile`), and one file holding every page ran
# them all one after another on one worker.
PAGE_GROUPS = 4


def gateways_started(page: str) -> int:
    """How many `toolgate up`s a page's run starts (its background `toolgate up` blocks)."""
    return sum(
        1 for b in page_blocks(page) if b.ready_at and not b.not_run and "toolgate up" in b.text
    )


def run_cost(page: str) -> tuple[int, int]:
    pages = [page, *GUESTS.get(page, ())]
    return gateways_started(page), sum(len(page_blocks(p)) for p in pages)


def page_group(number: int) -> list[str]:
    """The runs test_pages_{number}.py makes: dealt out in turn, those that start the most
    gateways (then those with the most blocks) first, so that the groups cost alike."""
    by_cost = sorted(runs(), key=lambda page: (*(-n for n in run_cost(page)), page))
    return by_cost[number - 1 :: PAGE_GROUPS]


def test_every_page_that_runs_is_in_a_group_file() -> None:
    grouped = [page for number in range(1, PAGE_GROUPS + 1) for page in page_group(number)]
    assert sorted(grouped) == sorted(runs())
    for number in range(1, PAGE_GROUPS + 1):
        module = Path(__file__).with_name(f"test_pages_{number}.py")
        assert f"page_group({number})" in module.read_text(), module
    assert not Path(__file__).with_name(f"test_pages_{PAGE_GROUPS + 1}.py").exists()


def run_page(page: str, tmp_path: Path) -> None:
    """`page` read top to bottom by a reader in a fresh folder, then its GUESTS in turn in
    the same folder: test_pages_N.py's test."""
    home = tmp_path / "reader"
    home.mkdir()
    reader = Reader(home, reader_env())
    read = [page, *GUESTS.get(page, ())]
    expected = 0
    try:
        for number, name in enumerate(read):
            reader.page, reader.joining = name, number > 0
            reader.last_background, reader.last_stdout = None, ""
            found = page_blocks(name)
            for block in found:
                if block.not_run:
                    continue
                if block.file:
                    reader.save(block)
                elif block.ready_at:
                    reader.background(block)
                elif block.output_of:
                    reader.output(block)
                elif RUNNABLE.get(block.language) == "sh":
                    reader.shell(block)
                elif block.language == "python":
                    reader.python(block)
            assert not reader.joining, f"{name}: no `toolgate up` block to join"
            problems = reader.stop_services()  # the page's own shells, Ctrl-C
            assert not problems, "\n".join(problems)
            # Every command of every block ran (an install-only command has nothing to run).
            expected += sum(
                1
                if b.language == "python"
                else sum(1 for c in shell_commands(b.text) if reader.as_run(c.text))
                for b in found
                if runnable(b) and not b.file
            )
            assert reader.ran == expected, name
    finally:
        reader.stop_all()
