"""`toolgate up`: the whole gateway on one machine, each service its own process.

Starts nats-server (unless given a URL), applies the topology, then runs
each service with the same `toolgate serve NAME` command an SRE would run,
restarting any that dies, and stops everything on SIGINT or SIGTERM:
services first, then the servers.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType

import nats
import nats.errors
from nats.js import JetStreamContext
from nats.js.errors import Error as JetStreamError
from nats.js.errors import KeyWrongLastSequenceError, ServiceUnavailableError

from toolgate.contracts.authorization import ensure_keypair
from toolgate.contracts.registry import RegistryError, load_registry, tool_dirs
from toolgate.contracts.registry_bundle import registry_from_files
from toolgate.runtime import bundle_versions
from toolgate.runtime.bundle_bucket import fetch_active
from toolgate.runtime.creds import connect_options, nats_servers
from toolgate.runtime.health import probe
from toolgate.runtime.served_registry import REGISTRY_BUNDLE, local_differs, served_bundle
from toolgate.runtime.served_registry import describe as describe_registry
from toolgate.runtime.settings import write_context
from toolgate.runtime.signed_bundles import load_verify_key as load_registry_key
from toolgate.runtime.topology import (
    Topology,
    apply_topology,
    refresh_ack_waits,
    registry_accepted_bucket_config,
    registry_bucket_config,
)
from toolgate.services.policy import versions
from toolgate.services.policy.bundle import DEFAULT_BUNDLE_DIR, bundle_version, read_bundle_dir
from toolgate.services.policy.pushing import push_next_version, read_state
from toolgate.services.policy.signing import BundleRefused, ensure_signing_key, load_verify_key
from toolgate.stack import forkserver
from toolgate.stack.clickhouse_server import EmbeddedClickHouse
from toolgate.stack.gateway_lock import GatewayRunning, claim_data_dir, release
from toolgate.stack.nats_auth import Credentials, add_agent, create_credentials, list_agents
from toolgate.stack.nats_server import EmbeddedNats, NatsCluster
from toolgate.stack.processes import (
    ChildProcess,
    die_with_parent,
    free_port,
    kill_process,
    port_is_free,
    stop_process,
    stop_processes,
)
from toolgate.stack.services import AUDIT, MCP, NOTIFIER, PIPELINE, SERVICES

log = logging.getLogger("toolgate.up")
# How long streams and buckets may wait for a just-started JetStream to take them.
JETSTREAM_READY_S = 30.0

# How long a service may take to stop on SIGTERM before it is killed.
SERVICE_STOP_S = 15.0
# How often `toolgate up` asks each service's /healthz.
HEALTH_CHECK_S = 5.0
# The identity `toolgate up` mints for first use (`toolgate agents add` makes more).
DEFAULT_TENANT = "default"
DEFAULT_AGENT = "researcher"
# `toolgate up --example NAME`: a package toolgate.infra.examples.NAME with REGISTRY_DIR,
# POLICY_DIR (None, or relative: under the data dir), AGENTS ((tenant, agent) to mint),
# TRY (a command to show) and prepare(data_dir) (its data).
EXAMPLES = ("orders", "refund")


# In the data dir: the MCP front door's port, kept across `toolgate up` restarts.
MCP_PORT_FILE = "mcp-port"
# The data dir: read, written and entered by its owner alone.
DATA_DIR_MODE = 0o700


def recorded_port(record: Path) -> int | None:
    """The port written in `record`, or None (no file, or not a port)."""
    try:
        port = int(record.read_text().strip())
    except (OSError, ValueError):
        return None
    return port if 0 < port < 65536 else None


class StackError(RuntimeError):
    """`toolgate up` cannot start as asked; the message is one line saying why and what to do.
    `exit_code`: 2 bad configuration, 3 a server it needs is not there or says no."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def load_example(name: str) -> ModuleType:
    if name not in EXAMPLES:
        raise ValueError(f"no example {name!r} (examples: {', '.join(EXAMPLES)})")
    return importlib.import_module(f"toolgate.infra.examples.{name}")


