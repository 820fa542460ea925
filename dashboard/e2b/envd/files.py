"""envd's plain HTTP routes: ``GET /files`` (a file's bytes), ``POST /files`` (multipart, each
part's filename its whole destination path, or ``application/octet-stream`` to ``?path=``) and
``GET /health``; errors as ``{"code": <status>, "message"}``, which the SDK maps by status."""

from __future__ import annotations

import io
import threading
import zlib
from typing import Any

from django.conf import settings
from django.core.files.uploadhandler import (
    FileUploadHandler,
    MemoryFileUploadHandler,
    TemporaryFileUploadHandler,
)
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParser, MultiPartParserError
from django.http.response import HttpResponseBase

from dashboard.streaming import download_response
from runtime.aio import blocking
from runtime.errors import TooLarge
from runtime.services import sandbox_io as io_svc

from ..schemas import error
from . import users
from .filesystem import resolve
from .protocol import HTTP_STATUS, Caller, RpcError, authorise, require_running, rpc_error

_STATUS = {**HTTP_STATUS, "failed_precondition": 409, "unavailable": 502}


class _PathParser(MultiPartParser):
    """Keeps a part's filename whole: E2B's SDK puts the destination path there."""

    def sanitize_file_name(self, file_name: str) -> str | None:
        name = "".join(c for c in file_name if c.isprintable())
        return name or None


class _Names(FileUploadHandler):
    """Notes each part's whole filename (an uploaded file's own name keeps only its last
    component), passing its bytes on to the handlers that keep them."""

    def __init__(self, request: HttpRequest) -> None:
        super().__init__(request)
        self.names: list[str] = []

    def new_file(self, *args: Any, **kwargs: Any) -> None:
        super().new_file(*args, **kwargs)
        self.names.append(self.file_name or "")

    def receive_data_chunk(self, raw_data: bytes, start: int) -> bytes:
        return raw_data

    def file_complete(self, file_size: int) -> None:
        return None


def _failed(exc: BaseException) -> HttpResponse:
    if isinstance(exc, TooLarge):  # not a limit to wait out, as resource_exhausted's 429 says
        return error(413, exc.message)
    found = rpc_error(exc)
    return error(_STATUS.get(found.code, 500), found.message)


def _call(request: HttpRequest) -> Caller:
    caller = authorise(request)
    require_running(caller)
    if caller.user not in ("", "root") or request.GET.get("username", "root") != "root":
        raise RpcError("invalid_argument", "files are written as root and handed to the image's own user; "
                       "naming another user for /files is not supported")  # fmt: skip
    return caller


async def health(request: HttpRequest) -> HttpResponse:
    """204 while the sandbox runs; 502 (which the SDK's ``is_running`` reads as False) else."""
    try:
        caller = await blocking(authorise)(request)
        require_running(caller)
    except Exception as exc:
        return _failed(exc)
    return HttpResponse(status=204)


async def files(request: HttpRequest) -> HttpResponseBase:
    if request.method == "GET":
        return await _download(request)
    if request.method == "POST":
        return await _upload(request)
    return error(405, "GET or POST /files")


async def _download(request: HttpRequest) -> HttpResponseBase:
    try:
        caller = await blocking(_call)(request)

        def read() -> tuple[str, Any, Any]:
            path = resolve(request.GET.get("path", ""), users.home(caller))
            return (path, *io_svc.sandbox_file_read(sandbox=caller.sandbox, path=path))

        path, entry, chunks = await blocking(read)()
        if entry.type == "dir":
            raise RpcError("invalid_argument", f"{path} is a directory")
        return await download_response(
            chunks, size=entry.size, disposition="attachment", what=f"{caller.sandbox.id}:{path}"
        )
    except Exception as exc:
        return _failed(exc)


def _written(path: str) -> dict[str, Any]:
    return {"name": path.rsplit("/", 1)[-1], "type": "file", "path": path}


async def _upload(request: HttpRequest) -> HttpResponse:
    def write() -> list[dict[str, Any]]:
        caller = _call(request)
        content_type = request.content_type or ""
        if content_type.startswith("multipart/"):
            parts = _parts(request)
        elif content_type == "application/octet-stream":
            parts = [(request.GET.get("path", ""), _decoded(request))]
        else:
            raise RpcError("invalid_argument", "send multipart/form-data or application/octet-stream")
        done = []
        home = users.home(caller)
        for name, data in parts:
            path = resolve(name, home)
            io_svc.sandbox_file_write(sandbox=caller.sandbox, path=path, data=[data], size=len(data))
            done.append(_written(path))
        users.hand_over(caller, [d["path"] for d in done])  # the image's user's, as E2B writes them
        return done

    try:
        return JsonResponse(await blocking(write)(), safe=False)
    except Exception as exc:
        return _failed(exc)


# Gzipped uploads unpacked at once by this process: each may hold up to the file limit twice
# (the body and what it unpacks to), so a few small bodies cannot take the server's memory.
_UNPACKING = threading.BoundedSemaphore(2)


def _decoded(request: HttpRequest) -> bytes:
    """An octet-stream upload's bytes: as sent, or gunzipped (``Content-Encoding: gzip``, which
    the SDK sends with ``gzip=True`` to envd 0.5.7 and later; every member of a multi-member
    file), never past the file limit once unpacked (a 413, as for a file sent whole that large)."""
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("", "identity"):
        return request.body
    if encoding != "gzip":
        raise RpcError("invalid_argument", f"Content-Encoding {encoding!r}: send the file as it is, or gzip")
    if not _UNPACKING.acquire(blocking=False):
        raise RpcError("resource_exhausted", "too many compressed uploads at once on this server; try again")
    try:
        return _gunzip(request.body, settings.HANGAR_FILE_MAX_BYTES)
    finally:
        _UNPACKING.release()


def _gunzip(body: bytes, limit: int) -> bytes:
    out = bytearray()
    rest = body
    while True:
        unpack = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            out += unpack.decompress(rest, limit + 1 - len(out))
            if len(out) > limit or unpack.unconsumed_tail:
                raise TooLarge(f"the file unpacks to more than HANGAR_FILE_MAX_BYTES ({limit} bytes)")
            out += unpack.flush()
        except zlib.error as exc:
            raise RpcError("invalid_argument", f"the gzip body could not be unpacked: {exc}") from None
        if not unpack.eof:
            raise RpcError("invalid_argument", "the gzip body is cut short")
        if len(out) > limit:
            raise TooLarge(f"the file unpacks to more than HANGAR_FILE_MAX_BYTES ({limit} bytes)")
        rest = unpack.unused_data
        if not rest.strip(b"\0"):  # the last member (at most padding after it); else the next one
            return bytes(out)


def _parts(request: HttpRequest) -> list[tuple[str, bytes]]:
    """The uploaded files, each with its destination: the part's filename, or ``?path=`` when
    one file is sent with it."""
    names = _Names(request)
    handlers = [names, MemoryFileUploadHandler(request), TemporaryFileUploadHandler(request)]
    try:
        _, uploaded = _PathParser(request.META, io.BytesIO(request.body), handlers, request.encoding).parse()
    except MultiPartParserError as exc:
        raise RpcError("invalid_argument", f"the multipart body could not be read: {exc}") from None
    files = [f for _, group in uploaded.lists() for f in group]
    found = [(name, f.read()) for name, f in zip(names.names, files, strict=True)]
    if len(found) == 1 and request.GET.get("path"):
        found = [(request.GET["path"], found[0][1])]
    if not found:
        raise RpcError("invalid_argument", "the multipart body holds no file")
    return found
