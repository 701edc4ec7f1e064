"""A real ClickHouse HTTP server embedded from the PyPI package ``chdb-core``.

Run in the foreground::

    python -m toolgate.stack.clickhouse_server --data-dir DIR --port N [--host 127.0.0.1]

or as a child process from Python::

    with EmbeddedClickHouse(Path("state/ch")) as ch:
        client = connect(ch.url_for("auditor"))  # toolgate.services.audit.connection

(HTTP answers only toolgate's users, in the X-ClickHouse-User/Key headers: see
clickhouse_access.http_handlers_xml.)

How it works (chdb-core 26.9.0):

* ``chdb.connect()`` runs a cut-down engine that cannot listen ("Can't start servers
  because start_servers_callback is not set").  ``chdb._chdb.query(sql, fmt, path=...)``
  runs the full clickhouse-local program instead; it reads ``./config.xml`` from the
  *current working directory* (listen_host / http_port) and honours
  ``SYSTEM START LISTEN HTTP``.
* The listener only lives while that call runs, so the same multi-statement call goes on
  with a query that never ends (``HOLD_SQL`` below: ``sleepEachRow`` over the infinite
  ``system.numbers``, one row per block, output ``FORMAT Null``).  We run that call in a
  thread; the main thread waits for SIGTERM/SIGINT and then sends ``KILL QUERY ... SYNC``
  over HTTP to our own port.  The call returns, clickhouse-local shuts down cleanly
  (tables detached, ``DIR/data/status`` removed) and the process exits 0.
* The output format given to ``_chdb.query`` becomes the default format of every HTTP
  query, so it must be ``TabSeparated`` (with ``Null`` curl would get empty bodies);
  the hold query carries its own ``FORMAT Null``.
* One server per process (the engine is process global).  Data under ``path`` (DIR/data)
  survives restarts, also after SIGKILL: the ``status`` file left behind is not a lock
  (clickhouse only flocks it while running) and is overwritten on the next start.  A
  second server on the same data dir fails with "Cannot lock file .../status".
* chdb installs its own signal handlers; we keep SIGTERM/SIGINT ours (see serve()).
* Idle keep-alive connections hold up the engine's shutdown; see KEEP_ALIVE_TIMEOUT.
* The engine's own logger is essentially silent in this mode; its stdout/stderr and our
  Python log go to ``DIR/clickhouse.log``.

Measured on the dev VM (2 vCPU, chdb-core 26.9.0, Python 3.11): spawn -> ``/ping``
answers ``Ok.`` in 0.5-0.8 s (``import chdb`` is ~0.45 s of it); stop 0.2-0.7 s, ~2.5 s
if a client keeps an idle keep-alive connection.  RSS ~280-300 MB idle, ~370-390 MB
after 1.2M JSON rows; idle CPU ~0.  clickhouse-connect, one client, 10k-row batches into
MergeTree (UInt64, JSON): ~120k rows/s with JSON passed as str, ~55k rows/s with Python
dicts (client-side serialisation bound); 8 concurrent clients together ~115k rows/s.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from toolgate.stack import clickhouse_access
from toolgate.stack.processes import free_port, port_is_free

__all__ = [
    "EmbeddedClickHouse",
    "ClickHouseServerError",
    "free_port",
    "main",
    "serve",
]

log = logging.getLogger("toolgate.clickhouse_server")

LOG_NAME = "clickhouse.log"
DEFAULT_DATABASE = "toolgate"
RUN_DIR_NAME = "run"
DATA_DIR_NAME = "data"

# Marker used to find (and kill) the query that keeps the listener alive.
HOLD_MARKER = "toolgate_hold_listener"
HOLD_SQL = (
    f"SELECT sleepEachRow(0.5) AS {HOLD_MARKER} FROM system.numbers "
    "SETTINGS max_block_size = 1, max_execution_time = 0 FORMAT Null"
)
STARTUP_SQL = "SYSTEM START LISTEN HTTP; " + HOLD_SQL
# The KILL query itself starts with "KILL", so the anchored LIKE never matches it.
KILL_SQL = f"KILL QUERY WHERE query LIKE 'SELECT sleepEachRow(0.5) AS {HOLD_MARKER}%' SYNC"

# On shutdown clickhouse-local stops the HTTP server and waits up to
# `shutdown_wait_unfinished` seconds for open connections; an idle keep-alive connection
# only ends after `keep_alive_timeout` (default 30 s here), and if any connection is still
# open when the wait ends the engine exits forcefully with code 1 (status file left, like
# a crash).  A short keep-alive (the old ClickHouse default of 3 s; clickhouse-connect
# retries a request on a connection the server closed) keeps SIGTERM shutdowns clean.
KEEP_ALIVE_TIMEOUT = 3
# A live process whose listener is gone for this many supervisor rounds is restarted.
UNANSWERED_PINGS = 3
SHUTDOWN_WAIT = 10

CONFIG_TEMPLATE = """<clickhouse>
    <listen_host>{host}</listen_host>
    <http_port>{port}</http_port>
    <keep_alive_timeout>{keep_alive}</keep_alive_timeout>
    <shutdown_wait_unfinished>{shutdown_wait}</shutdown_wait_unfinished>{access}{handlers}
