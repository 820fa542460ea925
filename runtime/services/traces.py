"""Traces: spans and log records stored per team (from OTLP, :mod:`.otlp`), read back as a
list of traces and as one trace's spans and logs, and pruned after their retention.

Storing is one transaction per export request: the spans in one bulk write (a ``COPY`` on
Postgres, :mod:`.trace_copy`; ``bulk_create`` elsewhere), each trace's summary
(:class:`runtime.models.Trace`) created or grown in place, so concurrent batches of one trace add
up. The team's secrets' values are masked out of every string first, as they are in run output
(a span whose encoded values mention none is stored as it came); a string attribute over
``HANGAR_TRACE_VALUE_BYTES`` is cut, and kept whole beside the trace (``hangar.truncated.<key>``
names where)."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q, QuerySet
from django.utils import timezone

from ..errors import InvalidValue, NotFound
from ..models import Team, Trace, TraceLog, TraceSpan, TraceValue
from . import secrets as secret_svc
from . import trace_copy, trace_live, trace_search
from .otlp import Decoded

MAX_LIST = 1000
CHUNK = 1000  # rows per delete when pruning


# -- storing ------------------------------------------------------------------------------------

_encode = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)  # JSON (and Postgres's jsonb) has no NaN or infinity: "nan", "inf"
    if isinstance(x, list):
        return [_finite(i) for i in x]
    if isinstance(x, dict):
        return {k: _finite(i) for k, i in x.items()}
    return x


def _json(x: Any) -> str:
    try:
        return _encode(x)
    except ValueError:
        return _encode(_finite(x))


# What a row names rather than says: never masked (a secret that happens to be a run of hex
# digits must not turn a trace's ids into something else).
_IDS = frozenset({"trace_id", "span_id", "parent_span_id", "sandbox_id", "run_id", "harness_id"})
# Columns of bounded length, cut again after masking (a "***" can be longer than what it hides).
_BOUNDED = {"name": 255, "service": 255, "severity_text": 32}


def _masker(values: list[str]) -> Any:
    def mask(x: Any) -> Any:
        if isinstance(x, str):
            for v in values:
                if v in x:
                    x = x.replace(v, "***")
            return x
        if isinstance(x, list):
            return [mask(i) for i in x]
        if isinstance(x, dict):
            return {k: mask(i) for k, i in x.items()}
        return x

    def row_mask(row: dict[str, Any]) -> dict[str, Any]:
        out = {k: (v if k in _IDS else mask(v)) for k, v in row.items()}
        for key, limit in _BOUNDED.items():
            if isinstance(out.get(key), str):
                out[key] = out[key][:limit]
        if row.get("links"):
            out["links"] = [
                {**link, "attributes": mask(link.get("attributes") or {})} for link in row["links"]
            ]
        return out

    return row_mask


def _mask_values(team_id: int) -> list[str]:
    """The team's secrets' values to mask, longest first (the shortest are left: see
    :data:`secret_svc.MASK_MIN_CHARS`)."""
    values = {v for v in secret_svc.team_values(team_id=team_id) if len(v) >= secret_svc.MASK_MIN_CHARS}
    return sorted(values, key=len, reverse=True)


@dataclass
class _Batch:
    """An export request's spans as stored: masked, bounded, with their traces' summaries."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    # JSON of each row's attributes, events and links, where Postgres's COPY will want it.
    encoded: list[tuple[str, str, str]] = field(default_factory=list)
    # (row's index, attribute, whole value) for each attribute cut at HANGAR_TRACE_VALUE_BYTES.
    long: list[tuple[int, str, str]] = field(default_factory=list)
    summary: dict[str, dict[str, Any]] = field(default_factory=dict)


