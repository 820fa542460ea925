"""Dashboard pages for harnesses: the list and create form, a harness's page (state, repository,
SSH command, terminals, runs, log), a run's page (live output, diff), and the profile's SSH keys.
They parse, authorise and call the same services as the API."""

from __future__ import annotations

from typing import Any, cast

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.contrib.auth.models import User
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseForbidden
from django.shortcuts import redirect
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from runtime import presets
from runtime.errors import InvalidValue, ServiceError
from runtime.models import Harness, Image, ImageJob, Run, Terminal
from runtime.services import harnesses as svc
from runtime.services import images as image_svc
from runtime.services import nodes as node_svc
from runtime.services import processes as proc_svc
from runtime.services import runs as run_svc
from runtime.services import secrets as secret_svc
from runtime.services import spans
from runtime.services import ssh_keys as key_svc

from .teams import SignedInRequest
from .views import VIEWER_REFUSAL, TeamContext, is_fragment, render_page, team_context

ACTIVE_STATES = ("creating", "pausing", "resuming")


def _harness_or_404(tc: TeamContext, harness_id: str) -> Harness:
    if tc.team is None:
        raise Http404("not in a team")
    try:
        return svc.harness_get(team=tc.team, harness_id=harness_id)
    except ServiceError as exc:
        raise Http404(exc.message) from None


def _int(value: str | None, what: str, default: int | None = None) -> int | None:
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidValue(f"{what} must be a whole number, got {value!r}") from None


def _float(value: str | None, what: str, default: float) -> float:
    if value in (None, ""):
        return default
    try:
        return float(value)
    except ValueError:
        raise InvalidValue(f"{what} must be a number, got {value!r}") from None


# What harnesses start from unless told otherwise: the agents' CLIs install with npm, which it has.
DEFAULT_IMAGE = "base"


def _create_context(request: HttpRequest, tc: TeamContext, posted: Any = None) -> dict[str, Any]:
    images = list(Image.objects.order_by("name").values_list("name", flat=True))
    secrets = (
        list(secret_svc.secrets_for_team(team=tc.team).values_list("name", flat=True)) if tc.team else []
    )
    # The default image's build, if one is going (anyone may watch it), or the one just started
    # from this form (to show how it ended).
    job = image_svc.image_build_in_progress(kind=DEFAULT_IMAGE)
    if job is None and (wanted := request.GET.get("job", "")).isdigit():
        job = ImageJob.objects.select_related("node", "image", "created_by").filter(id=int(wanted)).first()
    missing = DEFAULT_IMAGE not in images
    building = job is not None and job.status in (ImageJob.Status.QUEUED, ImageJob.Status.RUNNING)
    return {
        "presets": list(presets.PRESETS.values()),
        "images": images,
        # The runtimes the nodes run (a harness's sandbox may be a microVM as well as gVisor).
        "runtimes": list(node_svc.runtimes_offered()) or [settings.HANGAR_DEFAULT_RUNTIME],
        "default_runtime": settings.HANGAR_DEFAULT_RUNTIME,
        "default_image": DEFAULT_IMAGE,
        "default_missing": missing,
        "build_time": image_svc.BUILD_TIMES[DEFAULT_IMAGE],
        "image_job": job,
        "image_job_live": building,
        # Images are every team's: staff build one (again, after a failed try); others ask.
        "offer_build": missing and not building and request.user.is_staff,
        "ask_admin": missing and not building and not request.user.is_staff,
        "team_secrets": secrets,
        "posted": posted or {},
        "posted_secrets": posted.getlist("secrets") if posted is not None else [],
        "default_disk_mb": settings.HANGAR_HARNESS_DISK_MB,
        "default_idle_s": settings.HANGAR_HARNESS_IDLE_TIMEOUT_S,
    }


