"""Hangar's own spans: what it did for a caller (an exec, a file written, a sandbox created,
paused, resumed or deleted, a terminal opened), in the same traces as the agents' telemetry.

A request that carries W3C ``traceparent`` (the API's middleware reads it into :data:`PARENT`)
gets its span as a child of the caller's span; a span opened inside another (a create's phases)
is its child; otherwise a span starts a new trace. Every span carries ``hangar.sandbox.id``
(``hangar.run.id``, ``hangar.harness.id`` where they apply), which is what ``GET /traces?sandbox=``
finds. Commands carry their argv, exit code and duration, never their environment.

Spans are written off the request path: :func:`span` only notes the span, and a writer thread
per process stores what was noted every ``FLUSH_S`` (or every ``BATCH`` spans) through
:func:`runtime.services.traces.spans_store`, which masks the team's secrets as for ingested spans.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import queue
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

from django.db import close_old_connections

from ..models import Team
from . import traces as trace_svc
from .otlp import HARNESS_KEY, RUN_KEY, SANDBOX_KEY, Decoded

log = logging.getLogger("hangar.spans")

SERVICE = "hangar"
FLUSH_S = 0.5
BATCH = 500
MAX_PENDING = 50_000  # spans noted and not yet written: past this, new ones are dropped (and counted)
INTERNAL, SERVER = 1, 2  # OTLP SpanKind


@dataclass(frozen=True)
class SpanContext:
    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex


# The caller's span (from traceparent) or the innermost of Hangar's own spans now open.
PARENT: ContextVar[SpanContext | None] = ContextVar("hangar_span_parent", default=None)
# Set inside :func:`silenced`: spans opened there are not noted (a watcher's polls, the inner
# listings of one deep listing), while the span around them is.
SILENT: ContextVar[bool] = ContextVar("hangar_spans_silent", default=False)


def parse_traceparent(value: str | None) -> SpanContext | None:
    """W3C ``traceparent`` (``00-<trace id>-<parent id>-<flags>``); None if absent or invalid."""
    parts = (value or "").strip().lower().split("-")
    if len(parts) < 4 or len(parts[0]) != 2 or parts[0] == "ff":
        return None
    trace_id, span_id = parts[1], parts[2]
    if len(trace_id) != 32 or len(span_id) != 16 or not _hex(trace_id + span_id):
        return None
    if set(trace_id) == {"0"} or set(span_id) == {"0"}:
        return None
    return SpanContext(trace_id, span_id)


def _hex(s: str) -> bool:
    return all(c in "0123456789abcdef" for c in s)


def new_span_id() -> str:
    return secrets.token_hex(8)


def traceparent(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id}-{ctx.span_id}-01"


def set_parent(ctx: SpanContext | None) -> Token[SpanContext | None]:
    return PARENT.set(ctx)


def reset_parent(token: Token[SpanContext | None]) -> None:
    PARENT.reset(token)


def run_trace(run_id: str) -> SpanContext:
    """A run's trace and root span: named by the run's id, so the run, its process and its agent's
    telemetry land in one trace without a column to keep it."""
    digest = sha256(f"hangar-run:{run_id}".encode()).hexdigest()
    return SpanContext(digest[:32], digest[32:48])


@dataclass
class OpenSpan:
    name: str
    team_id: int
    context: SpanContext
    parent_span_id: str
    kind: int
    start_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)

    def set(self, attributes: dict[str, Any]) -> None:
        self.attributes.update(attributes)

    def fail(self, message: str) -> None:
        self.error = message


def _ties(sandbox_id: str, run_id: str, harness_id: str) -> dict[str, str]:
    return {k: v for k, v in ((SANDBOX_KEY, sandbox_id), (RUN_KEY, run_id), (HARNESS_KEY, harness_id)) if v}


def of(sandbox: Any) -> dict[str, Any]:
    """:func:`span`'s ties for an operation on ``sandbox``: its team, its id, and its harness's id
    when it is a harness's sandbox (which its metadata says: only Hangar writes that key), so
    ``GET /traces?harness=`` finds what was done to a harness's sandbox, not only its runs."""
    harness = (sandbox.metadata or {}).get("harness") if isinstance(sandbox.metadata, dict) else None
    return {"team_id": sandbox.team_id, "sandbox_id": sandbox.id,
            "harness_id": harness if isinstance(harness, str) else ""}  # fmt: skip


def tie_attributes(sandbox: Any) -> dict[str, str]:
    """:func:`of` as a span's attributes (for :func:`record`)."""
    ties = of(sandbox)
    return _ties(ties["sandbox_id"], "", ties["harness_id"])


@contextlib.contextmanager
def silenced() -> Iterator[None]:
    """Spans opened inside the block are not noted (see :data:`SILENT`)."""
    token = SILENT.set(True)
    try:
        yield
    finally:
        SILENT.reset(token)


@contextlib.contextmanager
def span(
    name: str,
    *,
    team_id: int,
    sandbox_id: str = "",
    run_id: str = "",
    harness_id: str = "",
    attributes: dict[str, Any] | None = None,
    kind: int = INTERNAL,
    parent: SpanContext | None = None,
) -> Iterator[OpenSpan]:
    """Note a span around the block (a child of ``parent``, else of :data:`PARENT`, else a new
    trace's root); an exception that leaves the block marks it failed, and is raised on. Inside
    :func:`silenced`, the block runs with nothing noted."""
    up = parent or PARENT.get()
    ctx = SpanContext(up.trace_id if up else secrets.token_hex(16), secrets.token_hex(8))
    opened = OpenSpan(name=name, team_id=team_id, context=ctx, parent_span_id=up.span_id if up else "",
                      kind=kind, start_ns=time.time_ns(),
                      attributes={**_ties(sandbox_id, run_id, harness_id), **(attributes or {})})  # fmt: skip
    if SILENT.get():
        yield opened
        return
    token = PARENT.set(ctx)
    try:
        yield opened
    except BaseException as exc:
        opened.fail(getattr(exc, "message", "") or str(exc) or type(exc).__name__)
        raise
    finally:
        PARENT.reset(token)
        note(opened, time.time_ns())


