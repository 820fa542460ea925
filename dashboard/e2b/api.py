"""The E2B API at /e2b: its routers, its key check, and errors in E2B's shape, so the SDK
raises its own exceptions for them."""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from ninja import NinjaAPI
from ninja.errors import AuthenticationError, HttpError, ValidationError

from runtime.errors import InvalidValue, ServiceError

from ..api.schemas import ApiParser, BodyError, explain
from .auth import ApiKeyAuth
from .sandboxes import router as sandboxes_router
from .schemas import error


class E2BParser(ApiParser):
    """As Hangar's API parses, but an empty body is an empty object: E2B's spec makes the
    bodies of pause and set timeout optional, and older SDKs send none. Query parameters are
    read as E2B's API reads them (a repeated one: its last), whatever an SDK sends."""

    single_values = False

    def parse_body(self, request: HttpRequest) -> Any:
        if not request.body.strip():
            return {}
        return super().parse_body(request)


api = NinjaAPI(
    title="Hangar's E2B API",
    version="1",
    description="E2B's control-plane REST API for the unmodified `e2b` SDK (docs/e2b.md). "
    "Authenticate with `X-API-KEY: <a Hangar API token>`.",
    auth=ApiKeyAuth(),
    urls_namespace="e2b",
    parser=E2BParser(),
)


@api.exception_handler(ServiceError)
def service_error(request: HttpRequest, exc: ServiceError) -> HttpResponse:
    # E2B answers 400 for a request it cannot take, where Hangar's API says 422.
    response = error(400 if isinstance(exc, InvalidValue) else exc.status_code, exc.message)
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        response["Retry-After"] = str(retry_after)
    return response


@api.exception_handler(AuthenticationError)
def auth_error(request: HttpRequest, exc: AuthenticationError) -> HttpResponse:
    return error(401, "missing, invalid, expired or revoked API key: send a Hangar API token in X-API-KEY")


@api.exception_handler(HttpError)
def http_error(request: HttpRequest, exc: HttpError) -> HttpResponse:
    cause = exc.__cause__
    return error(exc.status_code, cause.args[0] if isinstance(cause, BodyError) else str(exc))


@api.exception_handler(ValidationError)
def validation_error(request: HttpRequest, exc: ValidationError) -> HttpResponse:
    return error(400, explain(exc.errors))


api.add_router("", sandboxes_router)
