"""The REST API at /api/v1: routers assembled in one place."""

from __future__ import annotations

import asyncio
import logging
import threading

from django.db import DataError, close_old_connections
from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from runtime.errors import ServiceError

from .auth import TokenAuth
from .schemas import ApiParser, BodyError, document_errors, explain

log = logging.getLogger(__name__)
api = NinjaAPI(
    title="Hangar API",
    version="1",
    description="Sandboxes and harnesses for AI agents. Authenticate with `Authorization: Bearer <token>`.",
    auth=TokenAuth(),
    urls_namespace="api-v1",
    parser=ApiParser(),
)


@api.exception_handler(ServiceError)
def service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    _audit_refusal(request, exc.status_code, exc.message)
    response = api.create_response(request, {"detail": exc.message, **exc.extra}, status=exc.status_code)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return response


def _audit_refusal(request: HttpRequest, status: int, message: str) -> None:
    """A refused attempt to change something, by a caller we know, goes in the audit log."""
    actor = getattr(request, "audit_actor", None)
    if actor is None or request.method in ("GET", "HEAD", "OPTIONS"):
        return
    from runtime.services import audit

    from .permissions import route_key

    key = route_key(request)
    token = getattr(request, "audit_token", None)

    def write() -> None:
        try:
            audit.record("api.refused", team=token.team if token is not None else None, actor=actor,
                         target=f"{request.method} {request.path}", outcome="refused", message=message,
                         status=status, route=f"{key[0]} {key[1]}" if key else "")  # fmt: skip
        except Exception:  # the answer to the caller matters more than this record
            log.exception("could not record a refused request in the audit log")
        finally:
            close_old_connections()

    try:
        asyncio.get_running_loop()
    except RuntimeError:  # a sync view: write here
        write()
        return
    # An async view's handler runs on the event loop, where the ORM may not, and which must not
    # wait on the database: the insert goes on a thread of its own.
    threading.Thread(target=write, name="audit-refusal", daemon=True).start()


@api.exception_handler(AuthenticationError)
def auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return api.create_response(
        request,
        {"detail": "missing, invalid, expired or revoked API token: send Authorization: Bearer <token>"},
        status=401,
    )


@api.exception_handler(HttpError)
def http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    # ninja says "Cannot parse request body" whatever was wrong with it; the parser knows what.
    cause = exc.__cause__
    detail = cause.args[0] if isinstance(cause, BodyError) else str(exc)
    return api.create_response(request, {"detail": detail}, status=exc.status_code)


@api.exception_handler(ValidationError)
def validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    return api.create_response(request, {"detail": explain(exc.errors), "errors": exc.errors}, status=422)


@api.exception_handler(DataError)
def data_error(request: HttpRequest, exc: DataError) -> HttpResponse:
    """A value the database cannot hold or compare: a NUL byte in text, a number past 64 bits.
    The request's, so a 422, whatever field it came in."""
    reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return api.create_response(
        request, {"detail": f"a value in this request cannot be used: {reason}"}, status=422
    )


from .audit import router as audit_router  # noqa: E402
from .harnesses import keys_router as ssh_keys_router  # noqa: E402
from .harnesses import router as harnesses_router  # noqa: E402
from .harnesses import runs_router  # noqa: E402
from .images import router as images_router  # noqa: E402
from .nodes import router as nodes_router  # noqa: E402
from .pools import router as pools_router  # noqa: E402
from .processes import router as processes_router  # noqa: E402
from .sandboxes import router as sandboxes_router  # noqa: E402
from .secrets import router as secrets_router  # noqa: E402
from .site import router as site_router  # noqa: E402
from .system import router as system_router  # noqa: E402
from .teams import router as teams_router  # noqa: E402
from .tokens import router as tokens_router  # noqa: E402
from .traces import router as traces_router  # noqa: E402
from .volumes import router as volumes_router  # noqa: E402

api.add_router("/sandboxes", sandboxes_router)
api.add_router("/sandboxes", processes_router)
api.add_router("/images", images_router)
api.add_router("/volumes", volumes_router)
api.add_router("/pools", pools_router)
api.add_router("/tokens", tokens_router)
api.add_router("/teams", teams_router)
api.add_router("/secrets", secrets_router)
api.add_router("/audit", audit_router)
api.add_router("/site", site_router)
api.add_router("/harnesses", harnesses_router)
api.add_router("/runs", runs_router)
api.add_router("/ssh-keys", ssh_keys_router)
api.add_router("/traces", traces_router)
api.add_router("/nodes", nodes_router)
api.add_router("", system_router)
document_errors(api)