def _prepared(team_id: int, rows: list[dict[str, Any]]) -> _Batch:
    # The team's secrets' values, longest first, and as they read inside a JSON string: a string
    # that holds one holds it JSON-escaped once encoded, so a row whose encoded values and text
    # mention none (the usual case: one substring search each) is stored as it came.
    values = _mask_values(team_id)
    mask = _masker(values) if values else None
    probes = [_encode(v)[1:-1] for v in values]
    limit = int(settings.HANGAR_TRACE_VALUE_BYTES)
    out = _Batch()
    # (id(resource), id(scope)) → whether they mention a secret: each is shared by its spans.
    shared_seen: dict[tuple[int, int], bool] = {}
    for row in rows:
        attrs_js, events, links = _json(row["attributes"]), row["events"], row["links"]
        events_js = _json(events) if events else "[]"
        links_js = _json(links) if links else "[]"
        if mask is not None:
            shared = (id(row["resource"]), id(row["scope"]))
            mentions = shared_seen.get(shared)
            if mentions is None:
                both = _json(row["resource"]) + _json(row["scope"])
                mentions = shared_seen[shared] = any(p in both for p in probes)
            encoded = (attrs_js, events_js, links_js)
            text = (row["name"], row["status_message"])
            if (mentions or any(p in e for p in probes for e in encoded)
                    or any(v in t for v in values for t in text)):  # fmt: skip
                row = mask(row)
                attrs_js, events_js, links_js = (_json(row[k]) for k in ("attributes", "events", "links"))
        if len(attrs_js) > limit:  # an encoded value is at least as long as the value
            cut = {}
            for key, v in row["attributes"].items():
                if isinstance(v, str) and len(v) > limit:
                    cut[key] = v[:limit]
                    out.long.append((len(out.rows), key, v))
            if cut:
                row = {**row, "attributes": {**row["attributes"], **cut}}
        out.rows.append(row)
        out.encoded.append((attrs_js, events_js, links_js))
        s = out.summary.get(row["trace_id"])
        if s is None:
            s = out.summary[row["trace_id"]] = {"n": 0, "errors": 0, "start": row["start_ns"],
                                                "end": row["end_ns"], "root": None, "service": row["service"]}  # fmt: skip
        s["n"] += 1
        s["errors"] += row["status_code"] == 2
        s["start"], s["end"] = min(s["start"], row["start_ns"]), max(s["end"], row["end_ns"])
        if not row["parent_span_id"] and s["root"] is None:
            s["root"], s["service"] = row["name"], row["service"] or s["service"]
    return out


def _keep_long_values(team_id: int, batch: _Batch) -> None:
    """Store each cut value whole and name it in its span's attributes."""
    kept = TraceValue.objects.bulk_create(
        [TraceValue(team_id=team_id, trace_id=batch.rows[i]["trace_id"], value=v) for i, _, v in batch.long]
    )
    for (i, key, _), value in zip(batch.long, kept, strict=True):
        batch.rows[i]["attributes"][f"hangar.truncated.{key}"] = value.id
    for i in {i for i, _, _ in batch.long}:
        row = batch.rows[i]
        batch.encoded[i] = (_json(row["attributes"]), *batch.encoded[i][1:])


def _copied(team_id: int, batch: _Batch) -> list[tuple[str, int | None]]:
    resources: dict[int, str] = {}  # a resource's JSON, once for all its spans
    scopes: dict[int, str] = {}
    rows = []
    for row, (attrs_js, events_js, links_js) in zip(batch.rows, batch.encoded, strict=True):
        resource, scope = row["resource"], row["scope"]
        resource_js = resources.get(id(resource))
        if resource_js is None:
            resource_js = resources[id(resource)] = _json(resource)
        scope_js = scopes.get(id(scope))
        if scope_js is None:
            scope_js = scopes[id(scope)] = _json(scope)
        rows.append([
            None, team_id, row["trace_id"], row["span_id"], row["parent_span_id"], row["name"], row["kind"],
            row["start_ns"], row["end_ns"], row["status_code"], row["status_message"], attrs_js, events_js,
            links_js, resource_js, scope_js, row["service"], row["sandbox_id"], row["run_id"], row["harness_id"],
        ])  # fmt: skip
    ids = trace_copy.spans_copy(rows)
    return [(row["trace_id"], i) for row, i in zip(batch.rows, ids, strict=True)]


def _created(team: Team, batch: _Batch) -> list[tuple[str, int | None]]:
    spans = TraceSpan.objects.bulk_create([TraceSpan(team=team, **row) for row in batch.rows], batch_size=500)
    return [(s.trace_id, s.pk) for s in spans]


def spans_store(*, team: Team, decoded: Decoded) -> int:
    """Store the decoded spans for ``team`` in one transaction; returns how many."""
    if not decoded.rows:
        return 0
    batch = _prepared(team.id, decoded.rows)
    postgres = connection.vendor == "postgresql"
    with transaction.atomic():
        if batch.long:
            _keep_long_values(team.id, batch)
        stored = _copied(team.id, batch) if postgres else _created(team, batch)
        trace_live.spans_stored(team_id=team.id, spans=stored)  # live pages, once this commits
        trace_copy.traces_upsert(team.id, batch.summary)  # one statement, on Postgres and SQLite
    return len(batch.rows)


