from __future__ import annotations

import asyncio
from typing import Any

from django.http import HttpRequest
from ninja.security import HttpBearer

from runtime.aio import blocking
from runtime.models import ApiToken
from runtime.services import audit
from runtime.services.auth import token_authenticate

from .permissions import check


class AuthedRequest(HttpRequest):
    """The request an endpoint behind :class:`TokenAuth` is handed (every endpoint but those
    marked ``auth=None``): ninja has set ``auth`` to the caller's live token, its
    ``effective_role`` filled in. Only a type for the endpoints' signatures: what ninja passes
    is Django's own request object."""

    auth: ApiToken


class TokenAuth(HttpBearer):
    """``Authorization: Bearer hgr_…``; ``request.auth`` becomes the ApiToken (user and team).
    Then the endpoint's rule (``permissions.RULES``) decides: a 403 says which role or scope
    it needs."""

    def __init__(self) -> None:
        super().__init__()
        # ninja awaits what this returns for async views (see __call__). Set after ninja's own
        # __init__, which sets it from whether authenticate() is a coroutine function.
        self.is_async = True

    def __call__(self, request: HttpRequest) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a sync view, already on a thread of its own
            return super().__call__(request)
        # On the event loop: the check runs on Hangar's blocking pool, whose threads keep their
        # database connections. ninja's default (sync_to_async) would run it on a thread made
        # for this one request, which opens a new connection every time.
        return blocking(super().__call__)(request)

    def authenticate(self, request: HttpRequest, token: str) -> Any:
        found = token_authenticate(token)
        if found is not None:
            # Who is acting, for the audit log: what this request changes is recorded as theirs.
            actor = audit.for_token(found, ip=request.META.get("REMOTE_ADDR", ""))
            request.audit_actor, request.audit_token = actor, found  # type: ignore[attr-defined]
            audit.set_actor(actor)
            check(request, found)
        return found
