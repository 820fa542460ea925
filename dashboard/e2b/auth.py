"""Who may call which endpoint of the E2B API: a Hangar API token in ``X-API-KEY`` (where the
SDK puts its key), then the same rules as Hangar's own API (the token's scopes, the lower of
its role and its user's role in the team)."""

from __future__ import annotations

import asyncio
from typing import Any

from django.http import HttpRequest
from ninja.security import APIKeyHeader

from runtime.aio import blocking
from runtime.services import audit
from runtime.services.auth import token_authenticate

from ..api.permissions import Rule, check

PREFIX = "e2b"
SB = "/sandboxes/{sandbox_id}"
_READ = Rule("sandboxes:read", "viewer")
_WRITE = Rule("sandboxes:write", "member")
# As Hangar's own sandbox endpoints: reading is a viewer's, changing a member's.
RULES: dict[tuple[str, str], Rule] = {
    ("POST", "/sandboxes"): _WRITE,
    ("POST", "/v2/sandboxes"): _WRITE,
    ("GET", "/sandboxes"): _READ,
    ("GET", "/v2/sandboxes"): _READ,
    ("GET", SB): _READ,
    ("DELETE", SB): _WRITE,
    ("POST", f"{SB}/timeout"): _WRITE,
    ("POST", f"{SB}/pause"): _WRITE,
    ("POST", f"{SB}/resume"): _WRITE,
    ("POST", f"{SB}/connect"): _WRITE,
    ("POST", f"/v2{SB}/connect"): _WRITE,
    ("GET", f"{SB}/metrics"): _READ,
}


class ApiKeyAuth(APIKeyHeader):
    """``X-API-KEY: hgr_…``: ``request.auth`` becomes the ApiToken, as with Hangar's bearer
    tokens (:class:`dashboard.api.auth.TokenAuth`), checked on the same blocking pool."""

    param_name = "X-API-KEY"

    def __init__(self) -> None:
        super().__init__()
        self.is_async = True  # ninja awaits what __call__ returns (set after ninja's own __init__)

    def __call__(self, request: HttpRequest) -> Any:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # a sync caller, already on a thread of its own
            return super().__call__(request)
        return blocking(super().__call__)(request)

    def authenticate(self, request: HttpRequest, key: str | None) -> Any:
        found = token_authenticate(key) if key else None
        if found is not None:
            actor = audit.for_token(found, ip=request.META.get("REMOTE_ADDR", ""))
            request.audit_actor, request.audit_token = actor, found  # type: ignore[attr-defined]
            audit.set_actor(actor)
            check(request, found, rules=RULES, prefix=PREFIX)
        return found
