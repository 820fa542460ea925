"""Sandbox pages: the team's list (filtered by status, 50 a page, with the create form), one
sandbox's page (its header and actions, and a tab: :mod:`dashboard.pages.sandbox_tabs`), and
what its tabs post: new terminals, commands, file downloads and uploads.

Views are sync except the few that call the async process services (terminals, commands) or
stream a file (an async iterator, so a large download is not read into memory under ASGI).
"""

from __future__ import annotations

import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import quote, urlencode

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.core.paginator import Paginator
from django.db.models import Count
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseBase, HttpResponseForbidden
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from runtime.errors import ServiceError
from runtime.models import Exec, Image, Sandbox, Team
from runtime.services import processes as proc_svc
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as svc
from runtime.services.nodes import runtimes_offered

from ..streaming import download_response
from .forms import SandboxCreateForm
from .sandbox_tabs import FileOpFailed, file_op, tab_context, tab_of
from .teams import SignedInRequest
from .views import VIEWER_REFUSAL, TeamContext, is_fragment, render_page, team_context

S = Sandbox.Status
PAGE_SIZE = 50
FILTERS = [
    ("active", "Active"),
    (S.RUNNING, "Running"),
    (S.PAUSED, "Paused"),
    (S.STOPPED, "Stopped"),
    (S.FAILED, "Failed"),
    (S.DELETED, "Deleted"),
]


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
    stats = io_svc.sandboxes_stats_cached(ids=running)
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
    return SandboxCreateForm(data, images=images, runtimes=runtimes_offered(), secrets=names)


@login_required
@require_http_methods(["GET", "POST"])
def sandboxes(request: SignedInRequest) -> HttpResponse:
    """The current team's sandboxes, filtered by status, 50 a page; POST creates one."""
    tc = team_context(request)
    form: SandboxCreateForm | None = None
    status = 200
    if request.method == "POST":
        if not tc.can_change or tc.team is None:
            return HttpResponseForbidden(VIEWER_REFUSAL)
        form = _create_form(tc.team, request.POST)
        if form.is_valid():
            data = form.cleaned_data
            try:
                spec = svc.SandboxRequest(
                    image=data["image"], runtime=data["runtime"],
                    cpu=data["cpu"], memory_mb=data["memory_mb"], timeout_s=data["timeout_s"], env=data["env"],
                    on_expire=data.get("on_expire") or "destroy", idle_timeout_s=data.get("idle_timeout_s"),
                    pause_mode=data.get("pause_mode") or "stop", secrets=list(data.get("secrets") or []),
                    network={"egress": data.get("egress") or "none",
                             "allow": (data.get("allow") or "").replace(",", " ").split()},
                    disk_mb=data.get("disk_mb"),
                )  # fmt: skip
                sandbox = svc.sandbox_create(team=tc.team, user=request.user, request=spec)
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
    return render_page(request, "hangar/sandboxes.html", context, tc, status=status)


# -- sandbox detail ---------------------------------------------------------------------------


@login_required
@require_GET
def sandbox_detail(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    """One sandbox: its header and actions, and a tab (``?tab=``) as page or htmx fragment."""
    tc = team_context(request)
    sandbox = _sandbox_or_404(tc, sandbox_id)
    tab = tab_of(request, sandbox)
    context = tab_context(request, tc, sandbox, tab)
    if is_fragment(request):
        return render_page(request, "hangar/partials/sandbox_tabs.html", context, tc)
    last = sandbox.events.order_by("-id").values_list("id", flat=True).first()
    context.update(section="sandboxes", last_event_id=last or 0)
    return render_page(request, "hangar/sandbox_detail.html", context, tc)


def _after_action(request: HttpRequest, tc: TeamContext, sandbox_id: str) -> HttpResponse:
    if is_fragment(request):
        sandbox = _sandbox_or_404(tc, sandbox_id)
        ctx = {"sandbox": sandbox, "readonly": not tc.can_change, "show_messages": True}
        return render_page(request, "hangar/partials/sandbox_header.html", ctx, tc)
    return redirect("sandbox", sandbox_id)


def _sandbox_action(
    request: HttpRequest, sandbox_id: str, act: Callable[[Sandbox, str], Any], doing: str
) -> HttpResponse:
    """A header button: the team's member asks, the service acts, the header is redrawn."""
    tc = team_context(request)
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
    tc = team_context(request)
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
        tc = team_context(request)
        return tc, _sandbox_or_404(tc, sandbox_id)

    return await sync_to_async(load)()


async def _tab_response(
    request: HttpRequest, tc: TeamContext, sandbox: Sandbox, tab: str, push: str, **extra: Any
) -> HttpResponse:
    if not is_fragment(request):
        return redirect(push)

    def build() -> HttpResponse:
        context = tab_context(request, tc, sandbox, tab, **extra)
        return render_page(request, "hangar/partials/sandbox_tabs.html", context, tc)

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
    user = cast(User, await request.auser())  # @login_required: never the anonymous user
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
    user = cast(User, await request.auser())  # @login_required: never the anonymous user
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


@login_required
async def file_download(request: HttpRequest, sandbox_id: str) -> HttpResponseBase:
    """A file from inside the sandbox, streamed as an attachment."""
    tc, sandbox = await _async_sandbox(request, sandbox_id)
    path = request.GET.get("path", "")
    try:
        entry, chunks = await sync_to_async(file_op, thread_sensitive=False)(
            f"reading {path}",
            lambda: io_svc.sandbox_file_read(sandbox=sandbox, path=path, no_pseudo_fs=tc.no_pseudo_fs),
        )
        name = entry.name or posixpath.basename(path) or "file"
        return await download_response(
            chunks, size=entry.size, disposition=f"attachment; filename*=UTF-8''{quote(name)}",
            what=f"{path} from sandbox {sandbox.id}",
        )  # fmt: skip
    except (FileOpFailed, ServiceError) as exc:
        await sync_to_async(messages.error)(request, f"Could not download {path}: {exc.message}")
        return redirect(_files_url(sandbox.id, posixpath.dirname(path) or "/"))


@login_required
@require_POST
def file_upload(request: HttpRequest, sandbox_id: str) -> HttpResponse:
    """Write an uploaded file into the directory being browsed."""
    tc = team_context(request)
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
            size = file_op(
                f"writing {target}",
                lambda: io_svc.sandbox_file_write(
                    sandbox=sandbox, path=target, data=upload.chunks(), size=upload.size
                ),
            )
        except FileOpFailed as exc:
            messages.error(request, f"Could not upload {name}: {exc.message}")
        else:
            messages.success(request, f"Uploaded {target} ({size} bytes).")
    push = _files_url(sandbox.id, directory)
    if not is_fragment(request):
        return redirect(push)
    query = request.GET.copy()
    query["path"] = directory
    request.GET = query  # type: ignore[assignment]  # django-stubs: GET is read-only; Django lets a view swap it
    response = render_page(
        request, "hangar/partials/sandbox_tabs.html", tab_context(request, tc, sandbox, "files"), tc
    )
    response["HX-Push-Url"] = push
    return response
