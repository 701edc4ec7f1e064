"""Apply the versioned DDL of infra/clickhouse/ at start-up, idempotently.

Files are ``NNN_name.sql`` in ``single/`` (one server, the embedded default)
or ``cluster/`` (ReplicatedMergeTree + Distributed, ``${cluster}`` replaced by
the cluster name). Each file runs once and is recorded with its checksum in
``schema_versions``; a recorded file whose text changed is an error (add a new
file instead). Every statement is ``IF NOT EXISTS`` (or, to change a view,
``CREATE OR REPLACE VIEW``), so sinks starting at the same moment may both run
a file without harm.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from importlib.resources.abc import Traversable
from pathlib import Path

from clickhouse_connect.driver.client import Client

from toolgate.services.audit.connection import ClickHouseTarget

DDL_SETS = ("single", "cluster")
ACCESS_DENIED = 497
BACKFILL_WAIT_S = 3600.0
_FILE_NAME = re.compile(r"^(\d{3})_([a-z0-9_]+)\.sql$")


class SchemaError(RuntimeError):
    """The DDL files and the database disagree."""


@dataclass(frozen=True)
class DdlFile:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    def statements(self, cluster: str = "") -> list[str]:
        """The file's statements, without comments (split at a ';' that ends a line)."""
        lines = [line for line in self.text.splitlines() if not line.lstrip().startswith("--")]
        text = "\n".join(lines).replace("${cluster}", cluster)
        return [s.strip() for s in re.split(r";\s*$", text, flags=re.MULTILINE) if s.strip()]


def ddl_root() -> Traversable:
    """Where the DDL files are: shipped as package data, or in the source tree."""
    try:
        from importlib.resources import files

        root = files("toolgate.infra.clickhouse")
        if root.joinpath("single").is_dir():
            return root
    except (ModuleNotFoundError, NotADirectoryError):
        pass
    return Path(__file__).resolve().parents[2] / "infra" / "clickhouse"


def load_ddl(ddl_set: str = "single") -> list[DdlFile]:
    if ddl_set not in DDL_SETS:
        raise SchemaError(f"unknown DDL set {ddl_set!r}: one of {', '.join(DDL_SETS)}")
    found = []
    for entry in ddl_root().joinpath(ddl_set).iterdir():
        match = _FILE_NAME.match(entry.name)
        if match:
            found.append(DdlFile(int(match[1]), match[2], entry.read_text()))
    found.sort(key=lambda f: f.version)
    versions = [f.version for f in found]
    if len(set(versions)) != len(versions) or not found:
        raise SchemaError(f"{ddl_set}: DDL versions must be unique and present: {versions}")
    return found


def applied_versions(client: Client) -> dict[int, str]:
    rows = client.query("SELECT DISTINCT version, checksum FROM schema_versions").result_rows
    return {int(version): checksum for version, checksum in rows}


def ensure_schema(target: ClickHouseTarget, ddl_set: str = "single") -> None:
    """The sink's start-up: nothing to do if every DDL file is applied; else apply them,
    which only a user with DDL grants can (the embedded server's admin; `toolgate up`
    applies the schema before it starts the sink, whose writer login may not)."""
    try:
        done = applied_versions(target.client())
    except Exception:  # no database or table yet, or not readable: try to create them
        done = {}
    if all(done.get(f.version) == f.checksum for f in load_ddl(ddl_set)):
        return
    try:
        apply_schema(target, ddl_set)
    except Exception as exc:
        if getattr(exc, "code", None) == ACCESS_DENIED:
            raise SchemaError(
                f"the audit schema is not applied and {target.username!r} may not apply it: "
                "run `toolgate audit schema` as the admin"
            ) from None
        raise


def apply_schema(target: ClickHouseTarget, ddl_set: str = "single", cluster: str = "") -> list[int]:
    """Create the database and run every DDL file not yet recorded. Returns the versions run."""
    if ddl_set == "cluster" and not cluster:
        raise SchemaError("the cluster DDL set needs the cluster name")
    on_cluster = f" ON CLUSTER '{cluster}'" if cluster else ""
    files = load_ddl(ddl_set)
    target.client(with_database=False).command(
        f"CREATE DATABASE IF NOT EXISTS `{target.database}`{on_cluster}"
    )
    # A file may backfill what it adds from the events already stored (008: one pass over
    # event_log, minutes at tens of millions of rows): wait for it rather than give up
    # after the usual minute and run it again from the start.
    client = target.patient_client(BACKFILL_WAIT_S)
    # The first file creates schema_versions itself; it is IF NOT EXISTS like all.
    for statement in files[0].statements(cluster):
        client.command(statement)
    done = applied_versions(client)
    ran = []
    for ddl in files:
        if ddl.version in done:
            if done[ddl.version] != ddl.checksum:
                raise SchemaError(
                    f"{ddl_set}/{ddl.version:03d}_{ddl.name}.sql changed after it was applied "
                    f"(recorded {done[ddl.version]}, now {ddl.checksum}): add a new file instead"
                )
            continue
        for statement in ddl.statements(cluster):
            client.command(statement)
        # A statement, not clickhouse-connect's `insert`: that imports pandas (0.5 CPU-s of
        # every `toolgate up`) to ask whether the rows are a DataFrame. The values are safe
        # as SQL: a number, a file name of [a-z0-9_] (_FILE_NAME), a hex checksum.
        client.command(
            "INSERT INTO schema_versions (version, name, checksum) "
            f"VALUES ({ddl.version:d}, '{ddl.name}', '{ddl.checksum}')"
        )
        ran.append(ddl.version)
    return ran