def logs_store(*, team: Team, decoded: Decoded) -> int:
    if not decoded.rows:
        return 0
    values = _mask_values(team.id)
    mask = _masker(values) if values else (lambda x: x)
    TraceLog.objects.bulk_create([TraceLog(team=team, **mask(row)) for row in decoded.rows], batch_size=500)
    return len(decoded.rows)


# -- reading ------------------------------------------------------------------------------------


def iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat().replace("+00:00", "Z")


def _ns(when: datetime) -> int:
    return int(when.timestamp() * 1_000_000_000)


def traces_list(
    *,
    team: Team,
    sandbox: str = "",
    harness: str = "",
    run: str = "",
    service: str = "",
    status: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    min_duration_ms: float | None = None,
    attrs: Sequence[str] = (),
    limit: int = 100,
) -> list[dict[str, Any]]:
    """The team's traces, newest first; ``sandbox`` (``run``, ``harness``) matches a trace with
    any span tied to it, each of ``attrs`` (``key=value``) one with a span of that attribute."""
    if not 1 <= limit <= MAX_LIST:
        raise InvalidValue(f"limit must be between 1 and {MAX_LIST}, got {limit}")
    if status not in ("", "error", "ok"):
        raise InvalidValue(f"status must be error or ok, got {status!r}")
    terms = trace_search.attr_terms(attrs)
    qs: QuerySet[Trace] = Trace.objects.filter(team=team)
    for matching in trace_search.traces_with_attrs(team=team, terms=terms):
        qs = qs.filter(trace_id__in=matching)
    for column, wanted in (("sandbox_id", sandbox), ("harness_id", harness), ("run_id", run)):
        if wanted:
            spans = TraceSpan.objects.filter(team=team, **{column: wanted}).values("trace_id")
            logs = (
                TraceLog.objects.filter(team=team, **{column: wanted}).exclude(trace_id="").values("trace_id")
            )
            qs = qs.filter(Q(trace_id__in=spans) | Q(trace_id__in=logs))
    if service:
        qs = qs.filter(service=service)
    if status == "error":
        qs = qs.filter(error_count__gt=0)
    elif status == "ok":
        qs = qs.filter(error_count=0)
    if since is not None:
        qs = qs.filter(start_ns__gte=_ns(since))
    if until is not None:
        qs = qs.filter(start_ns__lt=_ns(until))
    if min_duration_ms is not None:
        qs = qs.filter(end_ns__gte=F("start_ns") + int(min_duration_ms * 1_000_000))
    return [
        {"trace_id": t.trace_id, "root_name": t.root_name, "service": t.service, "span_count": t.span_count,
         "error_count": t.error_count, "duration_ms": (t.end_ns - t.start_ns) / 1e6, "started_at": iso(t.start_ns)}
        for t in qs.order_by("-start_ns")[:limit]
    ]  # fmt: skip


def _check_id(trace_id: str) -> str:
    if len(trace_id) != 32 or any(c not in "0123456789abcdef" for c in trace_id):
        raise NotFound(f"no trace {trace_id[:64]!r} (a trace id is 32 lowercase hex characters)")
    return trace_id


def span_dict(s: TraceSpan) -> dict[str, Any]:
    return {
        "span_id": s.span_id, "parent_span_id": s.parent_span_id or None, "name": s.name, "kind": s.kind,
        "start_time": iso(s.start_ns), "end_time": iso(s.end_ns), "start_ns": s.start_ns, "end_ns": s.end_ns,
        "duration_ms": (s.end_ns - s.start_ns) / 1e6,
        "status": {"code": ("unset", "ok", "error")[s.status_code] if 0 <= s.status_code <= 2 else "unset",
                   "message": s.status_message},
        "attributes": s.attributes, "events": s.events, "links": s.links, "resource": s.resource,
        "scope": s.scope, "service": s.service,
    }  # fmt: skip


def log_dict(r: TraceLog) -> dict[str, Any]:
    return {
        "time": iso(r.time_ns), "time_ns": r.time_ns, "span_id": r.span_id or None,
        "severity_number": r.severity_number, "severity_text": r.severity_text, "body": r.body,
        "attributes": r.attributes, "resource": r.resource, "service": r.service,
    }  # fmt: skip


