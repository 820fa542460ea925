"""Hangar's HTTP and websocket server: daphne, with back-pressure both ways.

Plain daphne hands every response body to Twisted, which buffers it without limit, and the
app's ``send`` never waits: a client that reads slowly made the server hold whatever the app
produced (a 400 MB download held ~400 MB). And daphne queues a request's whole body for the app
at once, in 8 KiB pieces. Here:

- **Responses**: a :class:`SendGate` is registered as the response's producer (HTTP) or the
  connection's (websockets). Twisted pauses it when the connection's send buffer passes its
  high mark (64 KiB) and resumes it once that buffer has drained into the kernel; the app's
  ``send`` of a body part or a websocket message waits while it is paused. So one connection
  holds at most a message or two beyond the socket's own buffers, whatever the response's size
  (downloads, preview proxying, streamed exec output, static files). A client that hangs up
  while a send waits ends the wait; one that takes nothing for ``HANGAR_SEND_STALL_S`` is
  dropped.
- **Request bodies**: Twisted keeps a body it receives in a temporary file past 100 kB (and
  Hangar turns off its parsing of form posts into memory); the app is given it a piece at a
  time as it asks (:class:`RequestBody`), not queued all at once. A body larger than the
  largest file Hangar takes (``HANGAR_FILE_MAX_BYTES``, plus 1 MiB of form framing) is refused
  with a 413 as soon as that is known, before it fills the disk.

``python -m dashboard.server`` takes daphne's arguments; `hangar up` and the tests run it.
"""

from __future__ import annotations

# daphne.server installs Twisted's asyncio reactor; it must come before anything imports one.
import daphne.server  # isort:skip

import asyncio
import io
import json
import logging
import types
from functools import partial
from typing import Any, BinaryIO
from urllib.parse import urlsplit

from daphne.cli import CommandLineInterface
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.ws_protocol import WebSocketFactory, WebSocketProtocol
from django.conf import settings
from twisted.internet import reactor
from twisted.internet.interfaces import IPushProducer
from zope.interface import implementer

from runtime.aio import within

from .limits import body_limit

log = logging.getLogger("hangar.server")

# What the app is handed of a request body per ``receive``.
BODY_CHUNK = 64 * 1024
# How long a refused body's sender is read (and ignored) after the answer, before the hang-up.
LINGER_S = 2.0


