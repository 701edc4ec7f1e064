"""Entity providers: where a resource's attributes come from at decision time.

A tool declares the resources it acts on (registry `resources`: an entity type
and the JSON pointer of its id in the arguments). The policy bundle declares,
as data, one provider per entity type in `bundle.yaml`:

    entities:
      Order:
        provider: sql                       # a query against a database the operator names
        database: examples/orders/orders.sqlite3   # relative paths: the gateway's data dir
        query: SELECT owner, tenant, amount FROM orders WHERE id = :id AND tenant = :tenant
        references: {owner: User}           # attributes that name entities (owner == principal)
        cache_ttl_s: 5                      # 0: never cached
        timeout_s: 1
      Customer:
        provider: http                      # GET, JSON object; 404 = unknown
        url: https://crm.internal/customers/{tenant}/{id}
        pointer: /attributes                # where the attributes are in the answer
      Ticket:
        provider: python                    # (id, tenant) -> dict | None, sync or async
        function: mypackage.tickets:lookup

A lookup receives the resource id and the caller's tenant. The first row, the
JSON object or the returned dict is the entity's attributes; no row, a 404 or
None means the resource is unknown. The resolver looks up a call's resources
in parallel, keeps found ones for `cache_ttl_s`, and never raises: an unknown
resource, a timeout or an error comes back as a `ResourceSeen` saying so, and
the engine denies the call with that reason (fail closed).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
import sqlite3
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import quote

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from toolgate.contracts.events import ResourceSeen
from toolgate.contracts.registry import (
    ENGINE_ENTITY_TYPES,
    JSON_POINTER_PATTERN,
    RESOURCE_TYPE_PATTERN,
    pointer_steps,
)

if TYPE_CHECKING:  # imported by the HTTP lookup: a policy without one never loads httpx
    import httpx

# Found entities kept at most this many (per policy process); expired ones go first.
MAX_CACHE_ENTRIES = 10_000
MAX_ERROR_CHARS = 300
FUNCTION_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"


class ProviderBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # Attributes whose value is the id of another entity, by attribute: its type.
    references: dict[str, str] = {}
    cache_ttl_s: float = Field(default=5.0, ge=0, le=3600)
    timeout_s: float = Field(default=1.0, gt=0, le=30)

    @field_validator("references")
    @classmethod
    def _types_are_entity_types(cls, value: dict[str, str]) -> dict[str, str]:
        for attribute, entity_type in value.items():
            if not re.fullmatch(RESOURCE_TYPE_PATTERN, entity_type):
                raise ValueError(f"references.{attribute}: {entity_type!r} is not an entity type")
        return value


class SqlProvider(ProviderBase):
    provider: Literal["sql"]
    # A SQLite file, opened read-only; a relative path is under the gateway's data dir.
    database: str = Field(min_length=1)
    # Named parameters :id (the resource id) and, if used, :tenant (the caller's tenant).
    query: str = Field(min_length=1)

    @field_validator("query")
    @classmethod
    def _names_the_id(cls, value: str) -> str:
        if ":id" not in value:
            raise ValueError("the query must use the parameter :id (and may use :tenant)")
        return value


class HttpProvider(ProviderBase):
    provider: Literal["http"]
    # {id} and {tenant} are replaced by the URL-quoted resource id and tenant.
    url: str = Field(pattern=r"^https?://")
    headers: dict[str, str] = {}
    # Where the attribute object is in the JSON answer ("" or absent: the whole answer).
    pointer: str = Field(default="", pattern=r"^$|" + JSON_POINTER_PATTERN)

    @field_validator("url")
    @classmethod
    def _names_the_id(cls, value: str) -> str:
        if "{id}" not in value:
            raise ValueError("the url must contain {id} (and may contain {tenant})")
        return value


class PythonProvider(ProviderBase):
    provider: Literal["python"]
    # package.module:attr, called as fn(id, tenant) -> Mapping | None (or a coroutine of it).
    function: str = Field(pattern=FUNCTION_PATTERN)


ProviderConfig = Annotated[
    SqlProvider | HttpProvider | PythonProvider, Field(discriminator="provider")
]


def check_entity_type(name: str) -> None:
    if not re.fullmatch(RESOURCE_TYPE_PATTERN, name):
        raise ValueError(f"{name!r} is not an entity type name")
    if name in ENGINE_ENTITY_TYPES:
        raise ValueError(f"{name} is built by the policy engine itself")


class LookupFailed(Exception):
    """A provider could not answer (the message says why, in one line)."""


Lookup = Callable[[str, str], Awaitable[Mapping[str, Any] | None]]


def _json_value(value: Any, where: str) -> Any:
    """Provider answers are recorded in events as JSON: anything else is a failed lookup."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, list):
        return [_json_value(item, f"{where}/{i}") for i, item in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _json_value(v, f"{where}/{k}") for k, v in value.items()}
    raise LookupFailed(f"attribute {where} is a {type(value).__name__}, not a JSON value")