</clickhouse>
"""
# Users, passwords and grants (stack/clickhouse_access.py): honoured only from a users.xml
# named here, never from <users> in config.xml.
ACCESS_TEMPLATE = """
    <user_directories>
        <users_xml><path>{users}</path></users_xml>
        <local_directory><path>{local}/</path></local_directory>
    </user_directories>"""
USERS_FILE = "users.xml"


class ClickHouseServerError(RuntimeError):
    """The embedded server failed to start or stop."""


def _http_base(host: str, port: int) -> str:
    return f"http://{host}:{port}"


def ping(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{_http_base(host, port)}/ping", timeout=timeout) as r:
            return r.status == 200 and r.read().strip() == b"Ok."
    except (OSError, urllib.error.URLError):
        return False


def _post(
    host: str, port: int, sql: str, timeout: float, login: tuple[str, str] | None = None
) -> bytes:
    req = urllib.request.Request(f"{_http_base(host, port)}/", data=sql.encode())
    if login is not None:
        req.add_header("X-ClickHouse-User", login[0])
        req.add_header("X-ClickHouse-Key", login[1])
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _tail(path: Path, lines: int = 40) -> str:
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return "(no log)"
    return "\n".join(data.decode(errors="replace").splitlines()[-lines:])


# --------------------------------------------------------------------------------------
# Foreground server (runs inside its own process)
# --------------------------------------------------------------------------------------


def _redirect_output(log_path: Path) -> int:
    """Point fds 1 and 2 (the engine writes there too) at the log file.

    Returns a dup of the original stderr for the one 'ready' line shown on a terminal."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return saved


