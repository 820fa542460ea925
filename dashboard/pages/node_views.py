"""The Nodes page: every node's state, runtimes and capabilities, capacity against what its
sandboxes take, labels, last heartbeat and version; for site staff, cordon, uncordon and
drain buttons and a form that creates a join token (shown once). Everyone else sees names and
states, as the API shows them (``GET /api/v1/nodes``)."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, HttpResponseForbidden
from django.views.decorators.http import require_POST

from runtime.errors import ServiceError
from runtime.services import fleet

from .views import is_fragment, render_page, team_context

BARS = (("cpu", "CPU", ""), ("memory_mb", "memory", " MB"), ("disk_mb", "disk", " MB"), ("gpus", "GPUs", ""))


def _with_bars(node: dict[str, Any]) -> dict[str, Any]:
    bars = []
    for key, label, unit in BARS:
        cap, used = node["capacity"].get(key), node["allocated"].get(key) or 0
        if not cap:
            continue
        pct = min(100, round(100 * used / cap)) if cap else 0
        bars.append({"label": label, "used": used, "capacity": cap, "unit": unit, "pct": pct})
    return {**node, "bars": bars}


def _context(request: HttpRequest) -> dict[str, Any]:
    staff = request.user.is_staff
    listed = fleet.nodes_listed()
    nodes = (
        [_with_bars(n) for n in listed]
        if staff
        else [{"name": n["name"], "state": n["state"]} for n in listed]
    )
    return {"section": "nodes", "nodes": nodes, "staff": staff}


@login_required
def nodes(request: HttpRequest) -> HttpResponse:
    tc = team_context(request)
    if is_fragment(request):
        return render_page(request, "hangar/partials/node_list.html", _context(request), tc)
    context = _context(request)
    if request.user.is_staff:
        context["join_tokens"] = fleet.join_tokens()[:20]
    return render_page(request, "hangar/nodes.html", context, tc)


ACTIONS = {"cordon": fleet.node_cordon, "uncordon": fleet.node_uncordon, "drain": fleet.node_drain}


@login_required
@require_POST
def node_action(request: HttpRequest, name: str, action: str) -> HttpResponse:
    """Cordon, uncordon or drain (staff): answers the refreshed node list (htmx)."""
    tc = team_context(request)
    if not request.user.is_staff:
        return HttpResponseForbidden("Only site administrators manage nodes.")
    if action not in ACTIONS:
        return HttpResponse(f"no such action {action!r}", status=404)
    error, status = "", 200
    try:
        ACTIONS[action](name=name)
    except ServiceError as exc:
        error, status = exc.message, exc.status_code
    return render_page(
        request, "hangar/partials/node_list.html", {**_context(request), "error": error}, tc, status
    )


@login_required
@require_POST
def join_token_create(request: HttpRequest) -> HttpResponse:
    """A join token (staff), shown this once."""
    tc = team_context(request)
    if not request.user.is_staff:
        return HttpResponseForbidden("Only site administrators create join tokens.")
    error, issued, status = "", None, 200
    try:
        uses = int(request.POST.get("uses") or 1)
        expires = int(request.POST["expires_in"]) if request.POST.get("expires_in") else None
        issued = fleet.join_token_create(user=request.user, expires_in_s=expires, uses=uses)
    except ValueError:
        error, status = "uses and expires in must be whole numbers", 422
    except ServiceError as exc:
        error, status = exc.message, exc.status_code
    context = {"issued": issued, "error": error, "url": request.build_absolute_uri("/").rstrip("/")}
    return render_page(request, "hangar/partials/join_token.html", context, tc, status)
