from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests import cpu_log
from tests.harness import Gateway, make_test_registry
from toolgate.stack.clickhouse_server import EmbeddedClickHouse
from toolgate.stack.nats_server import EmbeddedNats


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A system test starts the whole gateway as separate processes: slow, by definition
    (the fast lane, `pytest -m "not slow"`, leaves them out; CI runs everything).

    Files with slow tests run first, those that allow themselves a longer timeout (a
    `timeout` marker) before the others: the workers (addopts' `-n`, one file at a time
    each) then fill the end of the run with short files instead of waiting on a long one."""
    slow_files: set[Path] = set()
    allowed: dict[Path, float] = {}
    for item in items:
        if item.get_closest_marker("system") is not None:
            item.add_marker(pytest.mark.slow)
        if item.get_closest_marker("slow") is not None:
            slow_files.add(item.path)
        timeout = item.get_closest_marker("timeout")
        if timeout is not None and timeout.args:
            allowed[item.path] = max(allowed.get(item.path, 0.0), float(timeout.args[0]))
    order = {id(item): index for index, item in enumerate(items)}
    items.sort(
        key=lambda item: (
            item.path not in slow_files,
            -allowed.get(item.path, 0.0),
            order[id(item)],
        )
    )


@pytest.fixture(scope="module", autouse=True)
def cpu_per_file(request: pytest.FixtureRequest) -> Iterator[None]:
    """TOOLGATE_TEST_CPU_LOG=PATH: each file's CPU-s, theirs and their processes' (set up
    first, so torn down after the module's gateways have stopped)."""
    with cpu_log.logged(str(request.path.relative_to(request.config.rootpath))):
        yield


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clickhouse_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedClickHouse]:
    """The embedded ClickHouse (chdb-core) on a free loopback port, one per test module."""
    server = EmbeddedClickHouse(tmp_path_factory.mktemp("clickhouse")).start()
    yield server
    server.stop()


@pytest.fixture
def clickhouse_url(clickhouse_server: EmbeddedClickHouse) -> str:
    """A database of the test's own on the module's server (created by the schema), as the
    server's admin (the embedded server's `default` may do nothing)."""
    return clickhouse_server.url_for("admin", f"t_{uuid.uuid4().hex[:12]}")


DOCUMENT = (
    b"<html><head><title>Agents SDK sessions</title><script>evil()</script></head>"
    b"<body><h1>Sessions</h1><p>A session stores conversation state.</p></body></html>"
)


class _DocumentHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # http.server's name
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(DOCUMENT)))
        self.end_headers()
        self.wfile.write(DOCUMENT)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def document_server() -> Iterator[str]:
    """A real HTTP server on loopback that fetch_document may read."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _DocumentHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def start_gateway(base: Path, with_mcp: bool = False, with_http: bool = False) -> Gateway:
    registry = make_test_registry(base / "registry")
    return Gateway(
        data_dir=base / "data", registry_dir=registry, with_mcp=with_mcp, with_http=with_http
    ).start()


def knocks_on_the_front_door(request: pytest.FixtureRequest) -> bool:
    """Marked `front_door`: the gateway runs the MCP front door too."""
    return request.node.get_closest_marker("front_door") is not None


@pytest.fixture(scope="module")
def shared_gateway(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gateway]:
    """One gateway for the tests that do not break anything."""
    gateway = start_gateway(tmp_path_factory.mktemp("gateway"), knocks_on_the_front_door(request))
    yield gateway
    gateway.stop()


@pytest.fixture
def gateway(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Gateway]:
    """A gateway of the test's own, for tests that kill parts of it."""
    gateway = start_gateway(tmp_path, knocks_on_the_front_door(request))
    yield gateway
    gateway.stop()
