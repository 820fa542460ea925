"""What each tab of a sandbox's page shows: its terminals, its commands (history and the one
being followed), its files (the browser: a directory's listing, the head of an opened file) and
its events. Read for a page, for its htmx fragment, and after a form posted from a tab."""

from __future__ import annotations

import logging
import posixpath
import shlex
import stat
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from django.contrib import messages
from django.http import HttpRequest

from runtime.errors import ServiceError
from runtime.models import Exec, Sandbox, Terminal
from runtime.services import processes as proc_svc
from runtime.services import sandbox_io as io_svc

from .views import TeamContext

log = logging.getLogger(__name__)
T = TypeVar("T")
S = Sandbox.Status
HISTORY_SIZE = 50
VIEW_LIMIT = 256 * 1024
TABS = [("terminal", "Terminal"), ("commands", "Commands"), ("files", "Files"), ("events", "Events")]


def _command_text(argv: list[str]) -> str:
    if len(argv) == 3 and argv[:2] == ["/bin/sh", "-c"]:
        return argv[2]
    return shlex.join(argv)


def _duration(row: Exec) -> str:
    ms = row.duration_ms
    if ms is None and row.finished_at is not None:
        ms = (row.finished_at - row.started_at).total_seconds() * 1000
    if ms is None:
        return ""
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    return f"{int(ms // 60_000)} min {int(ms % 60_000 // 1000)} s"


def _mode_string(entry: Any) -> str:
    kind = {"dir": "d", "symlink": "l"}.get(entry.type, "-")
    return kind + stat.filemode(entry.mode & 0o7777)[1:]


def _crumbs(path: str) -> list[tuple[str, str]]:
    crumbs, parts = [("/", "/")], [p for p in path.split("/") if p]
    for i, part in enumerate(parts):
        crumbs.append((part, "/" + "/".join(parts[: i + 1])))
    return crumbs


def _looks_binary(data: bytes) -> bool:
    if b"\0" in data[:8192]:
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A cut in the middle of a character at the end is still text.
        return exc.start < len(data) - 4
    return False


def _read_head(sandbox: Sandbox, path: str, no_pseudo_fs: bool) -> dict[str, Any]:
    entry, chunks = io_svc.sandbox_file_read(sandbox=sandbox, path=path, no_pseudo_fs=no_pseudo_fs)
    head = bytearray()
    try:
        for chunk in chunks:
            head += chunk
            if len(head) > VIEW_LIMIT:
                break
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()
    data = bytes(head[:VIEW_LIMIT])
    binary = _looks_binary(data)
    return {
        "path": entry.path or path,
        "name": entry.name or posixpath.basename(path),
        "size": entry.size,
        "binary": binary,
        "truncated": len(head) > VIEW_LIMIT or entry.size > VIEW_LIMIT,
        "text": "" if binary else data.decode("utf-8", errors="replace"),
    }


