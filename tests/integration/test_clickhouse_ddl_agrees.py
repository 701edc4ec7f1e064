"""The single-node and the cluster DDL (infra/clickhouse) describe the same tables.

Both sets are written by hand, side by side; nothing else checks that a column added to
one is added to the other. Here both are loaded into the real ClickHouse the fixture
starts, each into a database of its own, and ClickHouse itself says what came of them.
The cluster set needs a cluster to run as written, so only what ties it to one goes:
`ON CLUSTER`, `Replicated*MergeTree(...)` becomes `*MergeTree`, `Distributed(...)`
over `X_local` becomes a view of it (the same columns; no cluster needed), and an
`INSERT INTO X` (a backfill through the Distributed table) goes into `X_local`.
"""

from __future__ import annotations

import re
import uuid

from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.schema import load_ddl

CLUSTER = "ddl_check"


def _without_a_cluster(statement: str) -> str:
    statement = statement.replace(f" ON CLUSTER '{CLUSTER}'", "")
    statement = re.sub(r"Replicated(\w*)MergeTree\([^)]*\)", r"\1MergeTree", statement)
    # A backfill inserts through the Distributed table: here, into the table behind it.
    statement = re.sub(r"^INSERT INTO (\w+)\n", r"INSERT INTO \1_local\n", statement)
    return re.sub(
        r"^CREATE TABLE IF NOT EXISTS (\w+) AS (\w+)\s+ENGINE = Distributed\(.*\)$",
        r"CREATE VIEW IF NOT EXISTS \1 AS SELECT * FROM \2",
        statement,
        flags=re.DOTALL,
    )


def _load(client, database: str, ddl_set: str) -> None:
    client.command(f"CREATE DATABASE {database}")
    for ddl in load_ddl(ddl_set):
        for statement in ddl.statements(CLUSTER):
            if ddl_set == "cluster":
                statement = _without_a_cluster(statement)
                assert "ON CLUSTER" not in statement and "Replicated" not in statement
                assert "Distributed" not in statement, statement
            client.command(statement, settings={"database": database})


def _shape(client, database: str) -> tuple[dict[str, list[tuple[str, str]]], set, dict, set]:
    columns: dict[str, list[tuple[str, str]]] = {}
    for table, name, type_ in client.query(
        "SELECT table, name, type FROM system.columns WHERE database = {d:String} "
        "ORDER BY table, position",
        parameters={"d": database},
    ).result_rows:
        columns.setdefault(table, []).append((name, type_))
    indexes = {
        (table.removesuffix("_local"), name, type_, expr, granularity)
        for table, name, type_, expr, granularity in client.query(
            "SELECT table, name, type, expr, granularity FROM system.data_skipping_indices "
            "WHERE database = {d:String}",
            parameters={"d": database},
        ).result_rows
    }
    keys = {
        table.removesuffix("_local"): (sorting, partition)
        for table, sorting, partition in client.query(
            "SELECT name, sorting_key, partition_key FROM system.tables "
            "WHERE database = {d:String} AND engine LIKE '%MergeTree'",
            parameters={"d": database},
        ).result_rows
    }
    projections = {
        (table.removesuffix("_local"), name, type_, tuple(sorting), query)
        for table, name, type_, sorting, query in client.query(
            "SELECT table, name, type, sorting_key, query FROM system.projections "
            "WHERE database = {d:String}",
            parameters={"d": database},
        ).result_rows
    }
    return columns, indexes, keys, projections


def test_single_and_cluster_ddl_make_the_same_tables_and_columns(clickhouse_server):
    client = ClickHouseTarget.from_url(clickhouse_server.url_for("admin")).client(
        with_database=False
    )
    single, cluster = (f"ddl_{kind}_{uuid.uuid4().hex[:8]}" for kind in ("single", "cluster"))
    _load(client, single, "single")
    _load(client, cluster, "cluster")
    single_columns, single_indexes, single_keys, single_projections = _shape(client, single)
    sharded_columns, sharded_indexes, sharded_keys, sharded_projections = _shape(client, cluster)

    # Each MergeTree table of the cluster is X_local (the shard's rows) under X (Distributed).
    for table, columns in list(sharded_columns.items()):
        if table.endswith("_local"):
            assert sharded_columns.get(table.removesuffix("_local")) == columns, table
            del sharded_columns[table]
    assert sorted(sharded_columns) == sorted(single_columns)
    for table, columns in single_columns.items():
        assert sharded_columns[table] == columns, f"{table}: single and cluster columns differ"
    assert sharded_indexes == single_indexes
    assert sharded_keys == single_keys
    assert sharded_projections == single_projections
    assert {p[1] for p in single_projections} >= {"per_call"}
    assert "call_stages" in single_keys and "call_stages_mv" in single_columns