def serve(
    data_dir: Path,
    port: int,
    host: str = "127.0.0.1",
    parent_pid: int | None = None,
    quiet: bool = True,
) -> int:
    """Run the server until SIGTERM/SIGINT (or the parent dies). Returns an exit code."""
    if not port:
        raise ClickHouseServerError(
            "port 0 is not supported by ClickHouse; pick one with free_port()"
        )
    data_dir = Path(data_dir).resolve()
    run_dir = data_dir / RUN_DIR_NAME
    db_dir = data_dir / DATA_DIR_NAME
    log_path = data_dir / LOG_NAME
    run_dir.mkdir(parents=True, exist_ok=True)
    db_dir.mkdir(parents=True, exist_ok=True)
    users = run_dir / USERS_FILE
    access = (
        ACCESS_TEMPLATE.format(users=users, local=data_dir / "access") if users.exists() else ""
    )
    config = CONFIG_TEMPLATE.format(
        host=host,
        port=int(port),
        keep_alive=KEEP_ALIVE_TIMEOUT,
        shutdown_wait=SHUTDOWN_WAIT,
        access=access,
        # With users, HTTP reaches only them (and /ping): never the engine's own `default`.
        handlers=clickhouse_access.http_handlers_xml() if users.exists() else "",
    )
    (run_dir / "config.xml").write_text(config)

    saved_stderr = _redirect_output(log_path) if quiet else os.dup(2)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s [toolgate.clickhouse pid=%(process)d] %(message)s",
        stream=sys.stderr,
        force=True,
    )
    log.info("starting: data=%s http=%s:%s", db_dir, host, port)

    stop = threading.Event()
    stop_reason: list[str] = []

    def on_signal(signum, _frame):
        if stop.is_set():
            log.warning("second signal %s while stopping: forced exit", signum)
            os._exit(128 + signum)
        stop_reason.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    t0 = time.monotonic()
    # clickhouse-local reads ./config.xml, and `import chdb` itself already boots an
    # in-memory engine once, so change directory before the import.
    os.chdir(run_dir)
    from chdb import _chdb  # heavy import, only in the server process

    # chdb installs process-wide handlers (SIGTERM, SIGINT, SIGSEGV, ...) when an engine
    # starts.  Keep SIGTERM/SIGINT ours so a stop always goes through KILL QUERY:
    # disable chdb's installation and (re)install Python's once the engine is up.
    if hasattr(_chdb, "set_signal_handlers_enabled"):
        _chdb.set_signal_handlers_enabled(0)

    def install_handlers() -> None:
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    install_handlers()

    outcome: dict[str, object] = {}

    def run_engine() -> None:
        # Engine errors (port busy, "Cannot lock file .../status. Another server instance
        # in same directory is already running", ...) are printed to stderr, i.e. the log;
        # the result object usually does not carry them.
        try:
            # chdb's C extension has no stubs.
            run_query = _chdb.query  # type: ignore[attr-defined]
            res = run_query(
                STARTUP_SQL,
                "TabSeparated",
                path=str(db_dir),
            )
            if res.has_error():
                outcome["error"] = res.error_message()
        except BaseException as e:
            outcome["error"] = f"{type(e).__name__}: {e}"

    engine = threading.Thread(target=run_engine, name="clickhouse-engine", daemon=True)
    engine.start()

    ready = False
    while engine.is_alive() and not stop.is_set():
        if not ready and ping(host, port, timeout=0.5):
            ready = True
            install_handlers()
            msg = f"ready: http://{host}:{port} in {time.monotonic() - t0:.2f}s"
            log.info(msg)
            if os.isatty(saved_stderr):
                os.write(saved_stderr, (msg + "\n").encode())
        if parent_pid is not None and os.getppid() != parent_pid:
            stop_reason.append("parent exited")
            stop.set()
            break
        stop.wait(0.1 if not ready else 0.5)

    if not stop.is_set():
        # The engine call returned on its own: it failed (e.g. port busy) or was killed
        # by someone else over HTTP.
        log.error(
            "engine call returned without a stop request (%s): %s",
            "after start-up" if ready else "during start-up",
            outcome.get("error") or "see the engine error above, or the hold query was killed",
        )
        return 1

    log.info("stopping (%s)", ", ".join(stop_reason) or "requested")
    # Locked down, only the admin may end the keep-alive query (it runs as `default`).
    admin = clickhouse_access.read_logins(data_dir / clickhouse_access.LOGINS_FILE).get("admin")
    stopper = (clickhouse_access.user_of("admin"), admin) if admin else None
    # The engine itself force-exits SHUTDOWN_WAIT s after the listener stops if
    # connections remain; give it that plus a margin before we give up.
    grace = SHUTDOWN_WAIT + 10
    deadline = time.monotonic() + grace
    killed = False
    while engine.is_alive() and time.monotonic() < deadline:
        if not killed:
            try:
                # KILL ... SYNC answers one row per killed query, nothing if none matched
                # (e.g. a signal that came before the hold query started): retry then.
                killed = bool(_post(host, port, KILL_SQL, timeout=5, login=stopper).strip())
            except (OSError, urllib.error.URLError) as e:
                log.info("kill not delivered yet: %s", e)
        engine.join(timeout=0.2 if killed else 0.5)
    if engine.is_alive():
        log.error("engine did not stop within %ss; forcing exit", grace)
        logging.shutdown()
        os._exit(1)
    err = str(outcome.get("error") or "")
    if err and "QUERY_WAS_CANCELLED" not in err:
        log.warning("engine returned: %s", err)
    log.info("stopped cleanly")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Embedded ClickHouse HTTP server (chdb-core).")
    p.add_argument("--data-dir", required=True, type=Path)
    p.add_argument("--port", required=True, type=int)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    p.add_argument("--verbose", action="store_true", help="do not redirect output to the log file")
    a = p.parse_args(argv)
    return serve(a.data_dir, a.port, a.host, parent_pid=a.parent_pid, quiet=not a.verbose)


# --------------------------------------------------------------------------------------
# Child-process handle
# --------------------------------------------------------------------------------------


