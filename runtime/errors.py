"""Errors services raise for a caller's mistake; the API maps each to its HTTP status."""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    status_code = 400

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra


class BadRequest(ServiceError):
    status_code = 400


class InvalidValue(ServiceError):
    status_code = 422


class Forbidden(ServiceError):
    status_code = 403


class NotFound(ServiceError):
    status_code = 404


class Conflict(ServiceError):
    status_code = 409


class QuotaExceeded(ServiceError):
    """Over a team quota or budget: the body names the quota, the current use and the limit."""

    status_code = 429


class TooLarge(ServiceError):
    status_code = 413


class TooManyRequests(ServiceError):
    """Too many calls of a kind in flight: try again after ``retry_after`` seconds."""

    status_code = 429

    def __init__(self, message: str, *, retry_after: int, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.retry_after = retry_after


class NoCapacity(ServiceError):
    status_code = 503


class NodeUnavailable(ServiceError):
    status_code = 502
