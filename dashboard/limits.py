"""How large an API request's body may be, checked before Django reads it.

A request that controls something (JSON) is at most ``HANGAR_JSON_MAX_BYTES`` (1 MiB); the
endpoints that carry data have their own limit: a file upload ``HANGAR_FILE_MAX_BYTES``, a
command's input (``…/stdin``, and ``…/exec`` with its ``stdin``) twice
``HANGAR_STDIN_PENDING_BYTES`` (room for base64). A body whose ``Content-Length`` is over its
limit is answered 413 at once, unread; one sent without a length (chunked) is answered 413 as
soon as it grows past it, and nothing more of it is read. Django reads the body only after
this check, whole: the limit is what bounds its memory. (Daphne's Twisted layer takes in a whole
request, into a temporary file, before it calls the app: a check of a request's head there
would spare that too; :func:`body_limit` is what it would ask.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest

Scope = dict[str, Any]
Message = Mapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

SCOPE_KEY = "hangar.body_limit"
_SANDBOX = r"/api/v1/sandboxes/[^/]+"
# (method, path, (limit in bytes, what it is called)) for the endpoints that carry data.
_DATA_ROUTES: list[tuple[str, re.Pattern[str], Callable[[], tuple[int, str]]]] = [
    (
        "PUT",
        re.compile(rf"{_SANDBOX}/files"),
        lambda: (settings.HANGAR_FILE_MAX_BYTES, "HANGAR_FILE_MAX_BYTES"),
    ),
    ("POST", re.compile(rf"{_SANDBOX}/processes/[^/]+/stdin"), lambda: _input_limit()),
    ("POST", re.compile(rf"{_SANDBOX}/exec"), lambda: _input_limit()),
    # E2B's in-sandbox API (dashboard/e2b/envd): its uploads, and input as base64 in JSON.
    (
        "POST",
        re.compile(r"/e2b/envd/files"),
        lambda: (settings.HANGAR_FILE_MAX_BYTES, "HANGAR_FILE_MAX_BYTES"),
    ),
    ("POST", re.compile(r"/e2b/envd/process\.Process/(SendInput|StreamInput)"), lambda: _input_limit()),
    # OTLP export requests (dashboard/otlp.py), as sent; a gzip body is held to it again unpacked.
    (
        "POST",
        re.compile(r"(/api/v1/otlp)?/v1/(traces|logs)"),
        lambda: (settings.HANGAR_OTLP_MAX_BYTES, "HANGAR_OTLP_MAX_BYTES"),
    ),
]


def _input_limit() -> tuple[int, str]:
    return 2 * settings.HANGAR_STDIN_PENDING_BYTES, "twice HANGAR_STDIN_PENDING_BYTES"


def body_limit(method: str, path: str) -> tuple[int, str]:
    """The most bytes a request's body may hold, and the limit's name (for the 413)."""
    for route_method, pattern, limit in _DATA_ROUTES:
        if method == route_method and pattern.fullmatch(path):
            return limit()
    return settings.HANGAR_JSON_MAX_BYTES, "HANGAR_JSON_MAX_BYTES"


class BodyLimit:
    """ASGI middleware for the API: refuses a body over its route's limit (see the module)."""

    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit, name = body_limit(scope["method"], scope["path"])
        scope = {**scope, SCOPE_KEY: limit}
        length = _content_length(scope)
        if length is not None and length > limit:
            await _too_large(send, limit, name)
            return
        received = 0
        answered = False

        async def limited_receive() -> Message:
            nonlocal received, answered
            if answered:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # Django, still reading the body, sees the client leave and answers nothing.
                    answered = True
                    await _too_large(send, limit, name)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            if not answered:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", []):
        if key.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _too_large(send: Send, limit: int, name: str) -> None:
    body = json.dumps({
        "detail": f"the request body is larger than this endpoint's limit of {limit} bytes ({name})",
        "limit": limit,
    }).encode()  # fmt: skip
    await send({
        "type": "http.response.start", "status": 413,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")],
    })  # fmt: skip
    await send({"type": "http.response.body", "body": body})


class ApiRequest(ASGIRequest):
    """A request to the API, whose body :class:`BodyLimit` has held to its route's limit:
    Django's own check (``DATA_UPLOAD_MAX_MEMORY_SIZE``, the control limit) would refuse a
    file upload."""

    def _check_data_too_big(self, length: int) -> None:
        if length > self.scope.get(SCOPE_KEY, settings.DATA_UPLOAD_MAX_MEMORY_SIZE):
            from django.core.exceptions import RequestDataTooBig

            raise RequestDataTooBig("Request body exceeded its limit.")
