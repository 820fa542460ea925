"""Traces: the team's traces (from agents' OTLP and Hangar's own spans), one trace's spans and
logs, and values cut from its attributes. Ingest is OTLP itself (:mod:`dashboard.otlp`)."""

from __future__ import annotations

from typing import Any, Literal

from django.http import HttpResponse, JsonResponse
from ninja import Field, Query, Router, Schema

from runtime.services import traces as trace_svc
from runtime.services.trace_search import MAX_TERMS as MAX_ATTR_TERMS
from runtime.services.usage import parse_range

from .auth import AuthedRequest
from .blocking import blocking

router = Router(tags=["traces"])

MAX_SPANS = 10_000  # per answer; `offset` pages through a larger trace


class TraceSummaryOut(Schema):
    trace_id: str
    root_name: str
    service: str
    span_count: int
    error_count: int
    duration_ms: float
    started_at: str


class TracesQuery(Schema):
    sandbox: str = Field(
        "", max_length=64, description="traces with a span tied to this sandbox (hangar.sandbox.id)"
    )
    harness: str = Field("", max_length=64, description="traces with a span tied to this harness")
    run: str = Field("", max_length=64, description="traces with a span tied to this run")
    service: str = Field("", max_length=255, description="the root span's service.name")
    status: Literal["", "error", "ok"] = Field("", description="error: traces with a failed span")
    from_: str | None = Field(None, alias="from", description="started at or after (ISO 8601)")
    to: str | None = Field(None, description="started before (ISO 8601)")
    min_duration_ms: float | None = Field(None, ge=0, le=1e11)
    attr: list[str] = Field(
        [],
        max_length=MAX_ATTR_TERMS,
        description="key=value (repeatable): traces with a span whose attribute key equals value; "
        "1 matches the number or the text, true the boolean or the text",
    )
    limit: int = Field(100, ge=1, le=trace_svc.MAX_LIST)


class StatusOut(Schema):
    code: str
    message: str


class SpanOut(Schema):
    span_id: str
    parent_span_id: str | None
    name: str
    kind: int
    start_time: str
    end_time: str
    start_ns: int
    end_ns: int
    duration_ms: float
    status: StatusOut
    attributes: dict[str, Any]
    events: list[dict[str, Any]]
    links: list[dict[str, Any]]
    resource: dict[str, Any]
    scope: dict[str, Any]
    service: str


class LogOut(Schema):
    time: str
    time_ns: int
    span_id: str | None
    severity_number: int
    severity_text: str
    body: Any = None
    attributes: dict[str, Any]
    resource: dict[str, Any]
    service: str


class TraceOut(Schema):
    trace_id: str
    root_name: str
    service: str
    span_count: int
    error_count: int
    duration_ms: float
    started_at: str
    spans: list[SpanOut]
    logs: list[LogOut]
    next_offset: int | None = Field(None, description="more spans: ask again with this offset")


class OtlpTraceOut(Schema):
    """``format=otlp``: the trace as an OTLP/JSON ``ExportTraceServiceRequest``."""

    resourceSpans: list[dict[str, Any]]  # noqa: N815 - OTLP/JSON's own name


class TraceQuery(Schema):
    format: Literal["json", "otlp"] = Field(
        "json", description="otlp: the trace as an OTLP/JSON export request"
    )
    offset: int = Field(0, ge=0, description="the first span to answer (by start time)")


@router.get("", response=list[TraceSummaryOut])
async def list_traces(request: AuthedRequest, q: Query[TracesQuery]):
    """The team's traces, newest first, filtered."""

    def read() -> list[dict[str, Any]]:
        since = until = None
        if q.from_ or q.to:
            since, until = parse_range(q.from_, q.to)
        return trace_svc.traces_list(
            team=request.auth.team, sandbox=q.sandbox, harness=q.harness, run=q.run, service=q.service,
            status=q.status, since=since, until=until, min_duration_ms=q.min_duration_ms, attrs=q.attr,
            limit=q.limit,
        )  # fmt: skip

    return await blocking(read)()


@router.get("/{trace_id}", response=TraceOut | OtlpTraceOut)
async def get_trace(request: AuthedRequest, trace_id: str, q: Query[TraceQuery]):
    """One trace: its spans by start time (at most 10,000 per answer) and its log records;
    `format=otlp` answers the whole trace as OTLP/JSON."""

    def read() -> Any:
        trace, spans, logs = trace_svc.trace_get(team=request.auth.team, trace_id=trace_id)
        if q.format == "otlp":
            return JsonResponse(trace_svc.trace_otlp(spans))
        page = [trace_svc.span_dict(s) for s in spans[q.offset : q.offset + MAX_SPANS + 1]]
        more = len(page) > MAX_SPANS
        return {
            "trace_id": trace.trace_id, "root_name": trace.root_name, "service": trace.service,
            "span_count": trace.span_count, "error_count": trace.error_count,
            "duration_ms": (trace.end_ns - trace.start_ns) / 1e6, "started_at": trace_svc.iso(trace.start_ns),
            "spans": page[:MAX_SPANS], "logs": [trace_svc.log_dict(r) for r in logs[:MAX_SPANS]] if not q.offset else [],
            "next_offset": q.offset + MAX_SPANS if more else None,
        }  # fmt: skip

    return await blocking(read)()


@router.get("/{trace_id}/values/{value_id}", response={200: str})
async def get_trace_value(request: AuthedRequest, trace_id: str, value_id: int):
    """A value cut from a span's attributes (``hangar.truncated.<key>`` names it), whole, as text."""
    value = await blocking(trace_svc.trace_value)(
        team=request.auth.team, trace_id=trace_id, value_id=value_id
    )
    return HttpResponse(value, content_type="text/plain; charset=utf-8")