def serve_command(
    name: str,
    nats_url: str,
    data_dir: Path,
    registry_dirs: list[Path],
    extra: list[str] | None = None,
    creds: Path | None = None,
    builtin_tools: bool = True,
) -> list[str]:
    command = [
        sys.executable,
        "-m",
        "toolgate.cli",
        "serve",
        name,
        "--nats-url",
        nats_url,
        "--data-dir",
        str(data_dir),
    ]
    if creds is not None:
        command += ["--creds", str(creds)]
    for directory in registry_dirs:
        command += ["--registry", str(directory)]
    if not builtin_tools:
        command.append("--no-builtin-tools")
    return command + (extra or [])


@dataclass
class ServiceProcess:
    name: str
    command: list[str]
    log_path: Path
    process: ChildProcess | None = None
    restarts: int = 0
    started_at: float = 0.0
    # Its /healthz and /metrics (`--http-port`); None: it serves none.
    http_port: int | None = None
    failed_checks: int = 0
    # The environment it was first started with: a restart runs the same service
    # (its OTLP endpoint, its TOOLGATE_* settings), whatever the parent's is by then.
    env: dict[str, str] | None = None
    # Forked from the fork server (stack/forkserver.py) if it can be; False: its own
    # interpreter (the MCP front door: see start_mcp_front).
    forked: bool = True

    @property
    def http_url(self) -> str | None:
        return f"http://127.0.0.1:{self.http_port}" if self.http_port else None

    def start(self) -> None:
        if self.env is None:
            self.env = os.environ.copy()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        forked = forkserver.spawn(self.command, self.env, self.log_path) if self.forked else None
        if forked is not None:
            self.process = forked
            self.started_at = time.monotonic()
            return
        log_file = open(self.log_path, "ab")  # the child owns it
        self.process = subprocess.Popen(
            self.command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=self.env,
            preexec_fn=die_with_parent,
        )
        log_file.close()
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def move_http_port(self, port: int) -> None:
        """Serve /healthz and /metrics on `port` from the next start: a service that died
        may have died of its port (another process's listener drew it meanwhile: seen
        with gateways started side by side), and would die of it at every restart."""
        if self.http_port is None or "--http-port" not in self.command:
            return
        self.command[self.command.index("--http-port") + 1] = str(port)
        self.http_port = port

    def stop(self, timeout: float = SERVICE_STOP_S) -> None:
        stop_process(self.process, timeout)

    def kill(self) -> None:
        kill_process(self.process)