class EmbeddedClickHouse:
    """Runs the server above as a child process (own session, so Ctrl-C is ours to handle)."""

    def __init__(
        self,
        data_dir: Path | str,
        port: int = 0,
        host: str = "127.0.0.1",
        database: str = DEFAULT_DATABASE,
    ):
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.port = port or free_port(host)
        # The writer's and the auditor's grants name this database; the admin's cover all.
        self.database = database
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None
        self.restarts = 0
        self._unanswered = 0

    # -- properties
    @property
    def url(self) -> str:
        """The server, no login (a client without one is `default`, who may do nothing)."""
        return _http_base(self.host, self.port)

    @property
    def logins_path(self) -> Path:
        return self.data_dir / clickhouse_access.LOGINS_FILE

    def url_for(self, role: str, database: str | None = None) -> str:
        """The URL that logs in as `role` (admin, writer, auditor) on `database`."""
        password = clickhouse_access.ensure_logins(self.data_dir)[role]
        return clickhouse_access.with_login(
            f"{self.url}/{database or self.database}", role, password
        )

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_NAME

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_bytes(self) -> int | None:
        if not self.running() or self.proc is None:
            return None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return None

    # -- lifecycle
    def start(self, timeout: float = 60) -> EmbeddedClickHouse:
        if self.running():
            return self
        if not port_is_free(self.port, self.host):
            raise ClickHouseServerError(f"port {self.host}:{self.port} is already in use")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        # Its files are the audit (arguments, results): its owner's alone, whatever
        # the folder above it allows; ClickHouse's logins guard the rest.
        os.chmod(self.data_dir, 0o700)
        self.write_access()
        cmd = [
            sys.executable,
            "-m",
            "toolgate.stack.clickhouse_server",
            "--data-dir",
            str(self.data_dir),
            "--port",
            str(self.port),
            "--host",
            self.host,
            "--parent-pid",
            str(os.getpid()),
        ]
        t0 = time.monotonic()
        with open(self.log_path, "ab") as logf:  # catches output before the child redirects
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        deadline = t0 + timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self.proc = None
                raise ClickHouseServerError(
                    f"embedded ClickHouse exited with code {rc} during start-up; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            if ping(self.host, self.port, timeout=0.5):
                break
            if time.monotonic() > deadline:
                self.kill()
                raise ClickHouseServerError(
                    f"embedded ClickHouse did not answer {self.url}/ping within {timeout}s; "
                    f"log {self.log_path}:\n{_tail(self.log_path)}"
                )
            time.sleep(0.05)
        self.startup_seconds = time.monotonic() - t0
        return self

    def write_access(self) -> None:
        """users.xml (0600) from the kept passwords: written afresh at every start."""
        logins = clickhouse_access.ensure_logins(self.data_dir)
        run_dir = self.data_dir / RUN_DIR_NAME
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / USERS_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(clickhouse_access.users_xml(logins, self.database))
        os.chmod(path, 0o600)

    def ensure_running(self, timeout: float = 60) -> bool:
        """Start the server again if it died (SIGKILL, OOM, its keep-alive query killed)
        or stopped answering /ping UNANSWERED_PINGS times in a row (hung, or its listener
        gone). True if it was restarted."""
        if self.running():
            if ping(self.host, self.port, timeout=1.0):
                self._unanswered = 0
                return False
            self._unanswered += 1
            if self._unanswered < UNANSWERED_PINGS:
                return False
            log.warning("embedded ClickHouse stopped answering /ping; restarting it")
            self.kill()
        rc = self.proc.returncode if self.proc is not None else None
        self.proc = None
        self._unanswered = 0
        log.warning("embedded ClickHouse exited with %s; restarting it", rc)
        self.restarts += 1
        self.start(timeout)
        return True

    def _signal(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)  # child is the leader of its own session/group

    def stop(self, timeout: float = 20) -> int | None:
        """SIGTERM, wait up to ``timeout``, SIGKILL as a last resort. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("embedded ClickHouse pid %s ignored SIGTERM; killing", self.proc.pid)
                self._signal(signal.SIGKILL)
                self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def kill(self) -> int | None:
        """SIGKILL (simulates a crash)."""
        if self.proc is None:
            return None
        self._signal(signal.SIGKILL)
        self.proc.wait()
        rc = self.proc.returncode
        self.proc = None
        return rc

    def __enter__(self) -> EmbeddedClickHouse:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running() else "stopped"
        return f"EmbeddedClickHouse({str(self.data_dir)!r}, url={self.url!r}, {state})"


if __name__ == "__main__":
    sys.exit(main())
