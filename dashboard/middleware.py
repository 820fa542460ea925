"""Who is acting, for the audit log (:mod:`runtime.services.audit`), and the caller's trace
context (W3C ``traceparent``, :mod:`runtime.services.spans`).

A signed-in dashboard user acts through their session; an API caller is set by the token
check (:class:`dashboard.api.auth.TokenAuth`). Either way the actor is cleared when the
request ends, so nothing done later on the same thread or task is put down to them."""

from __future__ import annotations

from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest

from runtime.services import audit, spans


def _ip(request: HttpRequest) -> str:
    return request.META.get("REMOTE_ADDR", "") or ""


class AuditActorMiddleware:
    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Any) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if self.is_async:
            return self.__acall__(request)
        user = request.user if settings.SESSION_COOKIE_NAME in request.COOKIES else None
        reset = audit.set_actor(self._actor(request, user))
        parent = spans.set_parent(spans.parse_traceparent(request.headers.get("traceparent")))
        try:
            return self.get_response(request)
        finally:
            spans.reset_parent(parent)
            audit.reset_actor(reset)

    async def __acall__(self, request: HttpRequest) -> Any:
        # API calls carry no session cookie: no session lookup on their path.
        user = await request.auser() if settings.SESSION_COOKIE_NAME in request.COOKIES else None
        reset = audit.set_actor(self._actor(request, user))
        # The caller's span (W3C traceparent): Hangar's spans for this request go under it.
        parent = spans.set_parent(spans.parse_traceparent(request.headers.get("traceparent")))
        try:
            return await self.get_response(request)
        finally:
            spans.reset_parent(parent)
            audit.reset_actor(reset)

    @staticmethod
    def _actor(request: HttpRequest, user: Any) -> audit.Actor | None:
        if user is None or not user.is_authenticated:
            return None
        return audit.for_session(user, request.session.session_key, ip=_ip(request))
