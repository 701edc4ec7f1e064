"""The versioned DDL files: present, ordered, parallel between the two sets."""

from __future__ import annotations

import re

from toolgate.services.audit.schema import DDL_SETS, load_ddl


def test_both_sets_have_the_same_versions_and_names():
    single, cluster = (load_ddl(name) for name in DDL_SETS)
    assert [(f.version, f.name) for f in single] == [(f.version, f.name) for f in cluster]
    assert single[0].name == "schema_versions"


def test_every_statement_is_idempotent():
    for ddl_set in DDL_SETS:
        for ddl in load_ddl(ddl_set):
            for statement in ddl.statements("c1"):
                # MATERIALIZE PROJECTION run twice builds the projection twice: harmless.
                # 008's backfill run twice stores each call's min/max/argMax twice, which
                # call_stages (AggregatingMergeTree of exactly those) merges into the same.
                assert (
                    "IF NOT EXISTS" in statement
                    or statement.startswith("CREATE OR REPLACE VIEW")
                    or " MATERIALIZE PROJECTION " in statement
                    or statement.startswith("INSERT INTO call_stages\nSELECT")
                ), (ddl_set, ddl.name, statement[:60])


def test_the_calls_view_in_force_groups_by_the_calls_identity():
    """A call is (tenant, agent, call_id): the last statement that defines `calls` groups by
    all three, in both sets (004 grouped by call_id alone; applied files are never edited)."""
    view = re.compile(r"CREATE (?:OR REPLACE )?VIEW (?:IF NOT EXISTS )?(\w+)")
    for ddl_set in DDL_SETS:
        defining = [
            statement
            for ddl in load_ddl(ddl_set)
            for statement in ddl.statements("c")
            if (found := view.match(statement)) and found[1] == "calls"
        ]
        assert len(defining) >= 2 and defining[-1].startswith("CREATE OR REPLACE VIEW calls")
        assert defining[-1].endswith("GROUP BY tenant, agent, call_id"), defining[-1][-60:]


def test_cluster_statements_name_the_cluster_and_single_ones_do_not():
    for ddl in load_ddl("cluster"):
        for statement in ddl.statements("prod"):
            assert "${cluster}" not in statement
            if statement.startswith("INSERT INTO "):  # through a Distributed table, once
                assert "_local" not in statement.split("\n")[0], statement[:60]
                continue
            assert "ON CLUSTER 'prod'" in statement
    for ddl in load_ddl("single"):
        assert "ON CLUSTER" not in ddl.text


def test_comments_are_stripped_and_checksums_are_stable():
    ddl = load_ddl("single")[1]
    assert all(not s.lstrip().startswith("--") for s in ddl.statements())
    assert ddl.checksum == load_ddl("single")[1].checksum


def test_the_schema_is_applied_by_a_client_that_waits_for_a_backfill(monkeypatch):
    """008 backfills call_stages from every stored event in one statement: minutes at tens
    of millions of rows. The client that applies the files waits for it; with the usual
    minute a sink's start-up would give up, retry, and begin the backfill again forever."""
    from typing import Any

    from toolgate.services.audit import schema
    from toolgate.services.audit.connection import ClickHouseTarget

    waits: list[float] = []

    class Recorded:
        def command(self, sql: str) -> None:
            pass

        def insert(self, *args: Any, **kwargs: Any) -> None:
            pass

        def query(self, sql: str) -> Any:
            return type("Result", (), {"result_rows": []})()

    def patient_client(self, answer_within_s, with_database=True, **settings):  # type: ignore[no-untyped-def]
        waits.append(answer_within_s)
        return Recorded()

    monkeypatch.setattr(ClickHouseTarget, "patient_client", patient_client)
    target = ClickHouseTarget.from_url("http://u:p@127.0.0.1:1/toolgate")
    assert schema.apply_schema(target) == [f.version for f in load_ddl()]
    assert waits[-1] >= 3600  # the client that ran the files, 008 among them
