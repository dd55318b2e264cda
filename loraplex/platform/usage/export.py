"""Export encoders: aggregated usage rows as CSV or JSON lines, produced as a byte stream."""

from __future__ import annotations

import contextlib
import csv
import io
import json
from collections.abc import AsyncIterator

from loraplex.platform.db import SessionFactory
from loraplex.platform.usage.aggregate import Query, columns, rows

MEDIA_TYPES = {"csv": "text/csv", "jsonl": "application/x-ndjson"}  # Litestar adds "; charset=utf-8" to text/*


def _csv_line(values: list) -> bytes:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if v is None else v for v in values])
    return buf.getvalue().encode()


async def encode(sessions: SessionFactory, q: Query, fmt: str) -> AsyncIterator[bytes]:
    cols = columns(q.group_by)
    if fmt == "csv":
        yield _csv_line(cols)
    async with contextlib.aclosing(rows(sessions, q)) as items:  # closing the export closes the query
        async for row in items:
            if fmt == "csv":
                yield _csv_line([row[c] for c in cols])
            else:
                yield json.dumps({c: row[c] for c in cols}, separators=(",", ":")).encode() + b"\n"