@dataclass
class Stack:
    data_dir: Path
    nats_url: str | None = None
    nats_port: int = 0
    # Tool directories beside the built-in tools (builtin_tools=False: instead of them).
    registry_dirs: list[Path] = field(default_factory=list)
    builtin_tools: bool = True
    executor_args: list[str] = field(default_factory=list)
    nats: EmbeddedNats | None = None
    # `--nats-cluster N` (N > 1): N routed nats-servers instead of one; every stream and
    # bucket then keeps min(N, 3) replicas.
    nats_cluster: int = 1
    cluster: NatsCluster | None = None
    # A locked bus: each service and client logs in as its role (infra/nats/).
    locked: bool = True
    creds: Credentials | None = None
    services: list[ServiceProcess] = field(default_factory=list)
    # The audit: an embedded ClickHouse (unless given a URL) and the audit sink.
    clickhouse_url: str | None = None
    clickhouse_port: int = 0
    with_audit: bool = True
    # The MCP front door (`toolgate serve mcp`) on loopback; port 0: any free port.
    with_mcp: bool = True
    mcp_port: int = 0
    mcp_url: str | None = None
    clickhouse: EmbeddedClickHouse | None = None
    default_agent_creds: Path | None = None
    topology: Topology = field(default_factory=Topology)
    # An example to run beside the built-in tools (EXAMPLES), and the policy bundle the
    # policy service starts with (default: the example's, else the built-in one).
    example: str | None = None
    policy_dir: Path | None = None
    example_agents: list[tuple[str, str, Path]] = field(default_factory=list)
    example_hint: str = ""
    # The bundle policy replicas decide under, and (`--example` over a pushed bundle)
    # the one its bundle replaced: what `toolgate up` prints (settle_policy).
    policy_line: str = ""
    policy_replaced: str = ""
    # The pushed registry the services serve ("": nothing pushed, the local one), and
    # a line when the local --registry is not it (settle_policy).
    registry_line: str = ""
    registry_differs: str | None = None
    _health_checked_at: float = 0.0
    # A service's /healthz fails once NATS (ClickHouse) is lost this long; None: its default.
    health_grace_s: float | None = None
    # Each service serves /healthz and /metrics (`toolgate up --no-metrics`: none).
    with_http: bool = True
    # `--oidc-issuer URL ...` (end users verified): given to every service it starts.
    oidc_args: list[str] = field(default_factory=list)
    # DATA_DIR/gateway.lock, held while this stack runs (one gateway per data dir).
    _claim: int | None = None
    # Approval notifications (services/notifier): webhooks for every tenant, the secret
    # they are signed with (default: DATA_DIR/approval-webhook.secret, made once), the
    # per-tenant file (default: DATA_DIR/approval-webhooks.yaml if there), the inbox
    # base URL the notifications link to, and more `serve notifier` flags.
    approval_webhooks: list[str] = field(default_factory=list)
    approval_webhook_secret_file: Path | None = None
    approval_webhooks_file: Path | None = None
    inbox_url: str | None = None
    notifier_args: list[str] = field(default_factory=list)
    with_notifier: bool = True
    # What prepare_notifier resolved: how many webhooks, signed with which default secret.
    webhook_count: int = 0
    webhook_secret_file: Path | None = None

    def tool_dirs(self) -> list[Path]:
        """Where the services' tools come from: the built-in ones, then registry_dirs."""
        return tool_dirs(self.registry_dirs, self.builtin_tools)

    def http_args(self, port: int) -> list[str]:
        if not self.with_http:
            return []
        grace = [] if self.health_grace_s is None else ["--health-grace", str(self.health_grace_s)]
        return ["--http-port", str(port), *grace]

    def add_example(self) -> None:
        """The example's tools beside the others, its data prepared, its bundle and agents."""
        assert self.example is not None
        example = load_example(self.example)
        if example.REGISTRY_DIR not in self.registry_dirs:
            self.registry_dirs = [*self.registry_dirs, example.REGISTRY_DIR]
        policy = example.POLICY_DIR
        if policy is not None and not Path(policy).is_absolute():
            policy = self.data_dir / policy  # under the data dir, written by prepare()
        self.policy_dir = self.policy_dir or policy
        example.prepare(self.data_dir)
        self.example_hint = example.TRY
        if self.locked:
            revoked = {(r.tenant, r.agent) for r in list_agents(self.data_dir) if r.revoked_at}
            for tenant, agent in example.AGENTS:
                if (tenant, agent) in revoked:  # an operator's revocation stands
                    log.warning("example agent %s.%s is revoked; not minted again", tenant, agent)
                    continue
                creds, _ = add_agent(self.data_dir, tenant, agent)
                self.example_agents.append((tenant, agent, creds))

    @property
    def audit_url(self) -> str:
        """The ClickHouse URL (database as the path) the audit writes to."""
        if self.clickhouse_url:
            return self.clickhouse_url
        assert self.clickhouse is not None
        return f"{self.clickhouse.url}/toolgate"

    @property
    def url(self) -> str:
        if self.nats_url:
            return self.nats_url
        if self.cluster is not None:
            return self.cluster.url
        assert self.nats is not None
        return self.nats.url

    def check_nats_ports(self) -> None:
        """StackError if a port the embedded NATS needs is taken."""
        if self.nats_url or not self.nats_port:
            return
        ports = range(self.nats_port, self.nats_port + max(self.nats_cluster, 1))
        taken = [port for port in ports if not port_is_free(port)]
        if taken:
            raise StackError(
                f"port {taken[0]} is in use (another `toolgate up`, or a NATS "
                "server?): stop it, or use --nats-port 0 (any free port) or --nats-url"
            )

    def start(self) -> None:
        # Before anything is written: a `toolgate up` run in the wrong folder while a
        # gateway holds the port leaves no data dir there (whose fresh operator keys
        # and agents later commands of that folder would take for a gateway's).
        self.check_nats_ports()
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # The owner's alone: below it are the audit's ClickHouse files (every
            # call's arguments and result), the logs and what tools write, which
            # another local user must not read around the logins. Tightened on each
            # start, so a data dir made before this (0755) is closed too.
            os.chmod(self.data_dir, DATA_DIR_MODE)
            self._claim = claim_data_dir(self.data_dir)
            ensure_keypair(self.data_dir / "keys")
        except GatewayRunning as exc:
            raise StackError(f"{exc}: stop it first, or give another --data-dir") from None
        except OSError as exc:
            raise StackError(
                f"cannot use {self.data_dir} as the data dir: {exc.strerror or exc} (--data-dir)"
            ) from None
        if self.with_notifier:
            self.prepare_notifier()
        if self.example:
            self.add_example()
        if self.locked:
            # Keys are kept across runs; permissions are rendered afresh (the
            # executor gets one durable per tool of this registry).
            tools = load_registry(*self.tool_dirs()).names()
            # Minted before the server config is rendered, so it is preloaded.
            self.default_agent_creds, _ = add_agent(self.data_dir, DEFAULT_TENANT, DEFAULT_AGENT)
            self.creds = create_credentials(self.data_dir, tools=tools)
        if self.nats_url and len(nats_servers(self.nats_url)) > 1:
            # An existing cluster, named by several of its nodes: replicate across them.
            self.topology = replace(
                self.topology,
                replicas=max(self.topology.replicas, min(len(nats_servers(self.nats_url)), 3)),
            )
        if not self.nats_url:
            # A cluster takes --nats-port and the ports after it, one per node.
            ports = [self.nats_port + i for i in range(max(self.nats_cluster, 1))]
            auth_config = self.creds.auth_config if self.creds else None
            if self.nats_cluster > 1:
                self.topology = replace(self.topology, replicas=min(self.nats_cluster, 3))
                self.cluster = NatsCluster(
                    self.data_dir / "nats",
                    self.nats_cluster,
                    config_file=auth_config,
                    ports=ports if self.nats_port else None,
                ).start()
            else:
                self.nats = EmbeddedNats(
                    self.data_dir / "nats", port=self.nats_port, config_file=auth_config
                ).start()
        asyncio.run(self.apply_topology())
        asyncio.run(self.settle_policy())
        for name in PIPELINE:  # the pipeline's hops first (stack/services.py)
            extra = self.executor_args if name == "executor" else []
            if name == "policy" and self.policy_dir is not None:
                extra = ["--policy", str(self.policy_dir)]
            port = free_port()
            service = ServiceProcess(
                name,
                serve_command(
                    name,
                    self.url,
                    self.data_dir,
                    self.registry_dirs,
                    [*extra, *self.http_args(port), *self.oidc_args],
                    creds=self.creds_of(SERVICES[name].role),
                    builtin_tools=self.builtin_tools,
                ),
                self.data_dir / "logs" / f"{name}.log",
                http_port=port if self.with_http else None,
            )
            service.start()
            self.services.append(service)
        if self.with_notifier:
            self.start_notifier()
        if self.with_audit:
            self.start_audit()
        if self.with_mcp:
            self.start_mcp_front()
        self.record_context()

    async def _apply_when_jetstream_answers(self, options: dict[str, object]) -> None:
        """Streams and buckets; a cluster that has just elected its meta leader may still
        answer 503 "JetStream not enabled for account" for a moment (it enables the
        account's JetStream after loading its JWT): ask again until JETSTREAM_READY_S."""
        deadline = time.monotonic() + JETSTREAM_READY_S
        while True:
            try:
                await apply_topology(self.url, self.topology, **options)
                return
            except ServiceUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def apply_topology(self, connect_timeout: float = 5.0) -> None:
        """Streams and buckets, as the admin; StackError within `connect_timeout` if the
        server is not there or refuses the operator's admin."""
        errors: list[Exception] = []

        async def remember(exc: Exception) -> None:  # instead of nats-py's tracebacks
            errors.append(exc)

        options = {
            **connect_options(self.creds_of("admin")),
            "allow_reconnect": False,
            "connect_timeout": connect_timeout,
            "error_cb": remember,
        }
        try:
            # Reachable at all, within the deadline? (nats-py alone may wait far longer.)
            probe = await asyncio.wait_for(
                nats.connect(nats_servers(self.url), **options), connect_timeout
            )
            await probe.close()
            await self._apply_when_jetstream_answers(options)
            timeouts = {spec.name: spec.timeout_s for spec in load_registry(*self.tool_dirs())}
            await refresh_ack_waits(self.url, timeouts, **options)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            cause = str(errors[-1] if errors else exc) or type(exc).__name__
            if "authorization" in cause.lower():
                raise StackError(
                    f"authorization refused at {self.url}: that NATS does not trust the "
                    f"operator of {self.data_dir} (its config must include "
                    f"{self.data_dir / 'creds' / 'nats-auth.conf'}; README: The locked bus)",
                    3,
                ) from None
            if "refused" in cause.lower() or "connect call failed" in cause.lower():
                cause = "connection refused"
            elif isinstance(exc, TimeoutError) and not errors:
                cause = "nothing answered as NATS in time"
            raise StackError(
                f"no NATS answered at {self.url} ({cause}): check --nats-url, "
                "or leave it out to start the embedded one",
                3,
            ) from None

    @property
    def local_policy_source(self) -> str:
        if self.example:
            return versions.EXAMPLE.format(name=self.example)
        return "built-in default" if self.policy_dir is None else f"local bundle {self.policy_dir}"

    async def settle_policy(self, connect_timeout: float = 5.0) -> None:
        """Which bundle the policy service will decide under, as the admin, before it starts.

        `--example NAME` names a bundle: if another one was pushed here, the example's is
        pushed over it as the next version (signed with this data dir's policy-signing
        key), so the example runs under its own rules and says which version it replaced
        (`toolgate policy rollback N` brings that back). Without a push, it is the local
        bundle the policy service starts with (version 0), as before.
        """
        try:
            await self._settle_policy(connect_timeout)
        except (TimeoutError, OSError, nats.errors.Error, JetStreamError) as exc:
            raise StackError(
                f"cannot read the policy bundle at {self.url}: {type(exc).__name__}: {exc}", 3
            ) from None

    async def _settle_policy(self, connect_timeout: float) -> None:
        keys_dir = self.data_dir / "keys"
        local = read_bundle_dir(self.policy_dir or DEFAULT_BUNDLE_DIR)
        nc = await nats.connect(
            nats_servers(self.url),
            **connect_options(self.creds_of("admin")),
            allow_reconnect=False,
            connect_timeout=connect_timeout,
        )
        try:
            state = await read_state(nc.jetstream())
            try:
                public_key = load_verify_key(keys_dir)
            except BundleRefused:
                public_key = None  # the policy service refuses stored bundles and says why
            active, problem = versions.expected_active(state.written, state.accepted, public_key)
            pushed_something = active is not None or problem is not None
            if (
                self.example
                and pushed_something
                and (active is None or bundle_version(active.files) != bundle_version(local))
            ):
                private_key, _ = ensure_signing_key(keys_dir)
                try:
                    _, bundle = await push_next_version(
                        state, local, versions.EXAMPLE.format(name=self.example), private_key
                    )
                except KeyWrongLastSequenceError:
                    raise StackError(
                        "the policy bundle changed while `toolgate up` pushed the example's "
                        "(another push?): run it again"
                    ) from None
                if active is not None:
                    self.policy_replaced = (
                        f"replaces {versions.describe(active)}: "
                        f"`toolgate policy rollback {active.number}` brings it back"
                    )
                state = await read_state(nc.jetstream())
                public_key = private_key.public_key()
            self.policy_line = versions.active_line(
                state.written,
                state.accepted,
                public_key,
                bundle_version(local),
                self.local_policy_source,
            )
            await self._read_served_registry(nc.jetstream())
        finally:
            await nc.close()

    async def _read_served_registry(self, js: JetStreamContext) -> None:
        """registry_line and registry_differs: a registry pushed earlier is served
        whatever --registry this start was given, which `toolgate up` says."""
        state = await bundle_versions.read_state(
            js,
            registry_bucket_config(self.topology.replicas),
            registry_accepted_bucket_config(self.topology.replicas),
        )
        try:
            public_key = load_registry_key(REGISTRY_BUNDLE, self.data_dir / "keys")
        except BundleRefused:
            return  # the validator refuses to start and says why
        stored, _ = served_bundle(await fetch_active(state.kv), state.accepted, public_key)
        if stored is None:
            return
        try:
            served = registry_from_files(stored.files, self.builtin_tools)
            local = load_registry(*self.tool_dirs())
        except RegistryError:
            return  # the services say so themselves
        self.registry_line = describe_registry(stored, served)
        self.registry_differs = local_differs(served, local)

    def record_context(self) -> None:
        """Tell every later command in this folder what runs where, and whose creds are whose."""
        creds = (
            {role: str(self.creds.path(role).resolve()) for role in self.creds.roles}
            if self.creds
            else {}
        )
        if self.default_agent_creds is not None:
            creds["agent"] = str(self.default_agent_creds.resolve())
        write_context(
            self.data_dir,
            {
                "nats_url": self.url,
                "clickhouse_url": self.audit_url if self.with_audit else None,
                # The embedded server's generated users (0600): services and the CLI log
                # in as writer / auditor / admin from it (runtime.settings.clickhouse_login).
                "clickhouse_logins": str(self.clickhouse.logins_path)
                if self.clickhouse is not None
                else None,
                "data_dir": str(self.data_dir.resolve()),
                "locked": self.locked,
                "default_agent": f"{DEFAULT_TENANT}.{DEFAULT_AGENT}" if self.locked else None,
                "mcp_url": self.mcp_url,
                "creds": creds,
                # What the services were started with, so a copy started by hand here
                # (`toolgate serve NAME`) serves the same tools under the same bundle.
                "registry_dirs": [str(Path(d).resolve()) for d in self.registry_dirs],
                "builtin_tools": self.builtin_tools,
                # Each service's /healthz, /readyz and /metrics (`toolgate status` reads them).
                "http": {s.name: s.http_url for s in self.services if s.http_url},
                "policy_dir": str(Path(self.policy_dir).resolve()) if self.policy_dir else None,
                # What `toolgate status` calls the bundle used while nothing is pushed.
                "policy_source": self.local_policy_source,
                # End users verified (`--oidc-issuer`): a service started by hand here too.
                "oidc": self.oidc_settings(),
            },
        )

    def oidc_settings(self) -> dict[str, str] | None:
        """The --oidc-* flags as recorded in the context (None: no issuer)."""
        flags = self.oidc_args
        found = {
            flags[i][len("--oidc-") :].replace("-", "_"): flags[i + 1]
            for i in range(0, len(flags) - 1, 2)
        }
        return found or None

    @property
    def notifier_inbox_url(self) -> str:
        """Where notifications link to: --inbox-url, else the inbox's own default."""
        from toolgate.services.notifier.logic import DEFAULT_INBOX_URL

        return self.inbox_url or DEFAULT_INBOX_URL

    @property
    def webhooks_path(self) -> Path:
        from toolgate.services.notifier.webhooks import RESOLVED_FILE

        return self.data_dir / RESOLVED_FILE

    def prepare_notifier(self) -> None:
        """Merge --approval-webhook URLs and the per-tenant file into the notifier's file
        (0600), each entry with a secret file that exists; StackError (exit 2) if not."""
        from toolgate.services.notifier import webhooks

        config = self.approval_webhooks_file
        if config is None and (self.data_dir / webhooks.CONFIG_FILE).exists():
            config = self.data_dir / webhooks.CONFIG_FILE
        try:
            entries = webhooks.read_config(config) if config is not None else []
            secret = self.approval_webhook_secret_file
            if secret is None and (
                self.approval_webhooks or any(e.secret_file is None for e in entries)
            ):
                secret = webhooks.ensure_default_secret(self.data_dir)
            resolved = webhooks.merged(self.approval_webhooks, secret, entries)
            if secret is not None and resolved:
                webhooks.check_secret_file(secret, "--approval-webhook-secret-file")
            for number, entry in enumerate(entries):
                if entry.secret_file is not None:
                    webhooks.check_secret_file(entry.secret_file, f"{config}: webhook {number + 1}")
        except webhooks.WebhookConfigError as exc:
            raise StackError(str(exc)) from None
        self.webhooks_path.unlink(missing_ok=True)
        if resolved:
            webhooks.write_resolved(self.webhooks_path, resolved)
        self.webhook_count = len(resolved)
        self.webhook_secret_file = secret

    def start_notifier(self) -> None:
        extra = ["--inbox-url", self.notifier_inbox_url, *self.notifier_args]
        if self.webhook_count:
            extra += ["--webhooks", str(self.webhooks_path)]
        port = free_port()
        service = ServiceProcess(
            NOTIFIER,
            serve_command(
                NOTIFIER,
                self.url,
                self.data_dir,
                self.registry_dirs,
                [*extra, *self.http_args(port)],
                creds=self.creds_of(SERVICES[NOTIFIER].role),
                builtin_tools=self.builtin_tools,
            ),
            self.data_dir / "logs" / f"{NOTIFIER}.log",
            http_port=port if self.with_http else None,
        )
        service.start()
        self.services.append(service)

    def front_door_port(self) -> int:
        """The front door's port: --mcp-port if given, else the one this data dir's last
        `toolgate up` used (MCP_PORT_FILE), else any free one; recorded, so saved client
        configurations keep working across restarts."""
        record = self.data_dir / MCP_PORT_FILE
        recorded = recorded_port(record)
        if self.mcp_port:
            if not port_is_free(self.mcp_port):
                raise StackError(f"port {self.mcp_port} is in use: use another --mcp-port (0: any)")
            port = self.mcp_port
        elif recorded is not None:
            if not port_is_free(recorded):
                raise StackError(
                    f"the MCP front door's port {recorded} (recorded in {record} so client "
                    "configurations keep working) is in use: stop what listens there, or give "
                    "--mcp-port PORT (then recorded instead)"
                )
            port = recorded
        else:
            port = free_port()
        if port != recorded:
            record.parent.mkdir(parents=True, exist_ok=True)
            record.write_text(f"{port}\n")
        return port

    def start_mcp_front(self) -> None:
        """The MCP front door, logged in as its role (account MCP_FRONT), on loopback."""
        port = self.front_door_port()
        self.mcp_url = f"http://127.0.0.1:{port}/mcp"
        service = ServiceProcess(
            MCP,
            serve_command(
                MCP,
                self.url,
                self.data_dir,
                self.registry_dirs,
                ["--port", str(port), *self.oidc_args],
                creds=self.creds_of(SERVICES[MCP].role),
                builtin_tools=self.builtin_tools,
            ),
            self.data_dir / "logs" / f"{MCP}.log",
        )
        service.start()
        self.services.append(service)

    def start_audit(self) -> None:
        if not self.clickhouse_url:
            self.clickhouse = EmbeddedClickHouse(
                self.data_dir / "clickhouse", port=self.clickhouse_port
            ).start()
            # The operator applies the DDL; the sink logs in as the insert-only writer.
            from toolgate.services.audit.connection import ClickHouseTarget
            from toolgate.services.audit.schema import apply_schema

            apply_schema(ClickHouseTarget.from_url(self.clickhouse.url_for("admin")))
            self.record_context()  # before the sink starts: it finds its login there
        port = free_port()
        service = ServiceProcess(
            AUDIT,
            serve_command(
                AUDIT,
                self.url,
                self.data_dir,
                self.registry_dirs,
                ["--clickhouse-url", self.audit_url, *self.http_args(port)],
                creds=self.creds_of(SERVICES[AUDIT].role),
                builtin_tools=self.builtin_tools,
            ),
            self.data_dir / "logs" / f"{AUDIT}.log",
            http_port=port if self.with_http else None,
        )
        service.start()
        self.services.append(service)

    def creds_of(self, role: str) -> Path | None:
        if role == "agent":
            return self.default_agent_creds
        return self.creds.path(role) if self.creds else None

    def restart_dead(self) -> None:
        if self.clickhouse is not None:
            try:
                self.clickhouse.ensure_running()  # the sink retries meanwhile
            except Exception as exc:  # next round tries again
                log.warning("embedded ClickHouse did not come back: %s", exc)
        self.restart_unhealthy()
        for service in self.services:
            if not service.alive():
                code = service.process.returncode if service.process else None
                # Back off a service that dies at once, so a broken one does not spin.
                if time.monotonic() - service.started_at < 5 and service.restarts >= 3:
                    continue
                log.warning("%s exited with %s; restarting", service.name, code)
                service.restarts += 1
                if service.http_port is not None:
                    service.move_http_port(free_port())
                    self.record_context()  # `toolgate status` finds it there
                service.start()

    def restart_unhealthy(self, every_s: float = HEALTH_CHECK_S) -> None:
        """The services' own /healthz, every few seconds: one that says twice in a row it
        has lost NATS (or ClickHouse) beyond its grace period is restarted."""
        now = time.monotonic()
        if now - self._health_checked_at < every_s:
            return
        self._health_checked_at = now
        for service in self.services:
            if not service.alive() or service.http_url is None:
                continue
            verdict = probe(f"{service.http_url}/healthz", timeout=1.0)
            # No answer yet (starting, or waiting for NATS before its app runs): not a verdict.
            failing = verdict is not None and not verdict.get("alive", True)
            service.failed_checks = service.failed_checks + 1 if failing else 0
            if service.failed_checks >= 2:
                why = "; ".join((verdict or {}).get("why") or [])
                log.warning("%s fails its health check (%s); restarting", service.name, why)
                service.failed_checks = 0
                service.restarts += 1
                service.stop(timeout=5)
                service.start()

    def stop(self) -> None:
        # Every service at once: each one finishes what it holds on its own (what it has
        # not acked stays in JetStream), so Ctrl-C waits for the slowest, not for the sum.
        stop_processes((s.process for s in reversed(self.services)), SERVICE_STOP_S)
        if self.clickhouse is not None:
            self.clickhouse.stop()
        if self.nats is not None:
            self.nats.stop()
        if self.cluster is not None:
            self.cluster.stop()
        release(self._claim)
        self._claim = None


