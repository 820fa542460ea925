"""Who is on the other end of a websocket: an API token, or a signed-in browser session.

Scripts send ``Authorization: Bearer <token>`` (or ``?token=`` where a client cannot set
headers); the scope then carries ``api_token`` and its team. Browsers bring the session
cookie; since any page on the web could open a websocket to us with that cookie, a
session-authenticated socket is only accepted when its ``Origin`` is this site (the websocket
equivalent of CSRF protection). Token-authenticated sockets need no such check.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlparse

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async

from runtime.services.auth import token_authenticate


def _header(scope: dict[str, Any], name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _raw_token(scope: dict[str, Any]) -> str:
    auth = _header(scope, b"authorization")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return (query.get("token") or [""])[0]


def same_origin(scope: dict[str, Any]) -> bool:
    origin = _header(scope, b"origin")
    host = _header(scope, b"host")
    if not origin or not host:
        return False
    return urlparse(origin).netloc.lower() == host.lower()


class TokenAuthMiddleware:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        scope = dict(scope)
        raw = _raw_token(scope)
        scope["api_token"] = await database_sync_to_async(token_authenticate)(raw) if raw else None
        scope["token_presented"] = bool(raw)
        return await self.inner(scope, receive, send)


def HangarAuthStack(inner: Any) -> Any:  # noqa: N802 (named like Channels' AuthMiddlewareStack)
    return TokenAuthMiddleware(AuthMiddlewareStack(inner))
