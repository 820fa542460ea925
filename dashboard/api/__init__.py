"""The REST API at /api/v1: routers assembled in one place."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, ValidationError

from runtime.errors import ServiceError

from .auth import TokenAuth

api = NinjaAPI(
    title="Hangar API",
    version="1",
    description="Sandboxes and harnesses for AI agents. Authenticate with `Authorization: Bearer <token>`.",
    auth=TokenAuth(),
    urls_namespace="api-v1",
)


@api.exception_handler(ServiceError)
def service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    return api.create_response(request, {"detail": exc.message, **exc.extra}, status=exc.status_code)


@api.exception_handler(AuthenticationError)
def auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return api.create_response(
        request,
        {"detail": "missing, invalid, expired or revoked API token: send Authorization: Bearer <token>"},
        status=401,
    )


@api.exception_handler(ValidationError)
def validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    messages = []
    for err in exc.errors:
        loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body", "payload", "query"))
        messages.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else err.get("msg", "invalid"))
    return api.create_response(request, {"detail": "; ".join(messages), "errors": exc.errors}, status=422)


from .images import router as images_router  # noqa: E402
from .pools import router as pools_router  # noqa: E402
from .processes import router as processes_router  # noqa: E402
from .sandboxes import router as sandboxes_router  # noqa: E402
from .system import router as system_router  # noqa: E402
from .teams import router as teams_router  # noqa: E402
from .tokens import router as tokens_router  # noqa: E402
from .volumes import router as volumes_router  # noqa: E402

api.add_router("/sandboxes", sandboxes_router)
api.add_router("/sandboxes", processes_router)
api.add_router("/images", images_router)
api.add_router("/volumes", volumes_router)
api.add_router("/pools", pools_router)
api.add_router("/tokens", tokens_router)
api.add_router("/teams", teams_router)
api.add_router("", system_router)
