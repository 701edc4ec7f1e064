"""`toolgate up` applies the audit schema in its own process, at every start: applying it
loads no pandas (clickhouse-connect's `insert` imports pandas, about 0.5 CPU-s, only to ask
whether the rows are a DataFrame)."""

from __future__ import annotations

import subprocess
import sys

from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.schema import applied_versions, load_ddl

APPLY = """
import sys
from toolgate.services.audit.connection import ClickHouseTarget
from toolgate.services.audit.schema import apply_schema
ran = apply_schema(ClickHouseTarget.from_url(sys.argv[1]))
print(len(ran), "pandas" in sys.modules)
"""


def test_applying_the_schema_on_a_fresh_store_loads_no_pandas(clickhouse_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", APPLY, clickhouse_url],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [str(len(load_ddl())), "False"]
    recorded = applied_versions(ClickHouseTarget.from_url(clickhouse_url).client())
    assert recorded == {f.version: f.checksum for f in load_ddl()}
