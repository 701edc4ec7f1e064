"""Entity providers against real backends: a SQLite file, an HTTP server on loopback,
Python functions. Lookups are cached briefly, run in parallel, and fail closed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from pydantic import TypeAdapter

from toolgate.infra.examples import orders
from toolgate.services.policy.providers import EntityResolver, ProviderConfig

PROVIDER: TypeAdapter[Any] = TypeAdapter(ProviderConfig)
ORDER_QUERY = (
    "SELECT owner, tenant, status, amount, refunded, currency FROM orders "
    "WHERE id = :id AND tenant = :tenant"
)


def provider(**fields: Any) -> Any:
    return PROVIDER.validate_python(fields)


def resolver(data_dir: Path, clock: Any = time.monotonic, **providers: Any) -> EntityResolver:
    return EntityResolver(providers, data_dir, clock=clock)


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    orders.prepare(tmp_path)
    return tmp_path


def sql(**changes: Any) -> Any:
    return provider(
        **{
            "provider": "sql",
            "database": str(orders.DATABASE),
            "query": ORDER_QUERY,
            "references": {"owner": "User"},
            **changes,
        }
    )


class TestSql:
    async def test_the_row_is_the_entity(self, data_dir: Path) -> None:
        seen = await resolver(data_dir, Order=sql()).resolve([("Order", "o-1001")], "acme")
        assert len(seen) == 1 and seen[0].found and not seen[0].error
        assert seen[0].attributes == {
            "owner": "u-alice",
            "tenant": "acme",
            "status": "delivered",
            "amount": 1200,
            "refunded": 0,
            "currency": "EUR",
        }
        assert seen[0].provider == "sql" and seen[0].fetched_at is not None

    async def test_no_row_is_unknown_and_the_tenant_scopes_the_query(self, data_dir: Path) -> None:
        found = await resolver(data_dir, Order=sql()).resolve(
            [("Order", "o-9999"), ("Order", "o-1001")], "globex"
        )
        assert [(s.id, s.found, s.error) for s in found] == [
            ("o-9999", False, ""),
            ("o-1001", False, ""),
        ]

    async def test_a_missing_database_is_an_error_not_unknown(self, tmp_path: Path) -> None:
        seen = await resolver(tmp_path, Order=sql()).resolve([("Order", "o-1001")], "acme")
        assert not seen[0].found and "cannot open" in seen[0].error

    async def test_a_slow_query_times_out(self, data_dir: Path) -> None:
        slow = sql(
            timeout_s=0.2,
            query=(
                "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                "SELECT count(*) AS c FROM n WHERE :id = :id"
            ),
        )
        started = time.monotonic()
        seen = await resolver(data_dir, Order=slow).resolve([("Order", "o-1001")], "acme")
        assert time.monotonic() - started < 2
        assert not seen[0].found and (
            "within 0.2 s" in seen[0].error or "interrupted" in seen[0].error
        )

    async def test_two_rows_for_one_id_is_an_error(self, data_dir: Path) -> None:
        ambiguous = sql(query="SELECT owner FROM orders WHERE :id != '' AND :tenant != ''")
        seen = await resolver(data_dir, Order=ambiguous).resolve([("Order", "o-1001")], "acme")
        assert "more than one row" in seen[0].error

    async def test_the_database_is_opened_read_only(self, data_dir: Path) -> None:
        writer = sql(query="DELETE FROM orders WHERE id = :id RETURNING owner")
        seen = await resolver(data_dir, Order=writer).resolve([("Order", "o-1001")], "acme")
        assert not seen[0].found and "readonly" in seen[0].error.replace("-", "")


class _Crm(BaseHTTPRequestHandler):
    records = {"acme/c-1": {"data": {"owner": "u-alice", "tier": "gold"}}}

    def do_GET(self) -> None:  # http.server's name
        key = self.path.removeprefix("/customers/")
        name = key.rpartition("/")[2]
        if name.startswith("slow"):
            time.sleep(1.0)
        if name.startswith("broken"):
            body, status = b"oops", 500
        elif name.startswith("text"):
            body, status = b"not json", 200
        elif key in self.records:
            body, status = json.dumps(self.records[key]).encode(), 200
        else:
            body, status = b'{"error": "not found"}', 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that timed out closed the socket: expected here


@pytest.fixture(scope="module")
def crm() -> Iterator[str]:
    server = _QuietServer(("127.0.0.1", 0), _Crm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def http(base: str, **changes: Any) -> Any:
    return provider(
        **{
            "provider": "http",
            "url": base + "/customers/{tenant}/{id}",
            "pointer": "/data",
            # Long enough for a loaded machine (the tests run side by side); the slow
            # customer's test sets its own short one.
            "timeout_s": 10,
            **changes,
        }
    )


class TestHttp:
    async def test_the_json_object_at_the_pointer_is_the_entity(
        self, crm: str, tmp_path: Path
    ) -> None:
        lookup = resolver(tmp_path, Customer=http(crm))
        try:
            seen = await lookup.resolve([("Customer", "c-1"), ("Customer", "c-404")], "acme")
        finally:
            await lookup.aclose()
        assert seen[0].found and seen[0].attributes == {"owner": "u-alice", "tier": "gold"}
        assert not seen[1].found and not seen[1].error  # 404: unknown

    @pytest.mark.parametrize(
        ("customer", "why"),
        [
            ("slow-1", "did not answer within 0.3 s"),
            ("broken-1", "HTTP 500"),
            ("text-1", "not JSON"),
        ],
    )
    async def test_failures_are_errors(
        self, crm: str, tmp_path: Path, customer: str, why: str
    ) -> None:
        timeout = {"timeout_s": 0.3} if customer.startswith("slow") else {}  # it answers in 1 s
        lookup = resolver(tmp_path, Customer=http(crm, **timeout))
        try:
            seen = await lookup.resolve([("Customer", customer)], "acme")
        finally:
            await lookup.aclose()
        assert not seen[0].found and why in seen[0].error

    async def test_a_server_that_is_down_is_an_error(self, tmp_path: Path) -> None:
        lookup = resolver(tmp_path, Customer=http("http://127.0.0.1:9"))
        seen = await lookup.resolve([("Customer", "c-1")], "acme")
        await lookup.aclose()
        assert not seen[0].found and "ConnectError" in seen[0].error

    async def test_ids_are_quoted_into_the_url(self, crm: str, tmp_path: Path) -> None:
        lookup = resolver(tmp_path, Customer=http(crm))
        seen = await lookup.resolve([("Customer", "../acme/c-1")], "acme")
        await lookup.aclose()
        assert not seen[0].found and not seen[0].error  # %2F..: no such customer


CALLS: list[str] = []


def directory(resource_id: str, tenant: str) -> Mapping[str, Any] | None:
    CALLS.append(resource_id)
    return {"owner": "u-alice", "tenant": tenant} if resource_id.startswith("t-") else None


IN_FLIGHT = {"now": 0, "most": 0}  # slow_directory's lookups under way: now, and most at once


async def slow_directory(resource_id: str, tenant: str) -> Mapping[str, Any] | None:
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["most"] = max(IN_FLIGHT["most"], IN_FLIGHT["now"])
    try:
        await asyncio.sleep(0.3)
    finally:
        IN_FLIGHT["now"] -= 1
    return {"tenant": tenant}


def raising(resource_id: str, tenant: str) -> Mapping[str, Any] | None:
    raise RuntimeError("directory down")


def a_list(resource_id: str, tenant: str) -> Any:
    return ["not", "a", "mapping"]


def python(name: str, **changes: Any) -> Any:
    return provider(provider="python", function=f"{__name__}:{name}", **changes)


class TestPythonAndTheResolver:
    async def test_a_function_is_a_provider(self, tmp_path: Path) -> None:
        seen = await resolver(tmp_path, Ticket=python("directory")).resolve(
            [("Ticket", "t-1"), ("Ticket", "x-1")], "acme"
        )
        assert seen[0].found and seen[0].attributes == {"owner": "u-alice", "tenant": "acme"}
        assert not seen[1].found and not seen[1].error

    @pytest.mark.parametrize(
        ("name", "why"),
        [
            ("raising", "RuntimeError: directory down"),
            ("a_list", "answered a list, not an object"),
            ("nowhere", "cannot load"),
        ],
    )
    async def test_what_a_function_gets_wrong_is_an_error(
        self, tmp_path: Path, name: str, why: str
    ) -> None:
        seen = await resolver(tmp_path, Ticket=python(name)).resolve([("Ticket", "t-1")], "acme")
        assert not seen[0].found and why in seen[0].error

    async def test_found_entities_are_cached_for_their_ttl_only(self, tmp_path: Path) -> None:
        now = [100.0]
        lookup = resolver(tmp_path, clock=lambda: now[0], Ticket=python("directory", cache_ttl_s=5))
        CALLS.clear()
        first = await lookup.resolve([("Ticket", "t-1"), ("Ticket", "x-1")], "acme")
        second = await lookup.resolve([("Ticket", "t-1"), ("Ticket", "x-1")], "acme")
        assert CALLS == ["t-1", "x-1", "x-1"]  # the unknown one is asked again
        assert not first[0].cached and second[0].cached
        assert second[0].fetched_at == first[0].fetched_at
        other_tenant = await lookup.resolve([("Ticket", "t-1")], "globex")
        assert not other_tenant[0].cached and other_tenant[0].attributes["tenant"] == "globex"
        now[0] += 5.1
        third = await lookup.resolve([("Ticket", "t-1")], "acme")
        assert not third[0].cached and CALLS.count("t-1") == 3

    async def test_a_zero_ttl_never_caches(self, tmp_path: Path) -> None:
        lookup = resolver(tmp_path, Ticket=python("directory", cache_ttl_s=0))
        await lookup.resolve([("Ticket", "t-2")], "acme")
        assert not (await lookup.resolve([("Ticket", "t-2")], "acme"))[0].cached

    async def test_several_resources_are_looked_up_in_parallel(self, tmp_path: Path) -> None:
        lookup = resolver(tmp_path, Ticket=python("slow_directory", timeout_s=10))
        IN_FLIGHT["most"] = 0
        seen = await lookup.resolve([("Ticket", f"t-{i}") for i in range(5)], "acme")
        assert all(s.found for s in seen)
        assert IN_FLIGHT["most"] == 5  # all five under way at once, not one after another

    async def test_a_type_without_a_provider_is_an_error(self, tmp_path: Path) -> None:
        seen = await resolver(tmp_path).resolve([("Invoice", "i-1")], "acme")
        assert not seen[0].found and "no entity provider is declared for Invoice" in seen[0].error