def _attributes(found: Any) -> dict[str, Any] | None:
    if found is None:
        return None
    if not isinstance(found, Mapping):
        raise LookupFailed(f"the provider answered a {type(found).__name__}, not an object")
    return {str(k): _json_value(v, str(k)) for k, v in found.items()}


def sql_lookup(config: SqlProvider, data_dir: Path) -> Lookup:
    path = Path(config.database)
    if not path.is_absolute():
        path = data_dir / path
    uri = f"{path.resolve().as_uri()}?mode=ro"

    def run(resource_id: str, tenant: str) -> dict[str, Any] | None:
        deadline = time.monotonic() + config.timeout_s
        try:
            connection = sqlite3.connect(
                uri, uri=True, timeout=config.timeout_s, check_same_thread=False
            )
        except sqlite3.Error as exc:
            raise LookupFailed(f"cannot open {path}: {exc}") from exc
        with closing(connection):
            # Abandons a query still running at the deadline (checked every 1000 steps).
            connection.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
            try:
                cursor = connection.execute(config.query, {"id": resource_id, "tenant": tenant})
                rows = cursor.fetchmany(2)
            except sqlite3.Error as exc:
                raise LookupFailed(f"query on {path} failed: {exc}") from exc
            if not rows:
                return None
            if len(rows) > 1:
                raise LookupFailed("the query returned more than one row for one id")
            columns = [column[0] for column in cursor.description]
            return dict(zip(columns, rows[0], strict=True))

    async def lookup(resource_id: str, tenant: str) -> Mapping[str, Any] | None:
        return await asyncio.to_thread(run, resource_id, tenant)

    return lookup


class _HttpLookup:
    def __init__(self, config: HttpProvider) -> None:
        self.config = config
        self.steps = pointer_steps(config.pointer) if config.pointer else []
        self.client: httpx.AsyncClient | None = None

    async def __call__(self, resource_id: str, tenant: str) -> Mapping[str, Any] | None:
        import httpx

        if self.client is None:  # made in the running loop, kept for its connections
            self.client = httpx.AsyncClient(
                timeout=self.config.timeout_s, headers=self.config.headers, follow_redirects=False
            )
        url = self.config.url.replace("{id}", quote(resource_id, safe="")).replace(
            "{tenant}", quote(tenant, safe="")
        )
        try:
            response = await self.client.get(url)
        except httpx.HTTPError as exc:
            raise LookupFailed(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise LookupFailed(f"GET {url}: HTTP {response.status_code}")
        try:
            found: Any = response.json()
        except ValueError as exc:
            raise LookupFailed(f"GET {url}: the answer is not JSON") from exc
        for step in self.steps:
            if isinstance(found, dict) and step in found:
                found = found[step]
            elif isinstance(found, list) and step.isdigit() and int(step) < len(found):
                found = found[int(step)]
            else:
                raise LookupFailed(f"GET {url}: the answer has nothing at {self.config.pointer}")
        return found

    async def aclose(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None


def python_lookup(config: PythonProvider) -> Lookup:
    module_name, _, attr = config.function.partition(":")
    function: Callable[..., Any] | None = None

    async def lookup(resource_id: str, tenant: str) -> Mapping[str, Any] | None:
        nonlocal function
        if function is None:
            try:
                function = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise LookupFailed(f"cannot load {config.function}: {exc}") from exc
        if inspect.iscoroutinefunction(function):
            return await function(resource_id, tenant)
        return await asyncio.to_thread(function, resource_id, tenant)

    return lookup


def make_lookup(config: SqlProvider | HttpProvider | PythonProvider, data_dir: Path) -> Lookup:
    if isinstance(config, SqlProvider):
        return sql_lookup(config, data_dir)
    if isinstance(config, HttpProvider):
        return _HttpLookup(config)
    return python_lookup(config)


def _one_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, LookupFailed) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:MAX_ERROR_CHARS]


