"""Pages: overview, sandboxes (list, create, detail with terminal, commands, files and events),
sign-in and the team switcher.

Every page works in the signed-in user's current team (:mod:`dashboard.teams`); sandboxes are
read through the same services the API uses, so another team's sandbox is a 404 here too.
One view serves a page and its htmx fragment (``HX-Request`` picks the partial). Views are
sync except the few that call the async process services (terminals, commands) or stream a
file (an async iterator, so a large download is not read into memory under ASGI).
"""

from __future__ import annotations

import logging
import posixpath
import shlex
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import (
    Http404,
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    HttpResponseForbidden,
    StreamingHttpResponse,
)
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from runtime.errors import InvalidValue, ServiceError
from runtime.launchers import launcher_names
from runtime.models import Exec, Image, ImageJob, Membership, Sandbox, Team, Terminal
from runtime.node import local_node_name
from runtime.services import images as image_svc
from runtime.services import processes as proc_svc
from runtime.services import sandboxes as svc
from runtime.services import volumes as volume_svc
from runtime.services.nodes import nodes_with_usage

from .forms import SandboxCreateForm
from .teams import SESSION_KEY, user_memberships

log = logging.getLogger(__name__)
T = TypeVar("T")
S = Sandbox.Status
PAGE_SIZE = 50
HISTORY_SIZE = 50
VIEW_LIMIT = 256 * 1024
FILTERS = [
    ("active", "Active"),
    (S.RUNNING, "Running"),
    (S.PAUSED, "Paused"),
    (S.STOPPED, "Stopped"),
    (S.FAILED, "Failed"),
    (S.DELETED, "Deleted"),
]
TABS = [("terminal", "Terminal"), ("commands", "Commands"), ("files", "Files"), ("events", "Events")]
VIEWER_REFUSAL = "Viewers of this team can look at its sandboxes but not change them."


# -- the current team -------------------------------------------------------------------------


@dataclass
class TeamContext:
    memberships: list[Membership]
    membership: Membership | None

    @property
    def team(self) -> Team | None:
        return self.membership.team if self.membership else None

    @property
    def is_admin(self) -> bool:
        return self.membership is not None and self.membership.role in (
            Membership.Role.ADMIN,
            Membership.Role.OWNER,
        )

    @property
    def can_change(self) -> bool:
        return self.membership is not None and self.membership.role != Membership.Role.VIEWER


def _team_context(request: HttpRequest) -> TeamContext:
    """The user's memberships and the current one, in one query (the same choice as
    :func:`dashboard.teams.session_team`: the session's team if still a member, else the first)."""
    memberships = user_memberships(user=request.user)
    wanted = request.session.get(SESSION_KEY)
    current = next((m for m in memberships if m.team_id == wanted), memberships[0] if memberships else None)
    return TeamContext(memberships=memberships, membership=current)


def _is_fragment(request: HttpRequest) -> bool:
    # A history restore asks for the whole page even though it comes from htmx.
    return bool(request.headers.get("HX-Request")) and not request.headers.get("HX-History-Restore-Request")


def _render(
    request: HttpRequest, template: str, context: dict[str, Any], tc: TeamContext, status: int = 200
) -> HttpResponse:
    response = render(
        request, template, {**context, "nav": tc, "fragment": _is_fragment(request)}, status=status
    )
    response["Vary"] = "HX-Request"
    return response


def _sandbox_or_404(tc: TeamContext, sandbox_id: str) -> Sandbox:
    if tc.team is None:
        raise Http404("not in a team")
    try:
        return svc.sandbox_get(team=tc.team, sandbox_id=sandbox_id)
    except ServiceError as exc:
        raise Http404(exc.message) from None


def _detail_url(sandbox_id: str, **query: str) -> str:
    url = reverse("sandbox", args=[sandbox_id])
    return f"{url}?{urlencode(query)}" if query else url


# -- sign-in and team switcher ----------------------------------------------------------------


