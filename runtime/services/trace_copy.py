"""Spans into Postgres in bulk: one ``COPY`` of an export request's spans and one statement for
the summaries of their traces (:class:`runtime.models.Trace`), in the caller's transaction.

``COPY`` (psycopg's ``cursor.copy``, rows formatted in C) is what makes ingest keep up with an
agent fleet: with Django's ``bulk_create`` (model instances, each field prepared, a multi-row
``INSERT``'s placeholders) the server spent 165 ms of CPU per 1,000 spans, with this 30
(docs/performance.md, "Traces"); here a span is a tuple of plain values whose JSON columns were serialized once (a resource's once for all its
spans). The rows' ids are taken from the table's sequence first, so the live pages hear which
rows are new (:mod:`.trace_live`) as they do after an ``INSERT … RETURNING``.

The summaries are one ``INSERT … ON CONFLICT DO UPDATE`` for all the batch's traces, in trace
id order: concurrent batches of the same traces lock their rows in the same order (no deadlock),
and the count, the errors and the time range add up whatever order they commit in."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from django.db import connection
from django.utils import timezone

from ..models import Trace, TraceSpan

SPAN_COLUMNS = (
    "id", "team_id", "trace_id", "span_id", "parent_span_id", "name", "kind", "start_ns", "end_ns",
    "status_code", "status_message", "attributes", "events", "links", "resource", "scope", "service",
    "sandbox_id", "run_id", "harness_id",
)  # fmt: skip

_sequence: str | None = None


def _span_sequence(cursor: Any) -> str:
    global _sequence
    if _sequence is None:
        cursor.execute("SELECT pg_get_serial_sequence(%s, 'id')", [TraceSpan._meta.db_table])
        _sequence = cursor.fetchone()[0]
    return _sequence


def spans_copy(rows: Sequence[list[Any]]) -> list[int]:
    """Write ``rows`` (values in :data:`SPAN_COLUMNS` order, the id first and left ``None``) with
    one ``COPY``; returns the ids given to them, in order."""
    table = connection.ops.quote_name(TraceSpan._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute("SELECT nextval(%s) FROM generate_series(1, %s)", [_span_sequence(cursor), len(rows)])
        ids = [i for (i,) in cursor.fetchall()]
        raw = cursor.cursor  # psycopg's own cursor, under Django's wrapper
        with raw.copy(f"COPY {table} ({', '.join(SPAN_COLUMNS)}) FROM STDIN") as copy:
            write = copy.write_row
            for i, row in zip(ids, rows, strict=True):
                row[0] = i
                write(row)
    return ids


def traces_upsert(team_id: int, summary: dict[str, dict[str, Any]]) -> None:
    """Create or grow each trace's summary row: ``summary`` maps a trace id to its batch's span
    count ``n``, ``errors``, ``start``, ``end``, ``root`` (the root span's name, or None) and
    ``service``."""
    table = connection.ops.quote_name(Trace._meta.db_table)
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    # SQLite's two-argument min() and max() are Postgres's LEAST and GREATEST.
    least, greatest = ("LEAST", "GREATEST") if connection.vendor == "postgresql" else ("min", "max")
    values, params = [], []
    for trace_id in sorted(summary):
        s = summary[trace_id]
        values.append("(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)")
        params += [team_id, trace_id, s["root"] or "", s["service"], s["n"], s["errors"], s["start"],
                   s["end"], now, now]  # fmt: skip
    # A batch without the root keeps the name and service the trace has; one with it names both.
    sql = (
        f"INSERT INTO {table} AS t (team_id, trace_id, root_name, service, span_count, error_count, "
        f"start_ns, end_ns, created_at, updated_at) VALUES {', '.join(values)} "
        "ON CONFLICT (team_id, trace_id) DO UPDATE SET "
        "span_count = t.span_count + EXCLUDED.span_count, error_count = t.error_count + EXCLUDED.error_count, "
        f"start_ns = {least}(t.start_ns, EXCLUDED.start_ns), end_ns = {greatest}(t.end_ns, EXCLUDED.end_ns), "
        "updated_at = EXCLUDED.updated_at, "
        "root_name = CASE WHEN EXCLUDED.root_name <> '' THEN EXCLUDED.root_name ELSE t.root_name END, "
        "service = CASE WHEN EXCLUDED.root_name <> '' THEN EXCLUDED.service ELSE t.service END"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