@implementer(IPushProducer)
class SendGate:
    """Open while the connection's send buffer is below Twisted's high mark. Twisted calls these
    on the reactor's thread, which is the event loop's (the asyncio reactor)."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.stopped = False

    def pauseProducing(self) -> None:
        if not self.stopped:
            self._open.clear()

    def resumeProducing(self) -> None:
        self._open.set()

    def stopProducing(self) -> None:
        self.stopped = True
        self._open.set()

    async def wait(self, stall_s: float) -> bool:
        """Until the buffer has drained or the connection is gone; False after ``stall_s``."""
        if self._open.is_set():
            return True
        try:
            await within(self._open.wait(), stall_s)
        except TimeoutError:
            return False
        return True


class HangarRequest(WebRequest):
    """daphne's HTTP request, with its response held back by a :class:`SendGate`."""

    def __init__(self, channel: Any, *args: Any, **kwargs: Any) -> None:
        # Twisted would read a form post's whole body into memory (self.args) for nothing:
        # daphne passes the raw body on and never looks at args.
        kwargs["parsePOSTFormSubmission"] = False
        self.send_gate = SendGate()
        self._gate_registered = False
        super().__init__(channel, *args, **kwargs)

    # -- the request's body: on disk until the app reads it, and never past the largest file

    _body_bytes = 0
    _refused = False

    def gotLength(self, length: int | None) -> None:
        super().gotLength(length)
        # The request line is read by now (Twisted keeps it on the channel until the body is
        # in): an API call's body is held to its route's limit before a byte of it is stored.
        method = getattr(self.channel, "_command", b"").decode("latin-1")
        path = urlsplit(getattr(self.channel, "_path", b"").decode("latin-1")).path
        if path.startswith(("/api/", "/e2b/")):
            self._route_limit = body_limit(method, path)
        if length is not None:
            self._check_body_size(length)

    _route_limit: tuple[int, str] | None = None

    def _check_body_size(self, size: int) -> None:
        if self._route_limit is not None and size > self._route_limit[0]:
            limit, name = self._route_limit
            detail = f"the request body is larger than this endpoint's limit of {limit} bytes ({name})"
            self._refuse_body(json.dumps({"detail": detail, "limit": limit}), "application/json")
        elif size > _body_limit():
            self._refuse_body()

    def handleContentChunk(self, data: bytes) -> None:
        if self._refused:
            return
        self._body_bytes += len(data)
        self._check_body_size(self._body_bytes)
        if not self._refused:
            super().handleContentChunk(data)

    def requestReceived(self, command: bytes, path: bytes, version: bytes) -> None:
        if not self._refused:
            super().requestReceived(command, path, version)

    def _refuse_body(self, message: str = "", content_type: str = "text/plain; charset=utf-8") -> None:
        """413 and hang up: a body is stored whole (twice: here and by Django) before the app
        runs, so one larger than anything Hangar takes would only fill the disk."""
        self._refused = True
        transport = self.channel.transport if self.channel is not None else None
        if transport is None:
            return
        body = (
            message
            or f"413: a request body may hold at most {_body_limit()} bytes (HANGAR_FILE_MAX_BYTES, and 1 MiB for a form's framing)\n"
        ).encode()
        transport.write(
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Type: %s\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (content_type.encode(), len(body), body)
        )
        # Closed at once with the client still sending, the connection would be reset and the
        # client lose the answer: what it sends for a moment longer is read and dropped.
        if hasattr(transport, "loseWriteConnection"):
            transport.loseWriteConnection()
            # Twisted declares IReactorTime zope-style (no self), so mypy reads the delay as self.
            reactor.callLater(LINGER_S, transport.abortConnection)  # type: ignore[arg-type]
        else:
            transport.loseConnection()

    # -- the response: held back by the gate

    def handle_reply(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "http.response.body" and not message.get("more_body", False):
            self._release_gate()  # finish() follows, and the next request may register its own
        super().handle_reply(message)
        if kind == "http.response.start" and not self.finished and self.channel is not None:
            self.registerProducer(self.send_gate, True)
            self._gate_registered = True

    def _release_gate(self) -> None:
        if self._gate_registered:
            self._gate_registered = False
            if self.channel is not None:
                self.unregisterProducer()
            else:
                self.producer = None

    def finish(self) -> None:
        self._release_gate()
        super().finish()

    def connectionLost(self, reason: Any) -> None:
        self.send_gate.stopProducing()
        self._gate_registered = False
        self.producer = None
        super().connectionLost(reason)

    def drop(self) -> None:
        if self.channel is not None and self.channel.transport is not None:
            self.channel.transport.abortConnection()

    def handle_exception(self, exception: BaseException) -> None:
        """An application that fails after its answer's headers went out: cut the connection.
        daphne answers any failure with a 500 page, and for a started answer that raises inside
        its connection checker, which then never runs again: the client would wait forever on a
        body that never ends, and so would every later failing request's. Cutting is what HTTP
        offers: the client sees an incomplete body, never a complete-looking one (daphne 4.2;
        tests/api/test_files_api.py::test_a_download_the_sandbox_cuts_short_ends_its_connection)."""
        if getattr(self, "_response_started", False):
            if self.transport is not None:
                self.transport.loseConnection()  # what was sent goes out first, then the close
            return
        super().handle_exception(exception)


def _body_limit() -> int:
    return int(settings.HANGAR_FILE_MAX_BYTES) + 1024 * 1024


def _refuse_and_close(channel: Any, status: str, message: str) -> None:
    """Answer a request twisted will not parse with a status and a JSON message, then close
    (twisted's own answer is a bare 400, or for an overlong line no answer at all)."""
    body = json.dumps({"detail": message}).encode()
    channel.transport.write(
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    channel.transport.loseConnection()


def _line_too_long(channel: Any, line: bytes) -> None:
    limit = channel.MAX_LENGTH
    if getattr(channel, "_HTTPChannel__first_line", False):
        _refuse_and_close(channel, "414 URI Too Long", f"the request line is over {limit} bytes: shorten the URL "
                          "(send long values in a JSON body)")  # fmt: skip
    else:
        _refuse_and_close(
            channel, "431 Request Header Fields Too Large", f"a header line is over {limit} bytes"
        )


def _bad_request(channel: Any) -> None:
    if (getattr(channel, "_receivedHeaderSize", 0) > channel.totalHeadersSize
            or getattr(channel, "_receivedHeaderCount", 0) > channel.maxHeaders):  # fmt: skip
        _refuse_and_close(channel, "431 Request Header Fields Too Large",
                          f"the headers are over {channel.totalHeadersSize} bytes or {channel.maxHeaders} fields")  # fmt: skip
    else:
        _refuse_and_close(channel, "400 Bad Request", "a malformed HTTP request")


class HangarHTTPFactory(HTTPFactory):
    def buildProtocol(self, addr: Any) -> Any:
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = HangarRequest
        channel = getattr(protocol, "_channel", protocol)  # twisted wraps it to negotiate HTTP/2
        channel.lineLengthExceeded = types.MethodType(_line_too_long, channel)
        channel._respondToBadRequestAndDisconnect = types.MethodType(_bad_request, channel)
        return protocol


class HangarWebSocketProtocol(WebSocketProtocol):
    """daphne's websocket, with its messages held back by a :class:`SendGate`."""

    def connectionMade(self) -> None:
        self.send_gate = SendGate()
        # The connection came as HTTP: its channel is still the transport's producer, and
        # would only note that the buffer is full. The gate takes its place.
        if getattr(self.transport, "producer", None) is not None:
            self.transport.unregisterProducer()
        self.transport.registerProducer(self.send_gate, True)
        super().connectionMade()

    def connectionLost(self, reason: Any) -> None:
        self.send_gate.stopProducing()
        super().connectionLost(reason)

    def onClose(self, wasClean: bool, code: int, reason: str) -> None:
        self.send_gate.stopProducing()
        super().onClose(wasClean, code, reason)

    def drop(self) -> None:
        self.dropConnection(abort=True)


class HangarWebSocketFactory(WebSocketFactory):
    protocol = HangarWebSocketProtocol


class RequestBody:
    """The app's ``receive`` for an HTTP request: the body read from Twisted's buffer of it
    (a temporary file past 100 kB) a piece at a time as the app asks, then daphne's queue (a
    disconnect). daphne would have queued the whole body at once."""

    def __init__(self, content: BinaryIO, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self.content: BinaryIO | None = content
        self.queue = queue

    async def receive(self) -> dict[str, Any]:
        while not self.queue.empty():
            message = self.queue.get_nowait()
            if message["type"] != "http.request":  # the client hung up before the body was taken
                self._close()
                return message
        if self.content is not None:
            chunk = self.content.read(BODY_CHUNK)
            more = len(chunk) == BODY_CHUNK
            if not more:
                self._close()
            return {"type": "http.request", "body": chunk, "more_body": more}
        while True:
            message = await self.queue.get()
            if message["type"] != "http.request":  # daphne's own (empty) copy of the body
                return message

    def _close(self) -> None:
        if self.content is not None:
            self.content.close()
            self.content = None


class HangarServer(daphne.server.Server):
    def run(self) -> None:
        # daphne's run() builds its factories from these names; Hangar's stand in for them.
        daphne.server.HTTPFactory = HangarHTTPFactory
        daphne.server.WebSocketFactory = HangarWebSocketFactory
        super().run()

    def create_application(
        self, protocol: Any, scope: dict[str, Any]
    ) -> asyncio.Queue[dict[str, Any]] | None:
        """daphne's, with an HTTP request's body handed over as the app asks for it. Called from
        daphne's ``process()`` before it queues the body from ``protocol.content``: the body is
        taken here and an empty one left for daphne to queue."""
        assert "application_instance" not in self.connections[protocol]
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        receive = queue.get
        if scope["type"] == "http":
            receive = RequestBody(protocol.content, queue).receive
            protocol.content = io.BytesIO()
        scope.setdefault("asgi", {"version": "3.0"})
        instance = self.application(scope=scope, receive=receive, send=partial(self.handle_reply, protocol))
        if protocol not in self.connections:
            return None
        self.connections[protocol]["application_instance"] = asyncio.ensure_future(
            instance, loop=asyncio.get_event_loop()
        )
        return queue

    async def handle_reply(self, protocol: Any, message: dict[str, Any]) -> None:
        await super().handle_reply(protocol, message)
        kind = message.get("type")
        # An HTTP response's last part has no next one to hold back (and its gate is released).
        if not (kind == "websocket.send" or (kind == "http.response.body" and message.get("more_body"))):
            return
        gate: SendGate | None = getattr(protocol, "send_gate", None)
        # A client that takes nothing for this long is dropped: its send would otherwise hold
        # its app (and what that holds: an agent connection, a command, an exec slot) forever.
        stall_s = settings.HANGAR_SEND_STALL_S
        if gate is not None and not await gate.wait(stall_s):
            log.warning("dropped %r: it took nothing for %g s", protocol, stall_s)
            protocol.drop()


class HangarCommandLine(CommandLineInterface):
    description = "Hangar's HTTP/websocket server (daphne, with back-pressure)"
    server_class = HangarServer


if __name__ == "__main__":
    HangarCommandLine.entrypoint()
