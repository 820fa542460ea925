"""What a request gets when a service underneath is away (Postgres restarting, Redis out of
reach): a 503 that says which and when to try again, not a bare 500. Django's ``handler500``
(dashboard.urls), so it covers whatever raised it: a view, a middleware, the token check."""

from __future__ import annotations

import sys

from django.db import InterfaceError, OperationalError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.defaults import server_error as django_server_error
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRY_AFTER_S = 5
_JSON_PATHS = ("/api/", "/e2b/", "/v1/")


def _away(exc: BaseException | None) -> str | None:
    """The service ``exc`` says is away, or None when it is another error."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return "the database"
    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return "Redis"
    return None


def server_error(request: HttpRequest) -> HttpResponse:
    service = _away(sys.exc_info()[1])
    if service is None:
        if request.path.startswith(_JSON_PATHS):
            return JsonResponse({"detail": "internal error: the server's log has the details"}, status=500)
        return django_server_error(request)
    detail = f"{service} is unreachable right now (restarting?): try again in a few seconds"
    if request.path.startswith(_JSON_PATHS):
        response: HttpResponse = JsonResponse({"detail": detail}, status=503)
    else:
        response = HttpResponse(f"<h1>Service unavailable</h1><p>{detail}.</p>", status=503)
    response["Retry-After"] = str(RETRY_AFTER_S)
    return response
