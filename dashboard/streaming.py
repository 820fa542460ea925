"""Streamed answers (NDJSON events, file downloads) that end cleanly when something fails.

Whatever can be checked is checked before a stream starts (a 4xx that says what to fix). Then
its first chunk is read before the headers go out, so an error on the first read is still an
ordinary error answer. After that, an error ends the stream in the stream's own format: an
NDJSON stream gets a last ``{"type": "error", "message": ...}`` line and ends; a download has
no way to say so in its body, so its connection is cut with the body incomplete (a client sees
a short read, never a complete-looking file) and the error is logged.

A download never sends more bytes than it announced: the sandbox's word on a file's size is
untrusted (``/proc`` says 0 for everything, and a sandbox can answer for its own agent), and an
HTTP body longer than its ``Content-Length`` is read by a keep-alive client as the next answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from django.conf import settings
from django.http import StreamingHttpResponse

from runtime.aio import blocking
from runtime.errors import NodeUnavailable, ServiceError
from runtime.services import audit as audit_svc

log = logging.getLogger(__name__)

# An NDJSON stream waits this long for its first line before its headers go out anyway (a
# follow of a quiet command has nothing to say yet); an error within it is an error answer.
FIRST_LINE_WAIT_S = 2.0
# Sent after HANGAR_STREAM_KEEPALIVE_S without a line: clients skip events they do not know.
KEEPALIVE_LINE = b'{"type":"keepalive"}\n'


class BodyCut(Exception):
    """Raised out of a download's body once its headers are sent: the server cuts the
    connection (see ``HangarRequest.handle_exception`` in :mod:`dashboard.server`)."""


def error_line(message: str) -> bytes:
    return json.dumps({"type": "error", "message": message}, separators=(",", ":")).encode() + b"\n"


def _message(exc: BaseException) -> str:
    if isinstance(exc, ServiceError):
        return exc.message
    return "the stream failed on the server; its log has the details"


async def _first(body: AsyncIterator[bytes], wait: float | None) -> tuple[list[bytes], Any]:
    """Read ``body``'s first chunk, for up to ``wait`` seconds: ([chunk] or [], the read still
    going when the wait ran out, else None). An error within the wait is raised here."""
    read = asyncio.ensure_future(anext(body))
    try:
        done, _ = await asyncio.wait({read}, timeout=wait)
    except BaseException:
        read.cancel()
        raise
    if not done:
        return [], read
    try:
        return [read.result()], None
    except StopAsyncIteration:
        return [], None
    except ServiceError:
        raise
    except Exception as exc:
        log.exception("a stream failed before its first chunk")
        raise NodeUnavailable(f"the stream could not start: {_message(exc)}") from exc


async def ndjson_response(body: AsyncIterator[bytes]) -> StreamingHttpResponse:
    """An NDJSON answer whose first line is read before its headers go out (for up to
    :data:`FIRST_LINE_WAIT_S`), and which ends with an error line if ``body`` fails later."""
    try:
        head, pending = await _first(body, FIRST_LINE_WAIT_S)
    except BaseException:
        with contextlib.suppress(Exception):
            await body.aclose()  # type: ignore[attr-defined]
        raise

    async def rest() -> AsyncIterator[bytes]:
        read = pending
        try:
            for chunk in head:
                yield chunk
            while True:
                if read is None:
                    read = asyncio.ensure_future(anext(body))
                done, _ = await asyncio.wait({read}, timeout=settings.HANGAR_STREAM_KEEPALIVE_S)
                if not done:
                    yield KEEPALIVE_LINE  # a quiet stream is still alive (proxies, read timeouts)
                    continue
                got, read = read, None
                yield got.result()
        except StopAsyncIteration:  # the body ended
            return
        except Exception as exc:
            if not isinstance(exc, ServiceError):
                log.exception("a stream failed after it started")
            yield error_line(_message(exc))
        finally:
            if read is not None and not read.done():
                read.cancel()
                await asyncio.wait({read})  # its own cleanup runs before the body's aclose
            if read is not None and not read.cancelled():
                read.exception()  # taken (the body may have ended as it was cancelled): not logged as lost
            # The body's own cleanup (a streamed exec is killed when its client leaves) runs now,
            # not whenever the garbage collector finds it.
            with contextlib.suppress(Exception):
                await body.aclose()  # type: ignore[attr-defined]

    response = StreamingHttpResponse(rest(), content_type="application/x-ndjson")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx in front must not hold lines back
    return response


async def download_response(
    chunks: Iterator[bytes], *, size: int, disposition: str, what: str
) -> StreamingHttpResponse:
    """A file's bytes from a blocking iterator (the sandbox's agent), read a chunk at a time on
    the blocking pool. The first two chunks are read before the headers: a file that ends
    within them gets its exact ``Content-Length``; a longer one announces ``size`` (the
    sandbox's word) when that covers what was read, and is then cut at it, else goes chunked.
    An error on the first read is raised here; one later, or a body shorter than announced,
    cuts the connection. ``what`` names the download in the log."""
    # A client that leaves cancels the answer while a read may still run on its thread; a
    # generator cannot be closed while it runs ("already executing"), and one left open holds
    # its agent connection until the garbage collector finds it. So the close waits for it.
    turn = threading.Lock()

    def read() -> bytes | None:
        with turn:
            return next(chunks, None)

    def end() -> None:
        with turn:
            getattr(chunks, "close", lambda: None)()

    step, close = blocking(read), blocking(end)
    try:
        head: list[bytes] = []
        while len(head) < 2 and (chunk := await step()) is not None:
            head.append(chunk)
    except BaseException:
        with contextlib.suppress(Exception):
            await close()
        raise
    got = sum(len(c) for c in head)
    ended = len(head) < 2
    announced: int | None = got if ended else (size if size >= got else None)

    async def body() -> AsyncIterator[bytes]:
        sent = 0
        try:
            for chunk in head:
                yield chunk
                sent += len(chunk)
            if ended:
                return
            while announced is None or sent < announced:
                chunk = await step()
                if chunk is None:
                    break
                if announced is not None:
                    chunk = chunk[: announced - sent]  # more than announced: the rest is dropped
                yield chunk
                sent += len(chunk)
            if announced is not None and sent < announced:
                raise BodyCut(f"the sandbox sent {sent} of the {announced} bytes it announced")
        except BodyCut as exc:
            log.warning("download of %s cut: %s", what, exc)
            raise
        except Exception as exc:
            log.warning("download of %s cut after %d bytes: %s", what, sent, _message(exc), exc_info=exc)
            raise BodyCut(str(exc)) from exc
        finally:
            with contextlib.suppress(Exception):
                await close()  # ends the agent's connection, whatever it had left to send

    response = StreamingHttpResponse(body(), content_type="application/octet-stream")
    if announced is not None:
        response["Content-Length"] = str(announced)
    response["Content-Disposition"] = disposition
    return response


def audit_csv_response(rows: Any, first: tuple[str, int | None]) -> StreamingHttpResponse:
    """An audit export, a page of events at a time from the blocking pool (a sync iterator
    would be read whole into memory before the first byte under ASGI). ``first`` is
    ``audit_svc.csv_page(rows)``, read by the caller before the answer starts: a filter the
    database refuses is then an error answer, not a cut connection."""

    async def body() -> AsyncIterator[bytes]:
        text, after = first
        yield text.encode()
        while after is not None:
            text, after = await blocking(audit_svc.csv_page)(rows, before_id=after)
            yield text.encode()

    response = StreamingHttpResponse(body(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = 'attachment; filename="hangar-audit.csv"'
    return response