def trace_get(*, team: Team, trace_id: str) -> tuple[Trace, QuerySet[TraceSpan], QuerySet[TraceLog]]:
    """The trace, its spans (by start) and its log records (by time). Another team's is not found.

    Its log records are those that carry its id, and those that carry none but name what the
    trace is of (in their resource attributes): its run (a run is one trace), or, for a log of
    no run, one of its sandboxes within the trace's time."""
    trace = Trace.objects.filter(team=team, trace_id=_check_id(trace_id)).first()
    if trace is None:
        raise NotFound(f"no trace {trace_id!r}")
    spans = TraceSpan.objects.filter(team=team, trace_id=trace_id).order_by("start_ns", "id")
    ties = list(
        spans.exclude(run_id="", sandbox_id="")
        .order_by()
        .values_list("run_id", "sandbox_id")
        .distinct()[:100]
    )
    runs = {run for run, _ in ties if run}
    sandboxes = {sandbox for _, sandbox in ties if sandbox}
    joined = Q(trace_id=trace_id)
    if runs:
        joined |= Q(trace_id="", run_id__in=runs)
    if sandboxes:
        joined |= Q(trace_id="", run_id="", sandbox_id__in=sandboxes, time_ns__gte=trace.start_ns,
                    time_ns__lte=trace.end_ns)  # fmt: skip
    logs = TraceLog.objects.filter(joined, team=team).order_by("time_ns", "id")
    return trace, spans, logs


def trace_value(*, team: Team, trace_id: str, value_id: int) -> str:
    """A value cut in a span's attributes, whole."""
    row = TraceValue.objects.filter(team=team, trace_id=_check_id(trace_id), id=value_id).first()
    if row is None:
        raise NotFound(f"no value {value_id} in trace {trace_id}")
    return row.value


# -- OTLP/JSON export ---------------------------------------------------------------------------


def _any(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, list):
        return {"arrayValue": {"values": [_any(i) for i in v]}}
    if isinstance(v, dict):
        return {"kvlistValue": {"values": _kvs(v)}}
    return {"stringValue": "" if v is None else str(v)}


def _kvs(attrs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _any(v)} for k, v in attrs.items()]


def trace_otlp(spans: QuerySet[TraceSpan]) -> dict[str, Any]:
    """The trace as an OTLP/JSON export request (hex ids), its spans grouped by resource and scope."""
    groups: dict[tuple[str, str, str], list[TraceSpan]] = {}
    for s in spans:
        key = (json.dumps(s.resource, sort_keys=True), s.scope.get("name", ""), s.scope.get("version", ""))
        groups.setdefault(key, []).append(s)
    resource_spans = []
    for (resource, scope_name, scope_version), members in groups.items():
        resource_spans.append({
            "resource": {"attributes": _kvs(json.loads(resource))},
            "scopeSpans": [{
                "scope": {"name": scope_name, "version": scope_version},
                "spans": [{
                    "traceId": s.trace_id, "spanId": s.span_id, "parentSpanId": s.parent_span_id,
                    "name": s.name, "kind": s.kind, "startTimeUnixNano": str(s.start_ns),
                    "endTimeUnixNano": str(s.end_ns), "attributes": _kvs(s.attributes),
                    "events": [{"name": e.get("name", ""), "timeUnixNano": str(e.get("time_ns", 0)),
                                "attributes": _kvs(e.get("attributes") or {})} for e in s.events],
                    "links": [{"traceId": link.get("trace_id", ""), "spanId": link.get("span_id", ""),
                               "attributes": _kvs(link.get("attributes") or {})} for link in s.links],
                    "status": {"code": s.status_code, "message": s.status_message},
                } for s in members],
            }],
        })  # fmt: skip
    return {"resourceSpans": resource_spans}


# -- retention ----------------------------------------------------------------------------------


def traces_prune(*, now: datetime | None = None) -> int:
    """Delete traces not written to for ``HANGAR_TRACE_RETENTION_DAYS`` (0: keep all), with their
    spans, logs and kept values, and log records without a trace as old; returns traces deleted."""
    days = int(settings.HANGAR_TRACE_RETENTION_DAYS)
    if not days:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    pruned = 0
    while ids := list(
        Trace.objects.filter(updated_at__lt=cutoff).values_list("id", "team_id", "trace_id")[:CHUNK]
    ):
        by_team: dict[int, list[str]] = defaultdict(list)
        for _, team_id, trace_id in ids:
            by_team[team_id].append(trace_id)
        for model in (TraceSpan, TraceLog, TraceValue):
            for team_id, trace_ids in by_team.items():
                model.objects.filter(team_id=team_id, trace_id__in=trace_ids).delete()
        Trace.objects.filter(id__in=[i for i, _, _ in ids]).delete()
        pruned += len(ids)
    while pks := list(
        TraceLog.objects.filter(trace_id="", created_at__lt=cutoff).values_list("pk", flat=True)[:CHUNK]
    ):
        TraceLog.objects.filter(pk__in=pks).delete()
    return pruned