@login_required
@require_POST
def team_switch(request: HttpRequest) -> HttpResponse:
    """Make another of the user's teams the current one."""
    try:
        team_id = int(request.POST.get("team", ""))
    except ValueError:
        return HttpResponseForbidden("No such team.")
    if not Membership.objects.filter(user=request.user, team_id=team_id).exists():
        return HttpResponseForbidden("You are not a member of that team.")
    request.session[SESSION_KEY] = team_id
    target = request.POST.get("next") or reverse("sandboxes")
    # A sandbox page belongs to the old team: land on the list instead of a 404.
    if not url_has_allowed_host_and_scheme(target, {request.get_host()}) or target.startswith(
        "/sandboxes/sb"
    ):
        target = reverse("sandboxes")
    return redirect(target)


# -- overview ---------------------------------------------------------------------------------


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    """Nodes, images and the current team's sandbox counts; the node table refreshes itself."""
    tc = _team_context(request)
    if _is_fragment(request):
        return _render(request, "hangar/partials/nodes.html", {"nodes": list(nodes_with_usage())}, tc)
    counts = dict.fromkeys((S.RUNNING, S.PENDING, S.STARTING, S.FAILED), 0)
    if tc.team is not None:
        grouped = (
            Sandbox.objects.filter(team=tc.team, status__in=list(counts))
            .exclude(pool__isnull=False, claimed_at__isnull=True)
            .values("status")
        )
        counts.update({row["status"]: row["n"] for row in grouped.annotate(n=Count("id"))})
    context = {
        "section": "overview",
        "nodes": list(nodes_with_usage()),
        "images": Image.objects.prefetch_related("nodes").order_by("name"),
        "teams": [m.team for m in tc.memberships],
        "team": tc.team,
        "counts": counts,
    }
    return _render(request, "hangar/overview.html", context, tc)


# -- sandboxes list ---------------------------------------------------------------------------


@dataclass
class SandboxRow:
    """A sandbox as a list row: the row plus its last usage sample."""

    sandbox: Sandbox
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def cpu_pct(self) -> float | None:
        return self.stats.get("cpu_pct")

    @property
    def memory_bytes(self) -> int | None:
        return self.stats.get("memory_bytes")

    @property
    def disk_bytes(self) -> int | None:
        """Written to its own disk (None: no sample, or no disk of its own)."""
        return self.stats.get("disk_bytes") if self.sandbox.disk_mb else None

    @property
    def memory_limit_bytes(self) -> int:
        return self.sandbox.memory_mb * 1024 * 1024

    @property
    def has_ttl(self) -> bool:
        return self.sandbox.expires_at is not None and self.sandbox.status in (
            S.PENDING,
            S.STARTING,
            S.RUNNING,
            S.FAILED,
        )

    @property
    def created_ts(self) -> int:
        return int(self.sandbox.created_at.timestamp() * 1000)


def _rows(sandboxes: list[Sandbox]) -> list[SandboxRow]:
    # One Redis round trip for the page; only running sandboxes have usage to show.
    running = [s.id for s in sandboxes if s.status == S.RUNNING]
    stats = svc.sandboxes_stats_cached(ids=running)
    return [SandboxRow(sandbox=s, stats=stats.get(s.id) or {}) for s in sandboxes]


def sandbox_rows_context(*, team: Team, ids: list[str]) -> list[SandboxRow]:
    """Rows for the given sandboxes of ``team`` (others are ignored), for the list's live push."""
    sandboxes = Sandbox.objects.filter(team=team, id__in=ids).select_related("node").order_by("-created_at")
    return _rows(list(sandboxes))


def _create_form(team: Team | None, data: Any = None) -> SandboxCreateForm:
    from runtime.models import Secret

    images = list(Image.objects.order_by("name").values_list("name", flat=True))
    names = (
        list(Secret.objects.filter(team=team).order_by("name").values_list("name", flat=True)) if team else []
    )
    return SandboxCreateForm(data, images=images, runtimes=launcher_names(), secrets=names)