def traced(
    name: str, attributes: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A service that takes ``sandbox=`` (or ``team=``, and returns a sandbox) noted as a span;
    ``attributes(kwargs)`` adds what the call was asked (a ``path=`` is ``file.path`` anyway)."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            sandbox, team = kwargs.get("sandbox"), kwargs.get("team")
            team_id = sandbox.team_id if sandbox is not None else getattr(team, "id", None)
            if team_id is None:
                return fn(*args, **kwargs)
            asked = {"file.path": kwargs["path"]} if isinstance(kwargs.get("path"), str) else {}
            if attributes is not None:
                asked.update(attributes(kwargs))
            ties = of(sandbox) if sandbox is not None else {"team_id": team_id}
            with span(name, **ties, attributes=asked) as opened:
                result = fn(*args, **kwargs)
                if sandbox is None and getattr(result, "id", None):
                    opened.attributes[SANDBOX_KEY] = result.id
                return result

        return inner

    return wrap


def current_traceparent() -> str:
    """The open span as ``traceparent`` (for a task that continues it elsewhere), or ""."""
    ctx = PARENT.get()
    return traceparent(ctx) if ctx is not None else ""


def record(
    name: str, *, team_id: int, context: SpanContext, parent_span_id: str, start_ns: int, end_ns: int,
    attributes: dict[str, Any], error: str = "", kind: int = INTERNAL,
) -> None:  # fmt: skip
    """Note a span whose times and ids are known (a run's root and its agent's process, at the end)."""
    note(OpenSpan(name=name, team_id=team_id, context=context, parent_span_id=parent_span_id, kind=kind,
                  start_ns=start_ns, attributes=attributes, error=error), end_ns)  # fmt: skip


def ns(when: Any) -> int:
    """A datetime as nanoseconds since the epoch."""
    return int(when.timestamp() * 1_000_000_000)


def note(opened: OpenSpan, end_ns: int) -> None:
    """Queue a finished span for the writer."""
    row = {
        "trace_id": opened.context.trace_id, "span_id": opened.context.span_id,
        "parent_span_id": opened.parent_span_id, "name": opened.name, "kind": opened.kind,
        "start_ns": opened.start_ns, "end_ns": max(end_ns, opened.start_ns),
        "status_code": 2 if opened.error else 0, "status_message": opened.error[:2000],
        "attributes": opened.attributes, "events": opened.events, "links": [],
        "resource": {"service.name": SERVICE}, "scope": {"name": "hangar", "version": ""}, "service": SERVICE,
        "sandbox_id": str(opened.attributes.get(SANDBOX_KEY, ""))[:32],
        "run_id": str(opened.attributes.get(RUN_KEY, ""))[:32],
        "harness_id": str(opened.attributes.get(HARNESS_KEY, ""))[:32],
    }  # fmt: skip
    _writer().put(opened.team_id, row)


class _Writer:
    """One per process: takes noted spans and stores them in batches, off the caller's thread."""

    def __init__(self) -> None:
        self.pending: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self.dropped = 0
        self.idle = threading.Event()
        self.idle.set()
        self.thread = threading.Thread(target=self._run, name="hangar-spans", daemon=True)
        self.thread.start()
        atexit.register(self.flush, 5.0)

    def put(self, team_id: int, row: dict[str, Any]) -> None:
        if self.pending.qsize() >= MAX_PENDING:
            self.dropped += 1
            if self.dropped in (1, 1000) or self.dropped % 100_000 == 0:
                log.warning(
                    "spans: %d of Hangar's spans dropped (the database is not keeping up)", self.dropped
                )
            return
        self.idle.clear()
        self.pending.put((team_id, row))

    def flush(self, timeout: float) -> bool:
        """Wait until what was noted so far is written (tests; the process's exit)."""
        return self.idle.wait(timeout)

    def _run(self) -> None:
        while True:
            batch = [self.pending.get()]
            deadline = time.monotonic() + FLUSH_S
            while len(batch) < BATCH:
                try:
                    batch.append(self.pending.get(timeout=max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    break
            self._write(batch)
            if self.pending.empty():
                self.idle.set()

    def _write(self, batch: list[tuple[int, dict[str, Any]]]) -> None:
        by_team: dict[int, list[dict[str, Any]]] = {}
        for team_id, row in batch:
            by_team.setdefault(team_id, []).append(row)
        close_old_connections()
        try:
            for team_id, rows in by_team.items():
                team = Team.objects.filter(id=team_id).first()
                if team is not None:
                    trace_svc.spans_store(team=team, decoded=Decoded(rows=rows))
        except Exception:  # the writer must go on: a lost batch of spans is logged, not fatal
            log.exception("spans: could not write %d span(s)", len(batch))
        finally:
            close_old_connections()


_WRITER: _Writer | None = None
_WRITER_PID = 0
_LOCK = threading.Lock()


def _writer() -> _Writer:
    global _WRITER, _WRITER_PID
    if _WRITER is None or _WRITER_PID != os.getpid():  # a forked worker starts its own
        with _LOCK:
            if _WRITER is None or _WRITER_PID != os.getpid():
                _WRITER, _WRITER_PID = _Writer(), os.getpid()
    return _WRITER


def flush(timeout: float = 5.0) -> bool:
    return _writer().flush(timeout)
