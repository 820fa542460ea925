"""Pages: the overview, the team switcher, images and volumes; and what every page shares: the
signed-in user's current team (:mod:`dashboard.pages.teams`) with their role in it, and rendering a
page or its htmx fragment. The sandbox pages are in :mod:`dashboard.pages.sandbox_views`, the
harness pages in :mod:`dashboard.pages.harness_views`, the team's own in
:mod:`dashboard.pages.team_views`.

Every page works in the signed-in user's current team; what it shows is read through the same
services the API uses, so another team's sandbox is a 404 here too. One view serves a page and
its htmx fragment (``HX-Request`` picks the partial).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.db.models import Count
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseForbidden
from django.shortcuts import redirect, render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_POST

from runtime.errors import InvalidValue, ServiceError
from runtime.models import Image, ImageJob, Membership, Sandbox, Team
from runtime.node.local import local_node_name
from runtime.services import images as image_svc
from runtime.services import volumes as volume_svc
from runtime.services.nodes import nodes_with_usage

from ..api.permissions import sees_pseudo_fs
from .teams import SESSION_KEY, SignedInRequest, user_memberships

S = Sandbox.Status
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

    @property
    def no_pseudo_fs(self) -> bool:
        """Its sandboxes' /proc and /sys are out of reach (see ``sees_pseudo_fs``)."""
        return self.membership is None or not sees_pseudo_fs(self.membership.role)


def team_context(request: HttpRequest) -> TeamContext:
    """The user's memberships and the current one, in one query (the same choice as
    :func:`dashboard.pages.teams.session_team`: the session's team if still a member, else the first)."""
    memberships = user_memberships(user=request.user)
    wanted = request.session.get(SESSION_KEY)
    current = next((m for m in memberships if m.team_id == wanted), memberships[0] if memberships else None)
    return TeamContext(memberships=memberships, membership=current)


def is_fragment(request: HttpRequest) -> bool:
    # A history restore asks for the whole page even though it comes from htmx.
    return bool(request.headers.get("HX-Request")) and not request.headers.get("HX-History-Restore-Request")


def render_page(
    request: HttpRequest, template: str, context: dict[str, Any], tc: TeamContext, status: int = 200
) -> HttpResponse:
    response = render(
        request, template, {**context, "nav": tc, "fragment": is_fragment(request)}, status=status
    )
    response["Vary"] = "HX-Request"
    return response


# -- team switcher ----------------------------------------------------------------------------


@login_required
@require_POST
def team_switch(request: SignedInRequest) -> HttpResponse:
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
    tc = team_context(request)
    if is_fragment(request):
        return render_page(request, "hangar/partials/nodes.html", {"nodes": list(nodes_with_usage())}, tc)
    counts: dict[str, int] = dict.fromkeys((S.RUNNING, S.PENDING, S.STARTING, S.FAILED), 0)
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
    return render_page(request, "hangar/overview.html", context, tc)


# -- images -----------------------------------------------------------------------------------


def images_context() -> dict[str, Any]:
    return {
        "images": Image.objects.prefetch_related("nodes").order_by("name"),
        "jobs": image_svc.image_jobs_recent(limit=15),
    }


@login_required
def images(request: HttpRequest) -> HttpResponse:
    """Images sandboxes start from, the latest builds and pulls (live), and for staff users the
    forms that start new ones."""
    tc = team_context(request)
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
        **images_context(),
    }
    return render_page(request, "hangar/images.html", context, tc, status=status)


@login_required
def image_job(request: HttpRequest, job_id: int) -> HttpResponse:
    """One build or pull: its status and its progress log as it comes."""
    tc = team_context(request)
    try:
        job = image_svc.image_job_get(job_id=job_id)
    except ServiceError as exc:
        raise Http404(exc.message) from None
    return render_page(request, "hangar/image_job.html", {"section": "images", "job": job}, tc)


# -- volumes ----------------------------------------------------------------------------------


@login_required
def volumes(request: HttpRequest) -> HttpResponse:
    """The team's volumes: size, space in use, node, the sandboxes holding each; members create
    and delete them here (deleting one that is held is refused, naming the holders)."""
    tc = team_context(request)
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
    return render_page(request, "hangar/volumes.html", context, tc, status=status)