@login_required
def harnesses(request: SignedInRequest) -> HttpResponse:
    """The team's harnesses; members create one with the form (it opens on its page)."""
    tc = team_context(request)
    error, status = "", 200
    if request.method == "POST":
        if not tc.can_change or tc.team is None:
            return HttpResponseForbidden(VIEWER_REFUSAL)
        p = request.POST
        try:
            egress = p.get("egress", "all")
            network: dict[str, Any] = {"egress": egress}
            if egress == "allowlist":
                network["allow"] = p.get("allow", "").split()
            repo = {
                "url": p.get("repo_url", ""),
                "branch": p.get("repo_branch", ""),
                "secret": p.get("repo_secret", ""),
            }
            h = svc.harness_create(
                team=tc.team, user=request.user, name=p.get("name", ""), agent=p.get("agent", ""),
                command=p.get("command", "") or None, image=p.get("image") or DEFAULT_IMAGE,
                runtime=p.get("runtime") or None,
                cpu=_float(p.get("cpu"), "CPU", 1.0), memory_mb=_int(p.get("memory_mb"), "memory", 2048) or 2048,
                disk_mb=_int(p.get("disk_mb"), "disk"), repo=repo if repo["url"] else None,
                secrets=p.getlist("secrets"),
                idle_timeout_s=_int(p.get("idle_timeout_s"), "idle timeout", settings.HANGAR_HARNESS_IDLE_TIMEOUT_S),
                network=network,
            )  # fmt: skip
        except ServiceError as exc:
            error, status = exc.message, exc.status_code
        else:
            messages.success(request, f"Harness {h.name} is being created.")
            return redirect("harness", h.id)
    rows = []
    if tc.team is not None:
        for h in svc.harnesses_for_team(team=tc.team):
            rows.append({"h": h, "status": svc.harness_status(h), "last": svc.harness_last_activity(h)})
    context = {"section": "harnesses", "rows": rows, "error": error, "open_form": bool(error) or "new" in request.GET,
               **_create_context(request, tc, request.POST if request.method == "POST" else None)}  # fmt: skip
    return render_page(request, "hangar/harnesses.html", context, tc, status=status)


@login_required
@require_POST
def harness_image_build(request: HttpRequest) -> HttpResponse:
    """Staff: build the image harnesses start from, from the create form, which then shows the
    build's progress as it goes."""
    try:
        job = image_svc.image_job_start(kind=ImageJob.Kind.BUILD, ref=DEFAULT_IMAGE, user=request.user)
    except ServiceError as exc:
        if exc.status_code == 403:
            return HttpResponseForbidden(exc.message)
        messages.error(request, exc.message)
        return redirect(f"{reverse('harnesses')}?new=1#new-harness")
    return redirect(f"{reverse('harnesses')}?new=1&job={job.id}#new-harness")


def _detail_context(
    request: SignedInRequest, tc: TeamContext, h: Harness, terminal_id: str | None = None
) -> dict[str, Any]:
    status = svc.harness_status(h)
    terminals: list[Terminal] = []
    selected = None
    if h.sandbox is not None:
        terminals = list(
            proc_svc.terminals_for_sandbox(sandbox=h.sandbox).filter(status=Terminal.Status.RUNNING)
        )
        wanted = terminal_id or request.GET.get("terminal")
        selected = next((t for t in terminals if t.id == wanted), terminals[0] if terminals else None)
    runs = list(run_svc.runs_for_harness(harness=h).defer("diff")[:50])
    log = svc.harness_log_entries(harness=h, limit=300)
    p = presets.preset(h.agent)
    missing_credentials = bool(p.credentials) and not (set(p.credentials) & set(h.secrets))
    return {
        "section": "harnesses", "h": h, "status": status, "preset": p, "ssh_command": svc.ssh_command(h),
        "last_activity": svc.harness_last_activity(h), "terminals": terminals, "terminal": selected,
        "runs": runs, "log": log, "log_last": log[-1].id if log else 0, "live": status == "running",
        "refresh": status in ACTIVE_STATES or any(r.status in Run.ACTIVE for r in runs),
        "can_change": tc.can_change, "readonly": not tc.can_change, "missing_credentials": missing_credentials,
        "has_keys": key_svc.ssh_keys_for_user(user=request.user).exists(),
    }  # fmt: skip


