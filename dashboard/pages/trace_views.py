"""The team's traces: a list to filter, and one trace as a waterfall with a span panel.

A trace page is rendered on the server (its spans' names are in the HTML), a page of spans at a
time for a large trace; a span's details (attributes, events, links, a model call's messages as a
conversation, its log records) load into the panel when it is picked."""

from __future__ import annotations

import json
from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpRequest, HttpResponse
from django.views.decorators.http import require_GET

from runtime.errors import ServiceError
from runtime.models import Exec, TraceLog, TraceSpan
from runtime.services import traces as trace_svc
from runtime.services.usage import parse_range

from .views import render_page, team_context

PAGE_SPANS = 1000  # spans per page of a trace's waterfall
MODEL_OPS = {"chat", "text_completion", "generate_content", "embeddings"}
COMMANDS = {"exec", "process.start", "terminal.open", "run.agent"}
MESSAGE_KEYS = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.prompt", "gen_ai.completion")


def span_kind(s: TraceSpan) -> str:
    """model | tool | command | lifecycle | other: the colour of its bar."""
    attrs = s.attributes or {}
    op = str(attrs.get("gen_ai.operation.name") or "")
    if op in MODEL_OPS or s.name.split(" ")[0] in MODEL_OPS:
        return "model"
    if op == "execute_tool" or "gen_ai.tool.name" in attrs or s.name.startswith("execute_tool"):
        return "tool"
    if s.name in COMMANDS:
        return "command"
    if s.name.startswith(("sandbox.", "run.", "file.", "invoke_agent")) or op == "invoke_agent":
        return "lifecycle"
    return "other"


def _filters(request: HttpRequest) -> dict[str, Any]:
    g = request.GET
    since = until = None
    if g.get("from") or g.get("to"):
        since, until = parse_range(g.get("from") or None, g.get("to") or None)
    min_ms = g.get("min_duration_ms") or ""
    return {
        "sandbox": g.get("sandbox", "")[:64], "harness": g.get("harness", "")[:64], "run": g.get("run", "")[:64],
        "service": g.get("service", "")[:255], "status": g.get("status", "") if g.get("status") in ("error", "ok") else "",
        "since": since, "until": until,
        "min_duration_ms": float(min_ms) if min_ms.replace(".", "", 1).isdigit() else None,
        "attrs": [a for a in g.getlist("attr") if a.strip()],
    }  # fmt: skip


@login_required
@require_GET
def traces(request: HttpRequest) -> HttpResponse:
    tc = team_context(request)
    rows: list[dict[str, Any]] = []
    error = ""
    if tc.team is not None:
        try:
            rows = trace_svc.traces_list(team=tc.team, limit=200, **_filters(request))
        except ServiceError as exc:
            error = exc.message
    attrs = [a for a in request.GET.getlist("attr") if a.strip()] or [""]
    return render_page(request, "hangar/traces.html", {"section": "traces", "traces": rows, "error": error,
                                                       "f": request.GET, "attrs": attrs}, tc)  # fmt: skip


def waterfall_rows(spans: list[TraceSpan], start_ns: int, end_ns: int) -> list[dict[str, Any]]:
    """Spans in tree order (children under their parent, by start), with depth and the bar's place."""
    total = max(end_ns - start_ns, 1)
    ids = {s.span_id for s in spans}
    children: dict[str, list[TraceSpan]] = {}
    roots = []
    for s in spans:
        if s.parent_span_id and s.parent_span_id in ids:
            children.setdefault(s.parent_span_id, []).append(s)
        else:
            roots.append(s)  # a root, or a span whose parent is on another page or not here yet
    out: list[dict[str, Any]] = []
    stack = [(s, 0) for s in reversed(roots)]
    while stack:
        s, depth = stack.pop()
        out.append({
            "span": s, "depth": min(depth, 30), "kind": span_kind(s), "duration_ms": (s.end_ns - s.start_ns) / 1e6,
            "left": 100 * (s.start_ns - start_ns) / total, "width": max(100 * (s.end_ns - s.start_ns) / total, 0.3),
            "error": s.status_code == 2, "has_children": s.span_id in children,
        })  # fmt: skip
        stack.extend((c, depth + 1) for c in reversed(children.get(s.span_id, [])))
    return out


