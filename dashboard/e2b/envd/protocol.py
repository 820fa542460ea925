"""The Connect protocol as the E2B SDK speaks it to envd (JSON encoding over HTTP/1.1), and who
may call it: a sandbox's envd access token, re-checked at every call.

Connect (https://connectrpc.com/docs/protocol): a unary call is ``POST /<service>/<Method>``
with a JSON body, answered with a JSON body (``application/json``), or with an error's HTTP
status and ``{"code": "not_found", "message": "…"}``. A streamed call is
``application/connect+json``: each message is an envelope (a flags byte, a 4-byte big-endian
length, the JSON), and the server's last envelope has flag 0x02 and ``{}`` or
``{"error": {"code", "message"}}``. Proto JSON names fields in lowerCamelCase, carries
``bytes`` as base64, 64-bit integers as strings and enums by name (or number).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.http.response import HttpResponseBase

from runtime.aio import blocking
from runtime.errors import ServiceError
from runtime.models import ApiToken, Sandbox
from runtime.services import audit
from runtime.services.access_query import token_and_sandbox
from runtime.services.auth import sandbox_reached, token_current

from ..tokens import envd_access_token_owner, may_use_envd

log = logging.getLogger(__name__)

END_STREAM = 0x02
STREAM_CONTENT = "application/connect+json"
# Connect's codes and the HTTP status a unary error is answered with.
HTTP_STATUS = {
    "canceled": 499, "unknown": 500, "invalid_argument": 400, "deadline_exceeded": 504,
    "not_found": 404, "already_exists": 409, "permission_denied": 403, "resource_exhausted": 429,
    "failed_precondition": 400, "aborted": 409, "out_of_range": 400, "unimplemented": 501,
    "internal": 500, "unavailable": 503, "data_loss": 500, "unauthenticated": 401,
}  # fmt: skip
# Hangar's service errors, by HTTP status, as Connect codes the SDK turns into its exceptions.
_SERVICE_CODES = {
    400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
    409: "failed_precondition", 413: "resource_exhausted", 422: "invalid_argument", 429: "resource_exhausted",
    502: "unavailable", 503: "unavailable",
}  # fmt: skip


class RpcError(Exception):
    """A Connect error: ``code`` is one of :data:`HTTP_STATUS`."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def rpc_error(exc: BaseException) -> RpcError:
    if isinstance(exc, RpcError):
        return exc
    if isinstance(exc, ServiceError):
        return RpcError(_SERVICE_CODES.get(exc.status_code, "unknown"), exc.message)
    log.error("an envd call failed", exc_info=exc)
    return RpcError("internal", "the call failed on the server; its log has the details")


def error_response(exc: RpcError) -> JsonResponse:
    return JsonResponse({"code": exc.code, "message": exc.message}, status=HTTP_STATUS[exc.code])


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def end_envelope(exc: RpcError | None = None) -> bytes:
    return envelope({} if exc is None else {"error": {"code": exc.code, "message": exc.message}}, END_STREAM)


def unwrap(body: bytes) -> list[dict[str, Any]]:
    """The messages of a streamed request's body (its envelopes, in order)."""
    messages, at = [], 0
    while at < len(body):
        if len(body) - at < 5:
            raise RpcError("invalid_argument", "a truncated envelope")
        flags, size = struct.unpack(">BI", body[at : at + 5])
        if flags & 0x01:
            raise RpcError("invalid_argument", "compressed messages are not accepted")
        data = body[at + 5 : at + 5 + size]
        if len(data) < size:
            raise RpcError("invalid_argument", "a truncated envelope")
        at += 5 + size
        if not flags & END_STREAM:
            messages.append(_json(data))
    return messages


def _json(data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data or b"{}")
    except ValueError:
        raise RpcError("invalid_argument", "the message is not JSON") from None
    if not isinstance(value, dict):
        raise RpcError("invalid_argument", "the message is not a JSON object")
    return value


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise RpcError("invalid_argument", f"{what} must be base64 text")
    try:
        text = value.replace("-", "+").replace("_", "/")  # proto JSON takes either alphabet
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise RpcError("invalid_argument", f"{what} is not valid base64") from None


# -- who calls ---------------------------------------------------------------------------------


@dataclass
class Caller:
    """An authorised envd call: the sandbox, the API token its access token is bound to, and
    the user the SDK asked to act as (``Authorization: Basic <user:>``, "" when none)."""

    sandbox: Sandbox
    token: ApiToken
    user: str


def _header(request: HttpRequest, name: str) -> str:
    return request.headers.get(name, "").strip()


