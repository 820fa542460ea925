"""What E2B's API has that Hangar's does not: a clear 4xx that names it, for every path under
/e2b that no endpoint serves (never Django's HTML 404, which the SDK cannot read)."""

from __future__ import annotations

import re

from django.http import HttpRequest, HttpResponse

from .schemas import error

# (path pattern under /e2b/, what it is, what to do instead), first match wins.
_FEATURES: list[tuple[re.Pattern[str], str, str]] = [
    # E2B keeps a snapshot as a template: Sandbox.delete_snapshot(id) is DELETE /templates/{id}.
    (re.compile(r"(v\d+/)?templates(/.*)?"), "templates built by E2B's builder or snapshots (which E2B keeps as templates)",
     "a template is a Hangar image: build or pull one with `hangar image` or POST /api/v1/images"),
    (re.compile(r"(v\d+/)?sandboxes/[^/]+/snapshots"), "snapshots", "pause the sandbox and connect to it later"),
    (re.compile(r"snapshots(/.*)?"), "snapshots", "pause the sandbox and connect to it later"),
    (re.compile(r"(v\d+/)?sandboxes/[^/]+/fork"), "fork", "create another sandbox"),
    (re.compile(r"(v\d+/)?sandboxes/[^/]+/network"), "changing a sandbox's network through the E2B API",
     "use PUT /api/v1/sandboxes/{id}/network"),
    (re.compile(r"(v\d+/)?sandboxes/[^/]+/logs"), "sandbox logs", "use GET /api/v1/sandboxes/{id}/events"),
    (re.compile(r"(v\d+/)?sandboxes/[^/]+/refreshes"), "refreshes", "use set_timeout"),
    (re.compile(r"volumes(/.*)?"), "volumes through the E2B API", "use Hangar's volumes (/api/v1/volumes); "
     "a create's volumeMounts name them"),
    (re.compile(r"secrets(/.*)?"), "secrets through the E2B API", "use Hangar's team secrets (/api/v1/secrets)"),
    (re.compile(r"(teams|api-keys|access-tokens|nodes|admin)(/.*)?"), "E2B's account and cluster endpoints",
     "use Hangar's API (/api/v1) or its pages"),
]  # fmt: skip


async def unsupported(request: HttpRequest, rest: str) -> HttpResponse:
    for pattern, what, instead in _FEATURES:
        if pattern.fullmatch(rest):
            return error(
                400, f"Hangar's E2B API does not support {what} ({request.method} /{rest}): {instead}"
            )
    return error(404, f"Hangar's E2B API has no endpoint {request.method} /{rest}")