@login_required
@require_GET
def harness_detail(request: SignedInRequest, harness_id: str) -> HttpResponse:
    tc = team_context(request)
    h = _harness_or_404(tc, harness_id)
    context = _detail_context(request, tc, h)
    if is_fragment(request) and request.GET.get("part") == "header":
        response = render_page(request, "hangar/partials/harness_header.html", context, tc)
        if request.GET.get("was", context["status"]) != context["status"]:
            # Its state changed (it runs now, say): the whole page changes with it.
            response["HX-Refresh"] = "true"
        return response
    return render_page(request, "hangar/harness_detail.html", context, tc)


@login_required
@require_GET
def harness_log(request: HttpRequest, harness_id: str) -> HttpResponse:
    """New log entries after ``?after=`` (the page polls this while it is open)."""
    tc = team_context(request)
    h = _harness_or_404(tc, harness_id)
    try:
        after = max(0, int(request.GET.get("after") or 0))
    except ValueError:
        after = 0
    entries = svc.harness_log_entries(harness=h, after=after, limit=500)
    return render_page(request, "hangar/partials/harness_log.html",
                   {"h": h, "log": entries, "log_last": entries[-1].id if entries else after}, tc)  # fmt: skip


def _action(request: HttpRequest, harness_id: str, act: Any, done: str) -> HttpResponse:
    tc = team_context(request)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    h = _harness_or_404(tc, harness_id)
    try:
        act(h)
    except ServiceError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, done.format(name=h.name))
    return redirect("harness", h.id)


@login_required
@require_POST
def harness_pause(request: HttpRequest, harness_id: str) -> HttpResponse:
    return _action(request, harness_id, lambda h: svc.harness_pause(harness=h),
                   "Pausing {name}: its processes stop, /workspace stays.")  # fmt: skip


@login_required
@require_POST
def harness_resume(request: HttpRequest, harness_id: str) -> HttpResponse:
    return _action(request, harness_id, lambda h: svc.harness_resume(harness=h, user=request.user),
                   "Resuming {name}.")  # fmt: skip


@login_required
@require_POST
def harness_delete(request: HttpRequest, harness_id: str) -> HttpResponse:
    tc = team_context(request)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    h = _harness_or_404(tc, harness_id)
    delete_volume = request.POST.get("delete_volume") == "1"
    try:
        svc.harness_delete(harness=h, delete_volume=delete_volume)
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect("harness", h.id)
    kept = "" if delete_volume or not h.volume else f" Its workspace volume {h.volume.name} is kept."
    messages.success(request, f"Harness {h.name} deleted.{kept}")
    return redirect("harnesses")


@login_required
@require_POST
async def harness_terminal(request: HttpRequest, harness_id: str) -> HttpResponse:
    """Open a named terminal in the harness's /workspace."""

    def load() -> tuple[TeamContext, Harness]:
        tc = team_context(request)
        return tc, _harness_or_404(tc, harness_id)

    tc, h = await sync_to_async(load)()
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    url = reverse("harness", args=[h.id])
    if h.sandbox is None or svc.harness_status(h) != "running":
        await sync_to_async(messages.error)(request, "Terminals open in a running harness; resume it first.")
        return redirect(url)
    try:
        rows = min(max(int(request.POST.get("rows", 24)), 1), 1000)
        cols = min(max(int(request.POST.get("cols", 80)), 1), 1000)
    except ValueError:
        rows, cols = 24, 80
    user = cast(User, await request.auser())  # @login_required: never the anonymous user
    try:
        term = await proc_svc.terminal_open(sandbox=h.sandbox, name=request.POST.get("name", "").strip()[:64],
                                            cwd=presets.WORKSPACE, rows=rows, cols=cols, user=user)  # fmt: skip
    except ServiceError as exc:
        await sync_to_async(messages.error)(request, f"Could not open a terminal: {exc.message}")
        return redirect(url)
    return redirect(f"{url}?terminal={term.id}#terminals")


