"""OTLP/HTTP ingest: ``POST /v1/traces`` and ``/v1/logs`` at the server's root (so an
OpenTelemetry SDK whose ``OTEL_EXPORTER_OTLP_ENDPOINT`` is Hangar's base URL finds them), and
the same under ``/api/v1/otlp``.

Answers as the OTLP specification says: 200 with the export response (a partial success counts
what was rejected, and why), 400 for a body that does not parse (SDKs do not retry it), 401 for a
missing or unknown token, 403 for one without ``traces:write`` (or below member), 415 for another
content type or encoding, 413 over ``HANGAR_OTLP_MAX_BYTES`` (before or after gzip), 429 with
``Retry-After`` while this server process already stores ``HANGAR_OTLP_CONCURRENCY`` requests.
Parsing and storing run on the blocking pool, never on the event loop."""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from runtime.aio import blocking
from runtime.models import ApiToken
from runtime.services import otlp as otlp_svc
from runtime.services import traces as trace_svc
from runtime.services.auth import role_at_least, token_allows, token_authenticate

_SLOTS: asyncio.Semaphore | None = None


def _slots() -> asyncio.Semaphore:
    global _SLOTS
    if _SLOTS is None:
        _SLOTS = asyncio.Semaphore(int(settings.HANGAR_OTLP_CONCURRENCY))
    return _SLOTS


def _error(status: int, message: str, **headers: str) -> HttpResponse:
    # google.rpc.Status's JSON shape, which OTLP names for error bodies.
    response = HttpResponse(json.dumps({"code": status, "message": message}), status=status,
                            content_type="application/json")  # fmt: skip
    for name, value in headers.items():
        response[name.replace("_", "-")] = value
    return response


def _authenticate(request: HttpRequest) -> ApiToken | HttpResponse:
    scheme, _, raw = request.headers.get("Authorization", "").partition(" ")
    token = token_authenticate(raw.strip()) if scheme.lower() == "bearer" and raw.strip() else None
    if token is None:
        return _error(401, "a Hangar API token is required: Authorization: Bearer hgr_… "
                      "(OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer%20hgr_…)")  # fmt: skip
    if not token_allows(token, "traces:write"):
        return _error(403, "this token's scopes do not include traces:write")
    if not role_at_least(token.effective_role, "member"):
        return _error(403, f"writing traces needs the member role; this token acts as {token.effective_role}")
    return token


def _unpacked(request: HttpRequest) -> bytes | HttpResponse:
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    body = request.body
    if encoding in ("", "identity"):
        return body
    if encoding != "gzip":
        return _error(415, f"Content-Encoding {encoding!r} is not supported: send gzip or none")
    limit = int(settings.HANGAR_OTLP_MAX_BYTES)
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        return _error(400, f"the body is not valid gzip: {exc}")
    if len(out) > limit:
        return _error(413, f"the body unpacks to more than HANGAR_OTLP_MAX_BYTES ({limit} bytes)")
    return out


def _store(kind: str, token: ApiToken, body: bytes, content_type: str) -> tuple[int, str]:
    """Parse and store; (rejected, why). Raises :class:`otlp_svc.BadRequest`."""
    message = otlp_svc.parse(kind, body, content_type)
    if kind == "traces":
        decoded = otlp_svc.span_rows(message)
        trace_svc.spans_store(team=token.team, decoded=decoded)
    else:
        decoded = otlp_svc.log_rows(message)
        trace_svc.logs_store(team=token.team, decoded=decoded)
    return decoded.rejected, "; ".join(decoded.errors[:5])


async def _ingest(request: HttpRequest, kind: str) -> HttpResponse:
    if request.method != "POST":
        response = _error(405, "OTLP export requests are POST")
        response["Allow"] = "POST"
        return response
    found = await blocking(_authenticate)(request)
    if isinstance(found, HttpResponse):
        return found
    content_type = (request.content_type or "").lower()
    if content_type not in (otlp_svc.PROTOBUF, otlp_svc.JSON):
        return _error(415, f"Content-Type {content_type or '(none)'!r} is not OTLP: send "
                      "application/x-protobuf or application/json")  # fmt: skip
    slots = _slots()
    if slots.locked():
        return _error(429, "ingest is saturated on this server: retry shortly", Retry_After="1")
    async with slots:
        try:
            body = _unpacked(request)
            if isinstance(body, HttpResponse):
                return body
            rejected, why = await blocking(_store)(kind, found, body, content_type)
        except otlp_svc.BadRequest as exc:
            return _error(400, str(exc))
        except gzip.BadGzipFile as exc:
            return _error(400, f"the body is not valid gzip: {exc}")
    return HttpResponse(otlp_svc.answer(kind, rejected, why, content_type), content_type=content_type)


async def traces(request: HttpRequest) -> HttpResponse:
    return await _ingest(request, "traces")


async def logs(request: HttpRequest) -> HttpResponse:
    return await _ingest(request, "logs")
