"""The audit: every toolgate event in ClickHouse, exactly once as seen by queries.

`app.py` is the sink service (`toolgate serve audit`); `cli.py` the auditor's
commands (`toolgate audit trace|sql|replay|verify`); the DDL it applies lives
in `infra/clickhouse/` (see its README).
"""