def _basic_user(request: HttpRequest) -> str:
    kind, _, value = _header(request, "Authorization").partition(" ")
    if kind.lower() != "basic" or not value:
        return ""
    try:
        return base64.b64decode(value).decode().partition(":")[0]
    except (binascii.Error, ValueError):
        raise RpcError("invalid_argument", "Authorization is not Basic <base64 of user:>") from None


def authorise(request: HttpRequest) -> Caller:
    """The call's sandbox and token, checked now (blocking: run it on the pool). The envd
    access token opens only its sandbox, and only while the API token it is bound to is live,
    of the sandbox's team, and may run commands there."""
    sandbox_id = _header(request, "E2b-Sandbox-Id")
    access = _header(request, "X-Access-Token")
    refused = RpcError("unauthenticated", "missing or invalid X-Access-Token: send the envdAccessToken "
                       "of this sandbox that create or connect answered")  # fmt: skip
    token_id = envd_access_token_owner(sandbox_id, access) if sandbox_id and access else None
    if token_id is None:
        raise refused
    # The token, its user's role in its team and the sandbox it reaches: one query on every call.
    token, sandbox = token_and_sandbox(token_id=token_id, sandbox_id=sandbox_id)
    if token is None:
        raise RpcError("unauthenticated", "the API token this access token was made for was revoked or "
                       "expired, or its user left the team")  # fmt: skip
    if not may_use_envd(token):
        raise RpcError(
            "permission_denied", "the API token this access token was made for may not run commands"
        )
    if sandbox is None:
        raise refused
    actor = audit.for_token(token, ip=request.META.get("REMOTE_ADDR", ""))
    request.audit_actor, request.audit_token = actor, token  # type: ignore[attr-defined]
    audit.set_actor(actor)
    return Caller(sandbox=sandbox, token=token, user=_basic_user(request))


def still_authorised(caller: Caller) -> str:
    """Why the call's access has ended since it began, or "" while it goes on."""
    token = token_current(token_id=caller.token.id)
    if token is None:
        return "the API token was revoked or expired, or its user left the team"
    if token.team_id != caller.sandbox.team_id or not may_use_envd(token):
        return "the API token may no longer run commands in this sandbox"
    if not sandbox_reached(caller=token, sandbox_id=caller.sandbox.id):
        return "the API token no longer reaches this sandbox"
    return ""


def require_running(caller: Caller) -> None:
    sandbox = caller.sandbox
    if sandbox.status != Sandbox.Status.RUNNING:
        # "was not found" is what the SDK reads as a sandbox that is not running.
        raise RpcError("unavailable", f"sandbox {sandbox.id} was not found running (it is {sandbox.status})")


# -- answering ----------------------------------------------------------------------------------

Unary = Callable[[Caller, dict[str, Any]], Awaitable[dict[str, Any]]]
Stream = Callable[[Caller, dict[str, Any], HttpRequest], AsyncIterator[dict[str, Any]]]


async def unary_response(request: HttpRequest, handler: Unary) -> HttpResponse:
    try:
        caller = await blocking(authorise)(request)
        return JsonResponse(await handler(caller, _json(request.body)))
    except Exception as exc:
        return error_response(rpc_error(exc))


async def client_stream_response(request: HttpRequest, handler: Unary) -> HttpResponse:
    """A client stream, answered as a stream of one message (Connect's form for it); the
    handler gets the request's messages as ``{"messages": [...]}``."""
    try:
        caller = await blocking(authorise)(request)
        return _stream_of([await handler(caller, {"messages": unwrap(request.body)})], None)
    except Exception as exc:
        return _stream_of([], rpc_error(exc))


async def stream_response(request: HttpRequest, handler: Stream) -> HttpResponseBase:
    """A server stream: the handler's first message is awaited before the headers go out, so
    that a call refused at once is answered at once; an error later ends the stream with it."""
    try:
        caller = await blocking(authorise)(request)
        messages = unwrap(request.body)
        if len(messages) != 1:
            raise RpcError("invalid_argument", "a server-streaming call takes exactly one message")
        events = handler(caller, messages[0], request).__aiter__()
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except Exception as exc:
        return _stream_of([], rpc_error(exc))

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield envelope(first)
                async for event in events:
                    yield envelope(event)
        except Exception as exc:
            yield end_envelope(rpc_error(exc))
            return
        finally:
            await events.aclose()  # type: ignore[attr-defined]
        yield end_envelope()

    response = StreamingHttpResponse(body(), content_type=STREAM_CONTENT)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


def _stream_of(messages: list[dict[str, Any]], exc: RpcError | None) -> HttpResponse:
    body = b"".join(envelope(m) for m in messages) + end_envelope(exc)
    return HttpResponse(body, content_type=STREAM_CONTENT)