def run_until_signalled(stack: Stack) -> int:
    stopping = False

    def request_stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    try:
        stack.start()
    except BaseException:
        stack.stop()  # whatever did start; the caller says why in one line
        raise
    try:
        audit = f"  ClickHouse: {stack.audit_url}\n" if stack.with_audit else ""
        audit += f"  MCP: {stack.mcp_url}\n" if stack.mcp_url else ""
        audit += (
            f"  approval webhooks: {stack.webhook_count}"
            + (
                f", signed with {stack.webhook_secret_file.resolve()}"
                if stack.webhook_secret_file
                else ""
            )
            + f"; calls link to {stack.notifier_inbox_url}/calls/TENANT.AGENT.CALL_ID\n"
            if stack.webhook_count
            else ""
        )
        print(
            f"toolgate is up\n  NATS: {stack.url}\n{audit}  data: {stack.data_dir.resolve()}\n"
            f"  logs: {(stack.data_dir / 'logs').resolve()}\n"
            + (
                f"  agent: {DEFAULT_TENANT}.{DEFAULT_AGENT}, creds "
                f"{stack.creds_of('agent')} (more: toolgate agents add TENANT AGENT)\n"
                if stack.creds
                else ""
            )
            + f"  policy bundle: {stack.policy_line}\n"
            + (f"  registry: {stack.registry_line}\n" if stack.registry_line else "")
            + (f"    {stack.registry_differs}\n" if stack.registry_differs else "")
            + (f"    {stack.policy_replaced}\n" if stack.policy_replaced else "")
            + "  try:  toolgate call search_sources "
            '\'{"query": "agents state", "source_type": "any", "limit": 3}\'\n'
            + "".join(
                f"  example {stack.example}: agent {tenant}.{agent}, creds {creds}\n"
                f"    try:  {stack.example_hint} --creds {creds}\n"
                for tenant, agent, creds in stack.example_agents
            )
            + "".join(
                f"  {s.name}: {s.http_url}/metrics (and /healthz)\n"
                for s in stack.services
                if s.http_url
            )
            + "  at a glance:  toolgate status\n"
            + "Press Ctrl-C to stop.",
            flush=True,
        )
        while not stopping:
            time.sleep(0.5)
            stack.restart_dead()
    finally:
        print("stopping toolgate...", flush=True)
        stack.stop()
    return 0