class FileOpFailed(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


def file_op(what: str, fn: Callable[[], T]) -> T:
    """Run a file service call; any failure becomes a :class:`FileOpFailed` with a message to show.
    Errors the services know (ENOENT, EACCES, not running…) come with theirs; anything else is
    logged, so the page says something went wrong instead of answering 500."""
    try:
        return fn()
    except ServiceError as exc:
        raise FileOpFailed(exc.message) from exc
    except Exception as exc:
        log.exception("%s failed", what)
        raise FileOpFailed("the node failed to do it; the server log has the details") from exc


def _files_context(request: HttpRequest, sandbox: Sandbox, no_pseudo_fs: bool) -> dict[str, Any]:
    path = request.GET.get("path") or "/"
    if not path.startswith("/"):
        path = "/" + path
    path = posixpath.normpath(path) if path != "/" else "/"
    if path.startswith("//"):
        path = "/" + path.lstrip("/")
    ctx: dict[str, Any] = {"path": path, "crumbs": _crumbs(path), "parent": posixpath.dirname(path)}
    if sandbox.status != S.RUNNING:
        return ctx
    opened = request.GET.get("file")
    if opened:
        try:
            ctx["file"] = file_op(f"reading {opened}", lambda: _read_head(sandbox, opened, no_pseudo_fs))
        except FileOpFailed as exc:
            if "EISDIR" in exc.message:  # a symlink to a directory: list it instead
                return _files_context_for(request, sandbox, opened, no_pseudo_fs)
            messages.error(request, f"Could not open {opened}: {exc.message}")
    try:
        entries = file_op(
            f"listing {path}",
            lambda: io_svc.sandbox_file_list(sandbox=sandbox, path=path, no_pseudo_fs=no_pseudo_fs),
        )
    except FileOpFailed as exc:
        messages.error(request, f"Could not list {path}: {exc.message}")
        ctx["entries"] = None
        return ctx
    order = {"dir": 0}
    ctx["entries"] = [
        {
            "entry": e,
            "mode": _mode_string(e),
            "mtime": datetime.fromtimestamp(e.mtime, tz=UTC) if e.mtime else None,
        }
        for e in sorted(entries, key=lambda e: (order.get(e.type, 1), e.name))
    ]
    return ctx


def _files_context_for(
    request: HttpRequest, sandbox: Sandbox, path: str, no_pseudo_fs: bool
) -> dict[str, Any]:
    query = request.GET.copy()
    query["path"] = path
    query.pop("file", None)
    request.GET = query  # type: ignore[assignment]  # django-stubs: GET is read-only; Django lets a view swap it
    return _files_context(request, sandbox, no_pseudo_fs)


def _terminal_context(
    request: HttpRequest, sandbox: Sandbox, selected_id: str | None = None
) -> dict[str, Any]:
    selected_id = selected_id or request.GET.get("terminal")
    terminals = list(proc_svc.terminals_for_sandbox(sandbox=sandbox).filter(status=Terminal.Status.RUNNING))
    selected = next((t for t in terminals if t.id == selected_id), None)
    if selected is None and selected_id:
        # An ended terminal named in the URL is still shown (its exit and last screen).
        selected = proc_svc.terminals_for_sandbox(sandbox=sandbox).filter(id=selected_id).first()
        if selected is not None:
            terminals.append(selected)
    if selected is None and terminals:
        selected = terminals[0]
    return {"terminals": terminals, "terminal": selected}


def _commands_context(
    request: HttpRequest, sandbox: Sandbox, current_id: int | None = None
) -> dict[str, Any]:
    history = list(sandbox.execs.defer("stdout", "stderr")[:HISTORY_SIZE])
    for row in history:
        row.command = _command_text(row.argv)  # type: ignore[attr-defined]
        row.duration = _duration(row)  # type: ignore[attr-defined]
    ctx: dict[str, Any] = {"history": history, "current": None}
    wanted = current_id or request.GET.get("process")
    if wanted:
        try:
            current = proc_svc.process_get(sandbox=sandbox, process_id=wanted)
        except ServiceError as exc:
            messages.error(request, exc.message)
        else:
            current.command = _command_text(current.argv)  # type: ignore[attr-defined]
            current.duration = _duration(current)  # type: ignore[attr-defined]
            current.stdout_cut = current.stdout_bytes > len(current.stdout.encode())  # type: ignore[attr-defined]
            current.stderr_cut = current.stderr_bytes > len(current.stderr.encode())  # type: ignore[attr-defined]
            ctx["current"] = current
    return ctx


def _events_context(sandbox: Sandbox) -> dict[str, Any]:
    events = list(sandbox.events.order_by("-id")[:500])
    events.reverse()
    return {"events": events}


def tab_context(
    request: HttpRequest, tc: TeamContext, sandbox: Sandbox, tab: str, **extra: Any
) -> dict[str, Any]:
    ctx: dict[str, Any] = {
        "sandbox": sandbox,
        "tab": tab,
        "tabs": TABS,
        "can_change": tc.can_change,
        "readonly": not tc.can_change,
        "live": sandbox.status == S.RUNNING,
        "preparing": sandbox.status in (S.PENDING, S.STARTING),
        "last_cmd": extra.get("last_cmd", ""),
    }
    if tab == "terminal":
        ctx.update(_terminal_context(request, sandbox, extra.get("terminal_id")))
        ctx["auto_open"] = (
            ctx["live"] and tc.can_change and not ctx["terminals"] and extra.get("auto_open", True)
        )
    elif tab == "commands":
        ctx.update(_commands_context(request, sandbox, extra.get("process_id")))
    elif tab == "files":
        ctx.update(_files_context(request, sandbox, tc.no_pseudo_fs))
    else:
        ctx.update(_events_context(sandbox))
    return ctx


def _default_tab(sandbox: Sandbox) -> str:
    return "terminal" if sandbox.status in (S.RUNNING, S.PENDING, S.STARTING) else "events"


def tab_of(request: HttpRequest, sandbox: Sandbox) -> str:
    tab = request.GET.get("tab") or _default_tab(sandbox)
    return tab if tab in dict(TABS) else _default_tab(sandbox)
