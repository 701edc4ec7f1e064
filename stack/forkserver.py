"""Services forked from a process that has imported them once, instead of started cold.

A service process spends most of its start importing (faststream, pydantic, nats-py,
cedarpy, clickhouse-connect, the MCP SDK, toolgate itself): about 0.7 CPU-s each, seven
or eight times per gateway, and again at every restart. The fork server is a process
(`python -m toolgate.stack.forkserver`) that imports all of that once, then forks one
child per `toolgate serve NAME ...` command it is sent. A child runs the command as
`python -m toolgate.cli ...` would (its own argv, environment, working directory, log
file, session), and names itself after it (setproctitle), so `ps` and `toolgate bench`
see the service, not the fork server.

One fork server per environment (a child's environment must be the one its modules
were imported under), shared by every stack of the parent process; it holds no state
but its imports. It reports each child's exit code; `ForkedProcess` gives the parent
the part of `subprocess.Popen` the supervisor uses. It ends when the parent does
(its stdin reaches end of file, however the parent died), and its children with it
(each one's parent-death signal).

Linux only; `TOOLGATE_FORK_SERVER=0` starts every service as its own interpreter, as
before. A fork server that cannot start or dies is not fatal: the service is then
started the plain way.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from toolgate.stack.processes import die_with_parent

log = logging.getLogger("toolgate.stack")

# What the fork server imports before it forks: every service's entry point.
PRELOAD = (
    "toolgate.cli.main",
    "toolgate.cli.serve",
    "toolgate.cli.status",
    "toolgate.cli.mcp",
    "toolgate.runtime.process",
    "toolgate.runtime.telemetry",
    "toolgate.runtime.health",
    "toolgate.services.validator.app",
    "toolgate.services.policy.app",
    "toolgate.services.executor.app",
    "toolgate.services.attacher.app",
    "toolgate.services.approvals.app",
    "toolgate.services.notifier.app",
    "toolgate.services.audit.app",
    "toolgate.services.mcp_front.app",
)
ENV_SWITCH = "TOOLGATE_FORK_SERVER"


def enabled() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "fork")
        and os.environ.get(ENV_SWITCH, "1") != "0"
    )


def toolgate_args(command: list[str]) -> list[str] | None:
    """The arguments of a `python -m toolgate.cli ...` command; None: another command."""
    if command[:3] == [sys.executable, "-m", "toolgate.cli"]:
        return command[3:]
    return None


# -- the parent's side ----------------------------------------------------------------


class ForkServerGone(RuntimeError):
    """The fork server is not there (it failed to start, or died): start plainly."""


class ForkedProcess:
    """A child of the fork server, as the supervisor handles a `subprocess.Popen`:
    pid, poll, wait, send_signal, terminate, kill, returncode (negative: the signal)."""

    def __init__(self, pid: int, args: list[str]) -> None:
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._exited = threading.Event()
        # A handle on this very process: a signal never reaches a later one with its pid.
        self._pidfd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            self._pidfd = os.pidfd_open(pid)

    def _ended(self, code: int) -> None:
        self.returncode = code
        self._exited.set()
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, OSError):
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, sig)
            else:
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server process, and the children it forked for this parent."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "toolgate.stack.forkserver"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env=env,
                start_new_session=True,
            )
        self._lock = threading.Lock()
        self._next = 0
        self._waiting: dict[int, tuple[threading.Event, list[int]]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._early_exits: dict[int, int] = {}
        self.gone = False
        threading.Thread(target=self._read, name="forkserver-reader", daemon=True).start()

    def spawn(
        self, args: list[str], env: dict[str, str], log_path: Path, cwd: str
    ) -> ForkedProcess:
        request = {"args": args, "env": env, "log": str(log_path), "cwd": cwd}
        done = threading.Event()
        answer: list[int] = []
        with self._lock:
            if self.gone:
                raise ForkServerGone("the fork server has ended")
            self._next += 1
            number = self._next
            self._waiting[number] = (done, answer)
            line = json.dumps({"id": number, **request}).encode() + b"\n"
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(line)
                self.process.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._waiting.pop(number, None)
                raise ForkServerGone(f"the fork server has ended: {exc!r}") from exc
        # Its imports come first (a few seconds on a loaded machine): wait for them.
        if not done.wait(120) or not answer:
            with self._lock:
                self._waiting.pop(number, None)
            raise ForkServerGone("the fork server did not fork")
        child = answer[0]
        with self._lock:
            process = self._children.setdefault(child, ForkedProcess(child, args))
            if child in self._early_exits:  # it ended before its pid was read here
                process._ended(self._early_exits.pop(child))
        return process

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            words = raw.decode(errors="replace").split()
            if len(words) == 3 and words[0] == "spawned":
                with self._lock:
                    waiting = self._waiting.pop(int(words[1]), None)
                    if waiting is not None:
                        waiting[1].append(int(words[2]))
                        waiting[0].set()
            elif len(words) == 3 and words[0] == "exited":
                pid, code = int(words[1]), int(words[2])
                with self._lock:
                    process = self._children.pop(pid, None)
                    if process is None:
                        self._early_exits[pid] = code
                if process is not None:
                    process._ended(code)
        # End of file: the fork server is gone, and its children with it.
        with self._lock:
            self.gone = True
            for done, _ in self._waiting.values():
                done.set()
            self._waiting.clear()
            children = list(self._children.values())
            self._children.clear()
        for process in children:
            process._ended(-signal.SIGKILL)


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_servers_lock = threading.Lock()


@atexit.register
def _end_all() -> None:
    """At the parent's exit, each fork server's stdin closed: it ends (and the children
    still running end with it, as they would at the parent's death)."""
    for server in list(_servers.values()):
        with contextlib.suppress(Exception):
            assert server.process.stdin is not None
            server.process.stdin.close()
        with contextlib.suppress(Exception):
            server.process.wait(5)


def spawn(command: list[str], env: dict[str, str], log_path: Path) -> ForkedProcess | None:
    """`command` forked from the fork server of `env` (started on first use), its output
    appended to `log_path`. None: not a toolgate command, the fork server is off, or it
    could not fork: start it plainly."""
    args = toolgate_args(command)
    if args is None or not enabled():
        return None
    key = tuple(sorted(env.items()))
    try:
        with _servers_lock:
            server = _servers.get(key)
            if server is None or server.gone:
                server = _servers[key] = ForkServer(env, log_path.with_name("forkserver.log"))
        return server.spawn(args, env, log_path, os.getcwd())
    except (ForkServerGone, OSError) as exc:
        log.warning("fork server unavailable (%s): starting %s plainly", exc, args[:2])
        return None


# -- the fork server's side ---------------------------------------------------------------


def preload() -> None:
    # setproctitle takes over the argv and environ area here, before the fork: a child
    # that first calls it after replacing its environment cannot (its title stays ours).
    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(" ".join(sys.orig_argv))
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a child that needs it fails as it would have alone
            print(f"forkserver: cannot preload {name}: {exc!r}", file=sys.stderr, flush=True)
    if threading.active_count() > 1:  # a thread would not survive the fork
        print("forkserver: a preloaded module started a thread", file=sys.stderr, flush=True)


def serve() -> int:
    """Fork a child per request line on stdin; say `spawned ID PID` and `exited PID CODE`
    on stdout; end at end of file."""
    preload()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler: the wake-up fd gets it
    signal.set_wakeup_fd(wake_write)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.fd == wake_read:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_read, 4096)
                _reap()
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return 0
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:  # the child: never back into this loop
                    selector.close()
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    raise SystemExit(_run_child(request))
                _say(f"spawned {request['id']} {pid}")
        _reap()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _say(f"exited {pid} {os.waitstatus_to_exitcode(status)}")


def _say(line: str) -> None:
    os.write(1, (line + "\n").encode())


def _run_child(request: dict[str, Any]) -> int:
    """In the forked child: become `python -m toolgate.cli ARGS` and run it."""
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    die_with_parent()  # its parent: the fork server
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    args = [str(a) for a in request["args"]]
    argv = [sys.executable, "-m", "toolgate.cli", *args]
    with contextlib.suppress(Exception):
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))
    sys.argv = [str(Path(sys.modules["toolgate.cli"].__file__ or "").parent / "__main__.py"), *args]
    sys.path[0] = request["cwd"]
    from toolgate.cli.main import main

    try:
        return int(main(args) or 0)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(serve())