@login_required
@require_POST
def harness_run(request: SignedInRequest, harness_id: str) -> HttpResponse:
    tc = team_context(request)
    if not tc.can_change:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    h = _harness_or_404(tc, harness_id)
    try:
        run = run_svc.run_create(harness=h, user=request.user, prompt=request.POST.get("prompt", ""),
                                 timeout_s=_int(request.POST.get("timeout_s"), "timeout"))  # fmt: skip
    except ServiceError as exc:
        messages.error(request, exc.message)
        return redirect(f"{reverse('harness', args=[h.id])}#runs")
    return redirect("run", run.id)


def _run_or_404(tc: TeamContext, run_id: str) -> Run:
    if tc.team is None:
        raise Http404("not in a team")
    try:
        return run_svc.run_get(team=tc.team, run_id=run_id)
    except ServiceError as exc:
        raise Http404(exc.message) from None


@login_required
@require_GET
def run_detail(request: HttpRequest, run_id: str) -> HttpResponse:
    tc = team_context(request)
    run = _run_or_404(tc, run_id)
    ex = run.exec
    context = {
        "section": "harnesses", "run": run, "h": run.harness, "exec": ex, "active": run.status in Run.ACTIVE,
        "diff_lines": [(ln[:1] if ln[:1] in "+-@" and not ln.startswith(("+++", "---")) else "", ln)
                       for ln in run.diff.splitlines()],
        "can_change": tc.can_change, "run_trace_id": spans.run_trace(run.id).trace_id,
    }  # fmt: skip
    if is_fragment(request) and request.GET.get("part") == "status":
        return render_page(request, "hangar/partials/run_status.html", context, tc)
    return render_page(request, "hangar/run_detail.html", context, tc)


@login_required
@require_POST
async def run_cancel(request: HttpRequest, run_id: str) -> HttpResponse:
    def cancel() -> tuple[TeamContext, Any]:
        tc = team_context(request)
        if not tc.can_change:
            return tc, None
        return tc, run_svc.run_cancel(run=_run_or_404(tc, run_id))

    try:
        tc, result = await sync_to_async(cancel)()
    except ServiceError as exc:
        await sync_to_async(messages.error)(request, exc.message)
        return redirect("run", run_id)
    if result is None:
        return HttpResponseForbidden(VIEWER_REFUSAL)
    _run, process = result
    if process is not None:
        await process.kill()
    await sync_to_async(messages.success)(request, "Run cancelled.")
    return redirect("run", run_id)


# -- profile: SSH keys ---------------------------------------------------------------------------


@login_required
def profile(request: SignedInRequest) -> HttpResponse:
    """The signed-in user's SSH keys (they open the user's teams' harnesses over SSH)."""
    tc = team_context(request)
    error, status = "", 200
    if request.method == "POST":
        try:
            if request.POST.get("action") == "delete":
                key_svc.ssh_key_delete(user=request.user, key_id=request.POST.get("key", ""))
                messages.success(request, "SSH key removed.")
            else:
                key = key_svc.ssh_key_add(user=request.user, name=request.POST.get("name", ""),
                                          public_key=request.POST.get("public_key", ""))  # fmt: skip
                messages.success(request, f"SSH key {key.name} added ({key.fingerprint}).")
        except ServiceError as exc:
            error, status = exc.message, exc.status_code
        else:
            return redirect("profile")
    context = {
        "section": "profile", "keys": list(key_svc.ssh_keys_for_user(user=request.user)), "error": error,
        "posted": request.POST if request.method == "POST" else {}, "ssh_port": settings.HANGAR_SSH_PORT,
        "ssh_host": settings.HANGAR_SSH_HOST,
    }  # fmt: skip
    return render_page(request, "hangar/profile.html", context, tc, status=status)