@login_required
@require_http_methods(["GET", "POST"])
def sandboxes(request: HttpRequest) -> HttpResponse:
    """The current team's sandboxes, filtered by status, 50 a page; POST creates one."""
    tc = _team_context(request)
    form: SandboxCreateForm | None = None
    status = 200
    if request.method == "POST":
        if not tc.can_change or tc.team is None:
            return HttpResponseForbidden(VIEWER_REFUSAL)
        form = _create_form(tc.team, request.POST)
        if form.is_valid():
            data = form.cleaned_data
            try:
                sandbox = svc.sandbox_create(
                    team=tc.team, user=request.user, image=data["image"], runtime=data["runtime"],
                    cpu=data["cpu"], memory_mb=data["memory_mb"], timeout_s=data["timeout_s"], env=data["env"],
                    on_expire=data.get("on_expire") or "destroy", idle_timeout_s=data.get("idle_timeout_s"),
                    pause_mode=data.get("pause_mode") or "stop", secrets=list(data.get("secrets") or []),
                    network={"egress": data.get("egress") or "none",
                             "allow": (data.get("allow") or "").replace(",", " ").split()},
                    disk_mb=data.get("disk_mb"),
                )  # fmt: skip
            except ServiceError as exc:
                form.add_service_error(exc.message)
            else:
                messages.success(request, f"Sandbox {sandbox.id} created on node {sandbox.node}.")
                return redirect("sandbox", sandbox.id)
        status = 422

    current = request.GET.get("status") or "active"
    if current not in dict(FILTERS):
        current = "active"
    context: dict[str, Any] = {"section": "sandboxes", "filter": current, "form": form or _create_form(tc.team),
                               "rendered_at": f"{time.time():.3f}"}  # fmt: skip
    if tc.team is not None:
        grouped = (
            Sandbox.objects.filter(team=tc.team)
            .exclude(pool__isnull=False, claimed_at__isnull=True)  # warm pool members: nobody's yet
            .values("status")
            .annotate(n=Count("id"))
        )
        by_status = {row["status"]: row["n"] for row in grouped}
        counts = {key: by_status.get(key, 0) for key, _ in FILTERS}
        counts["active"] = sum(n for s, n in by_status.items() if s != S.DELETED)
        qs = svc.sandboxes_for_team(team=tc.team, status=None if current == "active" else current)
        page = Paginator(qs.order_by("-created_at"), PAGE_SIZE).get_page(request.GET.get("page"))
        from runtime.services.pools import pool_fill, pools_for_team

        context.update(
            pools=[{"pool": p, **pool_fill(p)} for p in pools_for_team(team=tc.team)],
            page=page,
            rows=_rows(list(page.object_list)),
            filters=[(key, label, counts[key]) for key, label in FILTERS],
            total=sum(by_status.values()),
        )
    return _render(request, "hangar/sandboxes.html", context, tc, status=status)


# -- sandbox detail ---------------------------------------------------------------------------


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


def _read_head(sandbox: Sandbox, path: str) -> dict[str, Any]:
    entry, chunks = svc.sandbox_file_read(sandbox=sandbox, path=path)
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


def _file_op(what: str, fn: Callable[[], T]) -> T:
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


def _files_context(request: HttpRequest, sandbox: Sandbox) -> dict[str, Any]:
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
            ctx["file"] = _file_op(f"reading {opened}", lambda: _read_head(sandbox, opened))
        except FileOpFailed as exc:
            if "EISDIR" in exc.message:  # a symlink to a directory: list it instead
                return _files_context_for(request, sandbox, opened)
            messages.error(request, f"Could not open {opened}: {exc.message}")
    try:
        entries = _file_op(f"listing {path}", lambda: svc.sandbox_file_list(sandbox=sandbox, path=path))
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


def _files_context_for(request: HttpRequest, sandbox: Sandbox, path: str) -> dict[str, Any]:
    query = request.GET.copy()
    query["path"] = path
    query.pop("file", None)
    request.GET = query
    return _files_context(request, sandbox)


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