class EntityResolver:
    """The providers of one bundle, with their short cache. One per policy process."""

    def __init__(
        self,
        providers: Mapping[str, SqlProvider | HttpProvider | PythonProvider],
        data_dir: Path,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self.providers = dict(providers)
        self._lookups = {
            name: make_lookup(config, data_dir) for name, config in self.providers.items()
        }
        self._clock = clock
        self._wall = wall
        # (type, tenant, id) -> (expires at, on the monotonic clock; what was seen)
        self._cache: dict[tuple[str, str, str], tuple[float, ResourceSeen]] = {}

    async def resolve(self, refs: Sequence[tuple[str, str]], tenant: str) -> list[ResourceSeen]:
        """What the providers say of each (type, id), in order; never raises."""
        unique = list(dict.fromkeys(refs))
        now = self._clock()
        seen: dict[tuple[str, str], ResourceSeen] = {}
        missing: list[tuple[str, str]] = []
        for ref in unique:
            cached = self._cache.get((ref[0], tenant, ref[1]))
            if cached is not None and cached[0] > now:
                seen[ref] = cached[1]
            else:
                missing.append(ref)
        if missing:  # in parallel; the common all-cached case never makes a task
            answers = await asyncio.gather(*(self._fetch(t, i, tenant) for t, i in missing))
            seen.update(zip(missing, answers, strict=True))
        return [seen[ref] for ref in unique]

    async def _fetch(self, entity_type: str, resource_id: str, tenant: str) -> ResourceSeen:
        config = self.providers.get(entity_type)
        if config is None:
            return ResourceSeen(
                type=entity_type,
                id=resource_id,
                error=(f"no entity provider is declared for {entity_type} (bundle.yaml entities)"),
            )
        try:
            found = await asyncio.wait_for(
                self._lookups[entity_type](resource_id, tenant), config.timeout_s
            )
            attributes = _attributes(found)
        except TimeoutError:
            return ResourceSeen(
                type=entity_type,
                id=resource_id,
                provider=config.provider,
                error=f"the {config.provider} provider did not answer within "
                f"{config.timeout_s:g} s",
            )
        except Exception as exc:  # fail closed: any failure is a recorded reason to deny
            return ResourceSeen(
                type=entity_type,
                id=resource_id,
                provider=config.provider,
                error=f"the {config.provider} provider failed: " + _one_line(exc),
            )
        answered = self._wall()
        if attributes is None:
            return ResourceSeen(
                type=entity_type, id=resource_id, provider=config.provider, fetched_at=answered
            )
        seen = ResourceSeen(
            type=entity_type,
            id=resource_id,
            found=True,
            attributes=attributes,
            provider=config.provider,
            fetched_at=answered,
        )
        if config.cache_ttl_s > 0:
            self._remember((entity_type, tenant, resource_id), seen, config.cache_ttl_s)
        return seen

    def _remember(self, key: tuple[str, str, str], seen: ResourceSeen, ttl_s: float) -> None:
        now = self._clock()
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            for old in [k for k, (expires, _) in self._cache.items() if expires <= now]:
                del self._cache[old]
            while len(self._cache) >= MAX_CACHE_ENTRIES:
                del self._cache[next(iter(self._cache))]
        # Kept as a later decision will record it: answered from the cache.
        self._cache[key] = (now + ttl_s, msgspec.structs.replace(seen, cached=True))

    def forget(self) -> None:
        self._cache.clear()

    async def aclose(self) -> None:
        for lookup in self._lookups.values():
            if isinstance(lookup, _HttpLookup):
                await lookup.aclose()
