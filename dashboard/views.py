"""Pages. The full dashboard (sandboxes, terminals) grows here; for now the overview."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from runtime.models import Image, Membership, Sandbox
from runtime.services.nodes import nodes_with_usage


@login_required
def overview(request: HttpRequest) -> HttpResponse:
    """Nodes, images and the user's teams' sandbox counts; the node table refreshes itself."""
    teams = [m.team for m in Membership.objects.filter(user=request.user).select_related("team")]
    counts = {
        status: Sandbox.objects.filter(team__in=teams, status=status).count()
        for status in (
            Sandbox.Status.RUNNING,
            Sandbox.Status.PENDING,
            Sandbox.Status.STARTING,
            Sandbox.Status.FAILED,
        )
    }
    context = {
        "nodes": list(nodes_with_usage()),
        "images": Image.objects.prefetch_related("nodes").order_by("name"),
        "teams": teams,
        "counts": counts,
    }
    template = "hangar/partials/nodes.html" if request.headers.get("HX-Request") else "hangar/overview.html"
    return render(request, template, context)