def _tab_context(
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
        ctx.update(_files_context(request, sandbox))
    else:
        ctx.update(_events_context(sandbox))
    return ctx


def _default_tab(sandbox: Sandbox) -> str:
    return "terminal" if sandbox.status in (S.RUNNING, S.PENDING, S.STARTING) else "events"


def _tab_of(request: HttpRequest, sandbox: Sandbox) -> str:
    tab = request.GET.get("tab") or _default_tab(sandbox)
    return tab if tab in dict(TABS) else _default_tab(sandbox)


@login_required
@require_GET
def sandbox_detail(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    """One sandbox: its header and actions, and a tab (``?tab=``) as page or htmx fragment."""
    tc = _team_context(request)
    sandbox = _sandbox_or_404(tc, sandbox_id)
    tab = _tab_of(request, sandbox)
    context = _tab_context(request, tc, sandbox, tab)
    if _is_fragment(request):
        return _render(request, "hangar/partials/sandbox_tabs.html", context, tc)
    last = sandbox.events.order_by("-id").values_list("id", flat=True).first()
    context.update(section="sandboxes", last_event_id=last or 0)
    return _render(request, "hangar/sandbox_detail.html", context, tc)


def _after_action(request: HttpRequest, tc: TeamContext, sandbox_id: str) -> HttpResponse:
    if _is_fragment(request):
        sandbox = _sandbox_or_404(tc, sandbox_id)
        ctx = {"sandbox": sandbox, "readonly": not tc.can_change, "show_messages": True}
        return _render(request, "hangar/partials/sandbox_header.html", ctx, tc)
    return redirect("sandbox", sandbox_id)


def _sandbox_action(
    request: HttpRequest, sandbox_id: str, act: Callable[[Sandbox, str], Any], doing: str
) -> HttpResponse:
    """A header button: the team's member asks, the service acts, the header is redrawn."""
    tc = _team_context(request)
    sandbox = _sandbox_or_404(tc, sandbox_id)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    try:
        act(sandbox, request.user.get_username())
    except ServiceError as exc:
        messages.error(request, exc.message)
    else:
        messages.info(request, f"{doing} {sandbox.id}…")
    return _after_action(request, tc, sandbox_id)


@login_required
@require_POST
def sandbox_stop(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    return _sandbox_action(
        request, sandbox_id,
        lambda sb, who: svc.sandbox_stop(sandbox=sb, reason=f"stopped from the dashboard by {who}"), "Stopping",
    )  # fmt: skip


@login_required
@require_POST
def sandbox_pause(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    mode = request.POST.get("mode") or None
    doing = "Checkpointing" if mode == "checkpoint" else "Pausing"
    return _sandbox_action(
        request, sandbox_id, lambda sb, who: svc.sandbox_pause(sandbox=sb, mode=mode), doing
    )


@login_required
@require_POST
def sandbox_resume(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    return _sandbox_action(request, sandbox_id, lambda sb, who: svc.sandbox_resume(sandbox=sb), "Resuming")


@login_required
@require_POST
def sandbox_delete(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    return _sandbox_action(
        request, sandbox_id,
        lambda sb, who: svc.sandbox_delete(sandbox=sb, reason=f"deleted from the dashboard by {who}"), "Deleting",
    )  # fmt: skip


@login_required
@require_POST
def sandbox_keepalive(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    tc = _team_context(request)
    sandbox = _sandbox_or_404(tc, sandbox_id)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    try:
        seconds = int(request.POST.get("seconds", "3600"))
    except ValueError:
        messages.error(request, "The extension must be a whole number of seconds.")
    else:
        try:
            svc.sandbox_keepalive(sandbox=sandbox, timeout_s=seconds)
        except ServiceError as exc:
            messages.error(request, exc.message)
        else:
            messages.success(request, f"{sandbox.id} now expires {seconds} s from now.")
    return _after_action(request, tc, sandbox_id)


# -- terminals and commands (async: the process services wait on the channel layer) -----------


async def _async_sandbox(request: HttpRequest, sandbox_id: str) -> tuple[TeamContext, Sandbox]:
    def load() -> tuple[TeamContext, Sandbox]:
        tc = _team_context(request)
        return tc, _sandbox_or_404(tc, sandbox_id)

    return await sync_to_async(load)()


async def _tab_response(
    request: HttpRequest, tc: TeamContext, sandbox: Sandbox, tab: str, push: str, **extra: Any
) -> HttpResponse:
    if not _is_fragment(request):
        return redirect(push)

    def build() -> HttpResponse:
        context = _tab_context(request, tc, sandbox, tab, **extra)
        return _render(request, "hangar/partials/sandbox_tabs.html", context, tc)

    response = await sync_to_async(build)()
    response["HX-Push-Url"] = push
    return response


@login_required
@require_POST
async def terminal_create(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    """Open a shell in the sandbox and show it in the Terminal tab."""
    tc, sandbox = await _async_sandbox(request, sandbox_id)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    user = await request.auser()
    try:
        rows = min(max(int(request.POST.get("rows", 24)), 1), 1000)
        cols = min(max(int(request.POST.get("cols", 80)), 1), 1000)
    except ValueError:
        rows, cols = 24, 80
    try:
        term = await proc_svc.terminal_open(sandbox=sandbox, rows=rows, cols=cols, user=user)
    except ServiceError as exc:
        await sync_to_async(messages.error)(request, f"Could not open a terminal: {exc.message}")
        return await _tab_response(
            request, tc, sandbox, "terminal", _detail_url(sandbox.id, tab="terminal"), auto_open=False
        )
    push = _detail_url(sandbox.id, tab="terminal", terminal=term.id)
    return await _tab_response(request, tc, sandbox, "terminal", push, terminal_id=term.id)


@login_required
@require_POST
async def command_run(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    """Start a shell command as a streamed process; the page follows its output over a socket."""
    tc, sandbox = await _async_sandbox(request, sandbox_id)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    user = await request.auser()
    cmd = request.POST.get("cmd", "")
    timeout: float | None = None
    raw_timeout = request.POST.get("timeout_s", "").strip()
    push = _detail_url(sandbox.id, tab="commands")
    try:
        if raw_timeout:
            try:
                timeout = float(raw_timeout)
            except ValueError:
                raise ServiceError(f"timeout must be a number of seconds, got {raw_timeout!r}") from None
        row = await proc_svc.process_start(
            sandbox=sandbox, cmd=cmd, kind=Exec.Kind.STREAM, stdin_open=False, timeout_s=timeout, user=user
        )
    except ServiceError as exc:
        await sync_to_async(messages.error)(request, exc.message)
        return await _tab_response(request, tc, sandbox, "commands", push, last_cmd=cmd)
    push = _detail_url(sandbox.id, tab="commands", process=str(row.id))
    return await _tab_response(request, tc, sandbox, "commands", push, process_id=row.id)


# -- files ------------------------------------------------------------------------------------


def _files_url(sandbox_id: str, path: str) -> str:
    return _detail_url(sandbox_id, tab="files", path=path)


async def _aiter(chunks: Iterator[bytes]) -> AsyncIterator[bytes]:
    sentinel = object()
    step = sync_to_async(lambda: next(chunks, sentinel), thread_sensitive=False)
    try:
        while (chunk := await step()) is not sentinel:
            yield chunk  # type: ignore[misc]
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            await sync_to_async(close, thread_sensitive=False)()


@login_required
async def file_download(request: HttpRequest, sandbox_id: str) -> HttpResponseBase:
    """A file from inside the sandbox, streamed as an attachment."""
    tc, sandbox = await _async_sandbox(request, sandbox_id)
    path = request.GET.get("path", "")
    try:
        entry, chunks = await sync_to_async(_file_op, thread_sensitive=False)(
            f"reading {path}", lambda: svc.sandbox_file_read(sandbox=sandbox, path=path)
        )
    except FileOpFailed as exc:
        await sync_to_async(messages.error)(request, f"Could not download {path}: {exc.message}")
        return redirect(_files_url(sandbox.id, posixpath.dirname(path) or "/"))
    name = entry.name or posixpath.basename(path) or "file"
    response = StreamingHttpResponse(_aiter(chunks), content_type="application/octet-stream")
    response["Content-Length"] = str(entry.size)
    response["Content-Disposition"] = f"attachment; filename*=UTF-8''{quote(name)}"
    return response


@login_required
@require_POST
def file_upload(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    """Write an uploaded file into the directory being browsed."""
    tc = _team_context(request)
    sandbox = _sandbox_or_404(tc, sandbox_id)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    directory = request.POST.get("path") or "/"
    upload = request.FILES.get("file")
    name = posixpath.basename(upload.name or "") if upload is not None else ""
    if upload is None or name in ("", ".", ".."):
        messages.error(request, "Choose a file to upload.")
    else:
        target = posixpath.join(directory, name)
        try:
            size = _file_op(
                f"writing {target}",
                lambda: svc.sandbox_file_write(sandbox=sandbox, path=target, data=upload.read()),
            )
        except FileOpFailed as exc:
            messages.error(request, f"Could not upload {name}: {exc.message}")
        else:
            messages.success(request, f"Uploaded {target} ({size} bytes).")
    push = _files_url(sandbox.id, directory)
    if not _is_fragment(request):
        return redirect(push)
    request.GET = request.GET.copy()
    request.GET["path"] = directory
    response = _render(
        request, "hangar/partials/sandbox_tabs.html", _tab_context(request, tc, sandbox, "files"), tc
    )
    response["HX-Push-Url"] = push
    return response


# -- images -----------------------------------------------------------------------------------


def _images_context() -> dict[str, Any]:
    return {
        "images": Image.objects.prefetch_related("nodes").order_by("name"),
        "jobs": image_svc.image_jobs_recent(limit=15),
    }


@login_required
def images(request: HttpRequest) -> HttpResponse:
    """Images sandboxes start from, the latest builds and pulls (live), and for staff users the
    forms that start new ones."""
    tc = _team_context(request)
    error, status = "", 200
    if request.method == "POST":
        action = request.POST.get("action")
        try:
            if action == "build":
                job = image_svc.image_job_start(
                    kind=ImageJob.Kind.BUILD, ref=request.POST.get("kind", ""), user=request.user
                )
            elif action == "pull":
                job = image_svc.image_job_start(
                    kind=ImageJob.Kind.PULL, ref=request.POST.get("ref", ""), name=request.POST.get("name", ""),
                    tls_verify=not request.POST.get("insecure"), user=request.user,
                )  # fmt: skip
            else:
                raise InvalidValue("choose build or pull")
        except ServiceError as exc:
            error, status = exc.message, exc.status_code
        else:
            return redirect("image_job", job.id)
    context = {
        "section": "images",
        "error": error,
        "posted": request.POST if request.method == "POST" else {},
        "can_manage": request.user.is_staff,
        "buildable": image_svc.BUILDABLE,
        **_images_context(),
    }
    return _render(request, "hangar/images.html", context, tc, status=status)


@login_required
def image_job(request: HttpRequest, job_id: int) -> HttpResponse:
    """One build or pull: its status and its progress log as it comes."""
    tc = _team_context(request)
    try:
        job = image_svc.image_job_get(job_id=job_id)
    except ServiceError as exc:
        raise Http404(exc.message) from None
    return _render(request, "hangar/image_job.html", {"section": "images", "job": job}, tc)


# -- volumes ----------------------------------------------------------------------------------


@login_required
def volumes(request: HttpRequest) -> HttpResponse:
    """The team's volumes: size, space in use, node, the sandboxes holding each; members create
    and delete them here (deleting one that is held is refused, naming the holders)."""
    tc = _team_context(request)
    error, status = "", 200
    if request.method == "POST":
        if not tc.can_change or tc.team is None:
            return HttpResponseForbidden(VIEWER_REFUSAL)
        try:
            if request.POST.get("action") == "delete":
                volume = volume_svc.volume_get(team=tc.team, volume=request.POST.get("volume", ""))
                volume_svc.volume_delete(volume=volume)
                messages.success(request, f"Volume {volume.name} deleted.")
            else:
                try:
                    size_mb = int(request.POST.get("size_mb", ""))
                except ValueError:
                    raise InvalidValue("size_mb must be a whole number of megabytes") from None
                volume = volume_svc.volume_create(
                    team=tc.team, name=request.POST.get("name", ""), size_mb=size_mb, user=request.user
                )
                messages.success(request, f"Volume {volume.name} created ({volume.size_mb} MB).")
        except ServiceError as exc:
            error, status = exc.message, exc.status_code
        else:
            return redirect("volumes")
    rows = []
    if tc.team is not None:
        local = local_node_name()
        for v in volume_svc.volumes_for_team(team=tc.team):
            usage = volume_svc.volume_usage(v) if v.node and v.node.name == local else None
            rows.append({"volume": v, "usage": usage, "holders": volume_svc.volume_holders(v)})
    context = {
        "section": "volumes",
        "rows": rows,
        "error": error,
        "posted": request.POST if request.method == "POST" else {},
    }
    return _render(request, "hangar/volumes.html", context, tc, status=status)
