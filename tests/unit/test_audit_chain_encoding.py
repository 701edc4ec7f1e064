"""content_bytes' one-text encoding gives the bytes every stored chain was hashed with."""

from __future__ import annotations

import struct
from datetime import UTC, datetime


def test_content_bytes_of_rows_as_the_builder_makes_them_are_field_by_field():
    """content_bytes writes a built row as one text encoded once: the same bytes as each
    field encoded on its own, its length counted in bytes (non-ASCII text included)."""
    from toolgate.services.audit.chain import content_bytes
    from toolgate.services.audit.rows import CONTENT_COLUMNS, to_micros

    def reference(row):  # type: ignore[no-untyped-def]
        out = b""
        for column in CONTENT_COLUMNS:
            value = row[column]
            if column == "occurred_at":
                data = str(to_micros(value)).encode()
            elif column == "duration_ms":
                data = (
                    b"N"
                    if value is None
                    else str(struct.unpack("<Q", struct.pack("<d", value))[0]).encode()
                )
            elif column == "source_seq":
                data = str(value).encode()
            else:
                data = value.encode()
            out += b"%d:%b" % (len(data), data)
        return out

    base = dict.fromkeys(CONTENT_COLUMNS, "")
    base.update(occurred_at=datetime(2026, 3, 1, 9, 0, 0, 5, tzinfo=UTC), source_seq=7)
    for fields in (
        {"duration_ms": None},
        {"duration_ms": 0.1, "payload": '{"q":"ü\\u00e9"}', "user": "Ünïcode ☃ \U0001f600"},
        {"duration_ms": -0.0, "note": "x" * 1000, "event_id": "e\u202e1"},
    ):
        row = base | fields
        assert content_bytes(row) == reference(row), fields
