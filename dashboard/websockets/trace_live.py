"""``/ws/ui/traces/{trace_id}?after=<row id>``: a trace page's spans, pushed as they are stored.

A browser session of the trace's team (any role: viewers read traces), same-origin, as for the
other live pages; it is watched for as long as it is open like every socket here (its user
removed from the team: 4403; deactivated: 4401). Another team's trace, or none, is 4404.

Server → client, JSON text frames: ``{"type": "spans", "trace": {span_count, error_count,
duration_ms, root_name, start_ns, end_ns}, "rows": [{id, span_id, parent_span_id, start_ns,
end_ns, html}]}``: each row as the page renders it (``hangar/partials/trace_row.html``), which
``static/hangar/traces.js`` puts in its place in the tree; and ``{"type": "more"}`` before a
close (1000) once ``LIVE_MAX`` rows have been sent: the page says to reload. First the rows
stored after ``after`` (the newest the page showed), then each batch as the store announces it
(:mod:`runtime.services.trace_live`: the range of its rows' ids)."""

from __future__ import annotations

import json
import re
from typing import Any

from channels.db import database_sync_to_async
from django.db.models import Q
from django.template.loader import render_to_string

from runtime.errors import ServiceError
from runtime.models import Trace, TraceSpan
from runtime.services import traces as trace_svc
from runtime.services.trace_live import trace_channel

from ..pages.trace_views import waterfall_rows
from . import ws_frames as frames
from .consumers import CLOSE_NOT_FOUND, CLOSE_UNAUTHORIZED, LivePage

LIVE_MAX = 5000  # rows one socket sends; past that the page is reloaded (and paged)
BATCH = 500  # rows read per message
RANGE_RE = re.compile(r"(\d{1,19})-(\d{1,19})")


class TraceLiveConsumer(LivePage):
    trace_id: str
    after: int  # the newest row the page showed
    high: int  # the newest row sent
    sent: int = 0
    unread = False

    async def connect(self) -> None:
        if self.scope.get("api_token") is not None:
            await self.close(code=CLOSE_UNAUTHORIZED)  # the pages' sockets are the browser's
            return
        if not await self._authenticate():
            return
        trace_id = self.scope["url_route"]["kwargs"]["trace_id"]
        try:
            trace, _, _ = await database_sync_to_async(trace_svc.trace_get)(team=self.team, trace_id=trace_id)
        except ServiceError:
            await self.close(code=CLOSE_NOT_FOUND)
            return
        query = await self._refuse_query(frames.LiveTraceQuery)
        if query is None:
            return
        self.trace_id, self.after, self.high = trace.trace_id, query.after, query.after
        self.seen: set[int] = set()  # ids sent above `after`: concurrent batches commit in any order
        await self.accept()
        await self._subscribe(trace_channel(self.team.id, self.trace_id))
        # What was stored between the page's rendering and this subscription.
        self.queue.put_nowait("new")  # type: ignore[union-attr]

    def render(self, items: set[str]) -> str:
        # A batch's own range, whenever it committed; "new": past the newest row sent.
        wanted = Q()
        for item in items:
            m = RANGE_RE.fullmatch(item)
            wanted |= Q(id__gte=int(m[1]), id__lte=int(m[2])) if m else Q(id__gt=self.high)
        read = list(
            TraceSpan.objects.filter(
                wanted, team=self.team, trace_id=self.trace_id, id__gt=self.after
            ).order_by("id")[:BATCH]
        )
        spans = [s for s in read if s.id not in self.seen]
        if not spans:
            return ""
        if self.sent + len(spans) > LIVE_MAX:
            self.done = True
            return json.dumps({"type": "more"})
        self.sent += len(spans)
        self.seen.update(s.id for s in spans)
        self.high = max(self.high, spans[-1].id)
        self.unread = len(read) == BATCH  # more than one read's worth: the rest once this is sent
        trace = Trace.objects.get(team=self.team, trace_id=self.trace_id)
        spans.sort(key=lambda s: (s.start_ns, s.id))
        rows = waterfall_rows(spans, trace.start_ns, trace.end_ns)
        return json.dumps({
            "type": "spans",
            "trace": {"span_count": trace.span_count, "error_count": trace.error_count,
                      "duration_ms": (trace.end_ns - trace.start_ns) / 1e6, "root_name": trace.root_name,
                      "start_ns": str(trace.start_ns), "end_ns": str(trace.end_ns)},
            "rows": [_row(r, self.trace_id) for r in rows],
        }, separators=(",", ":"))  # fmt: skip

    async def send(
        self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False
    ) -> None:
        await super().send(text_data=text_data, bytes_data=bytes_data, close=close)
        if getattr(self, "done", False) and not close:
            await self.close(code=1000)  # the page has as many rows as it should hold: reload
        elif self.unread and self.queue is not None:
            self.unread = False
            self.queue.put_nowait("new")  # on the loop's thread, not render's


def _row(r: dict[str, Any], trace_id: str) -> dict[str, Any]:
    s: TraceSpan = r["span"]
    html = render_to_string("hangar/partials/trace_row.html", {"r": r, "trace_id": trace_id})
    return {"id": s.id, "span_id": s.span_id, "parent_span_id": s.parent_span_id or None,
            "start_ns": str(s.start_ns), "end_ns": str(s.end_ns), "html": html}  # fmt: skip
