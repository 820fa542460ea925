"""The SDK's exceptions, and how an error answer of the API becomes one of them."""

from __future__ import annotations

import json
from typing import Any


class HangarError(Exception):
    """Anything the SDK raises on purpose. ``status_code`` is the HTTP status (None when no
    answer came, e.g. the server could not be reached); ``message`` is the server's ``detail``;
    ``body`` the whole error answer when it was JSON."""

    def __init__(self, message: str, *, status_code: int | None = None, body: dict[str, Any] | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body: dict[str, Any] = body or {}

    def __str__(self) -> str:
        return f"{self.status_code}: {self.message}" if self.status_code is not None else self.message


class AuthError(HangarError):
    """401 (a missing, wrong, expired or revoked token) or 403 (a role or scope it lacks)."""


class NotFoundError(HangarError):
    """404: no such thing, or another team's."""


class ConflictError(HangarError):
    """409: the thing is in the wrong state; ``status`` is the sandbox's status when the server
    says it (e.g. ``paused``, ``stopped``, ``deleted``)."""

    @property
    def status(self) -> str | None:
        value = self.body.get("status")
        return value if isinstance(value, str) else None


class QuotaError(HangarError):
    """429 for a team quota or budget: ``quota`` names it, ``used``, ``requested`` and
    ``limit`` are the amounts (each None when the server leaves it out)."""

    @property
    def quota(self) -> str | None:
        return self.body.get("quota")

    @property
    def used(self) -> float | None:
        return self.body.get("used")

    @property
    def requested(self) -> float | None:
        return self.body.get("requested")

    @property
    def limit(self) -> float | None:
        return self.body.get("limit")


class RateLimitError(HangarError):
    """429 with ``Retry-After``: too many calls of a kind in flight (e.g. blocking execs), still
    refused after the SDK's retries. ``retry_after`` is the server's last word, in seconds."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class ValidationError(HangarError):
    """400 or 422: the request itself is wrong (a bound, an unknown name, a bad value); the
    message says what to change. ``errors`` holds the field errors of a 422 when there are."""

    @property
    def errors(self) -> list[Any]:
        value = self.body.get("errors")
        return value if isinstance(value, list) else []


class TooLargeError(ValidationError):
    """413: a body past the server's limit (``limit`` in bytes when it says)."""

    @property
    def limit(self) -> int | None:
        return self.body.get("limit")


class ServerError(HangarError):
    """5xx: the server or a node failed (502: a node unreachable, 503: no room), after retries
    where the call allowed them."""


class NetworkError(HangarError):
    """The server could not be reached, or the connection broke (after retries where the call
    allowed them)."""


class CommandTimeout(HangarError):
    """A wait for a background process or a run passed its ``timeout``."""


def error_for(status_code: int, content: bytes, retry_after: float | None = None) -> HangarError:
    """The exception for an error answer: ``{"detail": …}`` and whatever else the server put in."""
    body: dict[str, Any] = {}
    try:
        parsed = json.loads(content) if content else {}
        if isinstance(parsed, dict):
            body = parsed
    except ValueError:
        pass
    detail = body.get("detail")
    if isinstance(detail, str):
        message = detail
    elif detail is not None:
        message = json.dumps(detail)
    else:
        message = content[:500].decode("utf-8", "replace") or f"HTTP {status_code}"
    kw: dict[str, Any] = {"status_code": status_code, "body": body}
    if status_code in (401, 403):
        return AuthError(message, **kw)
    if status_code == 404:
        return NotFoundError(message, **kw)
    if status_code == 409:
        return ConflictError(message, **kw)
    if status_code == 413:
        return TooLargeError(message, **kw)
    if status_code in (400, 422):
        return ValidationError(message, **kw)
    if status_code == 429:
        if "quota" in body or retry_after is None:
            return QuotaError(message, **kw)
        return RateLimitError(message, retry_after=retry_after, **kw)
    if status_code >= 500:
        return ServerError(message, **kw)
    return HangarError(message, **kw)
