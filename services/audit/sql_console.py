"""`toolgate audit sql`: an auditor's ad-hoc query, read-only, as a table, CSV or JSON.

Cells hold what agents and tools sent: every format shows their control and bidi
characters escaped (JSON as JSON escapes, so it stays the same JSON value).
"""

from __future__ import annotations

import csv
import io
import json
from datetime import date, datetime
from typing import Any

from clickhouse_connect.driver.client import Client

from toolgate.runtime.outside_text import visible, visible_json

FORMATS = ("table", "csv", "json")
MAX_CELL = 60


def run_readonly(client: Client, sql: str) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Run `sql` with readonly=1: the server itself refuses any write, DDL or setting change."""
    result = client.query(sql, settings={"readonly": 1})
    return list(result.column_names), [tuple(r) for r in result.result_rows]


def _plain(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def render(columns: list[str], rows: list[tuple[Any, ...]], fmt: str = "table") -> str:
    if fmt == "json":
        return "\n".join(
            visible_json(dict(zip(columns, (_plain(v) for v in row), strict=True)), default=str)
            for row in rows
        )
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([visible(c) for c in columns])
        writer.writerows([[_cell(v, None) for v in row] for row in rows])
        return out.getvalue().rstrip("\n")
    cells = [[_cell(v, MAX_CELL) for v in row] for row in rows]
    columns = [visible(c) for c in columns]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    line = "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
    rule = "  ".join("-" * w for w in widths)
    body = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join([line, rule, *body, f"({len(rows)} row{'s' if len(rows) != 1 else ''})"])


def _cell(value: Any, limit: int | None) -> str:
    plain = _plain(value)
    text = (
        ""
        if plain is None
        else (
            json.dumps(plain, ensure_ascii=False) if isinstance(plain, list | dict) else str(plain)
        )
    )
    text = visible(text.replace("\n", " "))
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"