@login_required
@require_GET
def trace_detail(request: HttpRequest, trace_id: str) -> HttpResponse:
    tc = team_context(request)
    if tc.team is None:
        raise Http404("no team")
    try:
        trace, spans_qs, logs_qs = trace_svc.trace_get(team=tc.team, trace_id=trace_id)
    except ServiceError:
        raise Http404("no such trace") from None
    try:
        offset = max(0, int(request.GET.get("offset", "0")))
    except ValueError:
        offset = 0
    page = list(spans_qs[offset : offset + PAGE_SPANS + 1])
    more = len(page) > PAGE_SPANS
    page = page[:PAGE_SPANS]
    total = max(trace.end_ns - trace.start_ns, 1)
    logs = [
        # On the spans' time axis (a record of the run's from before or after its spans: at an end).
        {"log": r, "left": min(100.0, max(0.0, 100 * (r.time_ns - trace.start_ns) / total)),
         "at_ms": (r.time_ns - trace.start_ns) / 1e6}
        for r in logs_qs[:500]
    ]  # fmt: skip
    context = {
        "section": "traces", "trace": trace, "rows": waterfall_rows(page, trace.start_ns, trace.end_ns),
        "duration_ms": total / 1e6, "started_at": trace_svc.iso(trace.start_ns), "logs": logs,
        "offset": offset, "next_offset": offset + PAGE_SPANS if more else None,
        "prev_offset": max(0, offset - PAGE_SPANS) if offset else None, "page_size": PAGE_SPANS,
        # The last page grows as spans arrive (dashboard.websockets.trace_live), from the newest row it shows.
        "live": not more, "after": max((s.id for s in page), default=0),
    }  # fmt: skip
    return render_page(request, "hangar/trace_detail.html", context, tc)


def _conversation(attrs: dict[str, Any]) -> list[dict[str, str]]:
    """A model call's messages (GenAI conventions: a JSON list of {role, content | parts}), if any."""
    out: list[dict[str, str]] = []
    for key in MESSAGE_KEYS:
        raw = attrs.get(key)
        if raw is None:
            continue
        try:
            messages = json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            out.append({"role": key.rsplit(".", 1)[-1], "content": str(raw)})
            continue
        for m in messages if isinstance(messages, list) else [messages]:
            if isinstance(m, dict):
                content = m.get("content")
                if content is None and isinstance(m.get("parts"), list):
                    content = "\n".join(
                        str(p.get("content", p)) if isinstance(p, dict) else str(p) for p in m["parts"]
                    )
                out.append(
                    {
                        "role": str(m.get("role", "")),
                        "content": content if isinstance(content, str) else json.dumps(content),
                    }
                )
            else:
                out.append({"role": "", "content": str(m)})
    return out


@login_required
@require_GET
def trace_span(request: HttpRequest, trace_id: str, span_id: str) -> HttpResponse:
    """The span panel's contents (a fragment)."""
    tc = team_context(request)
    span = (
        TraceSpan.objects.filter(team=tc.team, trace_id=trace_id[:32], span_id=span_id[:16]).first()
        if tc.team
        else None
    )
    if span is None:
        raise Http404("no such span")
    logs = TraceLog.objects.filter(team=tc.team, trace_id=span.trace_id, span_id=span.span_id).order_by(
        "time_ns"
    )[:200]
    context = {
        "s": span, "d": trace_svc.span_dict(span), "kind": span_kind(span),
        "attributes": sorted((k, json.dumps(v) if not isinstance(v, str) else v) for k, v in span.attributes.items()),
        "resource": sorted((k, v if isinstance(v, str) else json.dumps(v)) for k, v in span.resource.items()),
        "conversation": _conversation(span.attributes), "logs": logs, "command": _command(span),
    }  # fmt: skip
    return render_page(request, "hangar/partials/trace_span.html", context, tc)


# How much of a command's kept output the span panel shows (its end); the sandbox page has all.
PANEL_OUTPUT_CHARS = 16 * 1024


def _command(span: TraceSpan) -> dict[str, Any] | None:
    """The command a span of Hangar's ran (``hangar.exec.id`` in the span's sandbox, of the
    span's team): its exit and the end of its output, as the sandbox page keeps them."""
    exec_id, sandbox_id = span.attributes.get("hangar.exec.id"), span.attributes.get("hangar.sandbox.id")
    if not isinstance(exec_id, int) or not isinstance(sandbox_id, str):
        return None
    row = Exec.objects.filter(id=exec_id, sandbox_id=sandbox_id, sandbox__team_id=span.team_id).first()
    if row is None:
        return None
    return {
        "row": row, "stdout": row.stdout[-PANEL_OUTPUT_CHARS:], "stderr": row.stderr[-PANEL_OUTPUT_CHARS:],
        "cut": len(row.stdout) > PANEL_OUTPUT_CHARS or len(row.stderr) > PANEL_OUTPUT_CHARS
        or row.stdout_bytes > len(row.stdout.encode()) or row.stderr_bytes > len(row.stderr.encode()),
    }  # fmt: skip
