"""Preview URLs, served: requests for ``{port}-{sandbox_id}.{HANGAR_PREVIEW_DOMAIN}`` go to the
server listening on that port inside the sandbox, HTTP/1.1 (bodies streamed both ways, so
server-sent events and long downloads flow as they come) and websockets alike.

:class:`PreviewRouter` sits in front of Django and Channels and picks such requests by their
``Host``. Each request is one tunnel through the sandbox's launcher (``open_tunnel``: for an
agent-based one, the agent's ``T`` request) to the port on the sandbox's loopback; HTTP is spoken
over it with ``h11`` and websockets with the ``websockets`` library's sans-I/O protocol. The
``Host`` the browser sent is passed on, so an app's absolute links keep working.

A sandbox on another node is reached through that node's tunnel listener
(:mod:`runtime.node.tunnels`) instead of its agent directly; the rest is the same.

Access (see :mod:`runtime.services.previews`): public ports take anyone; private ones a
signed token (query parameter, then a cookie for that host), or an API token of the sandbox's
team; a sandbox whose every port is open and private (E2B's ``allowPublicTraffic: false``) also
takes its traffic access token in the ``e2b-traffic-access-token`` header. A paused sandbox with ``auto_resume`` is resumed and the request held until its server
answers (``HANGAR_PREVIEW_RESUME_WAIT_S``, then a 503 page). Preview traffic counts as
activity for idle rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import time
from collections.abc import Awaitable, Callable
from http.cookies import SimpleCookie
from typing import Any
from urllib.parse import parse_qsl

import h11
from django.conf import settings

from runtime.aio import blocking, stop, within
from runtime.errors import Conflict, ServiceError
from runtime.models import Sandbox
from runtime.services import previews

from ..streaming import BodyCut

log = logging.getLogger("hangar.preview")
S = Sandbox.Status
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
HOP_BY_HOP = {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
              b"upgrade", b"proxy-connection"}  # fmt: skip
READ_CHUNK = 64 * 1024
ACTIVITY_EVERY_S = 10.0


class PreviewRouter:
    """ASGI: preview hosts here, everything else to ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            target = previews.parse_host(_header(scope, b"host").decode("latin-1"))
            if target is not None:
                await Preview(scope, receive, send, *target).serve()
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> bytes:
    for k, v in scope.get("headers", []):
        if k == name:
            return v
    return b""


class Denied(Exception):
    def __init__(self, status: int, title: str, message: str) -> None:
        super().__init__(message)
        self.status, self.title, self.message = status, title, message


# One wake-up per sandbox in this process: however many requests arrive for a paused sandbox
# (a page and its dozens of assets), one of them resumes it and they all wait on the same task,
# on the event loop (a Redis notification or a re-read every second), holding no thread.
_WAKING: dict[str, asyncio.Task[Sandbox]] = {}
WAKE_POLL_S = 1.0
WAKE_TASK_WAITS = 3  # the shared task follows the sandbox this many request waits at most


def _read_row(sandbox_id: str) -> Sandbox:
    row = Sandbox.objects.select_related("node", "team").filter(id=sandbox_id).first()
    if row is None:
        raise Denied(404, "No such sandbox", f"There is no sandbox {sandbox_id} (or it was deleted).")
    return row


async def _wake(sandbox_id: str) -> Sandbox:
    """Resume the sandbox if it is paused and wait until it runs, or until this request's own
    wait ends (``HANGAR_PREVIEW_RESUME_WAIT_S`` from when it came, however late it joined);
    the fresh row. Requests arriving meanwhile share the first one's task."""
    loop = asyncio.get_running_loop()
    task = _WAKING.get(sandbox_id)
    if task is None or task.done() or task.get_loop() is not loop:
        task = loop.create_task(_resume_and_wait(sandbox_id))
        _WAKING[sandbox_id] = task

        def forget(t: asyncio.Task[Sandbox]) -> None:
            if _WAKING.get(sandbox_id) is t:
                del _WAKING[sandbox_id]
            if not t.cancelled():
                t.exception()  # retrieved: a failure is each waiter's to report

        task.add_done_callback(forget)
    # Shielded: a client that gives up, or whose wait ends, does not stop the wake-up the
    # others wait for.
    try:
        return await within(asyncio.shield(task), settings.HANGAR_PREVIEW_RESUME_WAIT_S)
    except TimeoutError:
        return await blocking(_read_row)(sandbox_id)  # still waking: the caller says so


async def _resume_and_wait(sandbox_id: str) -> Sandbox:
    from dashboard.live import hub
    from runtime.notify import sandbox_channel
    from runtime.services import sandboxes as svc

    def resume(row: Sandbox) -> None:
        with contextlib.suppress(Conflict):  # another server resumed it first
            svc.sandbox_resume(sandbox=row)

    channel = sandbox_channel(sandbox_id)
    queue = await hub.subscribe(channel)  # before the first read: no change is missed
    try:
        deadline = time.monotonic() + WAKE_TASK_WAITS * settings.HANGAR_PREVIEW_RESUME_WAIT_S
        resumed = False
        while True:
            row = await blocking(_read_row)(sandbox_id)
            if row.status == S.PAUSED and not resumed:
                # A pause still finishing when the request came is let finish, then undone.
                await blocking(resume)(row)
                resumed = True
                continue
            if row.status not in (S.PAUSING, S.RESUMING, S.PAUSED) or time.monotonic() >= deadline:
                return row
            with contextlib.suppress(TimeoutError):
                await within(queue.get(), min(WAKE_POLL_S, max(0.0, deadline - time.monotonic())))
    finally:
        hub.unsubscribe(channel, queue)


class Preview:
    def __init__(self, scope: Scope, receive: Receive, send: Send, port: int, sandbox_id: str) -> None:
        self.scope, self.receive, self.send = scope, receive, send
        self.port, self.sandbox_id = port, sandbox_id
        self.host = _header(scope, b"host").decode("latin-1")
        self.query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        # What goes upstream: the query as the browser sent it, less only Hangar's token.
        self.raw_query: bytes = scope.get("query_string", b"")
        self.resumed = False
        self.started = False
        self.set_cookie: str | None = None
        self.last_activity = 0.0

    # -- the request's way in ------------------------------------------------------------------

    async def serve(self) -> None:
        try:
            sandbox = await self._sandbox()
            redirect = await self._authorize(sandbox)
            if redirect is not None:
                await self._redirect(redirect)
                return
            sandbox = await self._running(sandbox)
            await self._activity(force=True, last=sandbox.last_activity_at)
            reader, writer = await self._tunnel(sandbox)
        except Denied as d:
            await self._refuse(d)
            return
        if self.scope["type"] == "http":
            await self._proxy_http(reader, writer)
        else:
            await self._proxy_websocket(reader, writer)

    async def _sandbox(self) -> Sandbox:
        # A running sandbox's row is kept a moment (see previews.cached_row).
        sandbox = previews.cached_row(self.sandbox_id)
        if sandbox is None:
            sandbox = await blocking(
                lambda: Sandbox.objects.select_related("node", "team").filter(id=self.sandbox_id).first()
            )()
            if sandbox is not None and sandbox.status == S.RUNNING:
                previews.remember_row(sandbox)
        if sandbox is None or sandbox.status == S.DELETED:
            raise Denied(
                404, "No such sandbox", f"There is no sandbox {self.sandbox_id} (or it was deleted)."
            )
        if previews.port_entry(sandbox, self.port) is None:
            raise Denied(404, "No preview on this port",
                         f"Port {self.port} of sandbox {self.sandbox_id} has no preview URL. Give it one with "
                         f"POST /api/v1/sandboxes/{self.sandbox_id}/ports {{\"port\": {self.port}}}.")  # fmt: skip
        return sandbox

    async def _authorize(self, sandbox: Sandbox) -> str | None:
        """None when the request may go on; a URL to redirect to (the token moved into a
        cookie); or :class:`Denied`."""
        entry = previews.port_entry(sandbox, self.port) or {}
        token = next((v for k, v in self.query if k == previews.TOKEN_PARAM), None)
        if token is not None:
            name = previews.TOKEN_PARAM.encode()
            self.raw_query = b"&".join(p for p in self.raw_query.split(b"&") if p.split(b"=", 1)[0] != name)
        if entry.get("public"):
            return None
        traffic = _header(self.scope, previews.TRAFFIC_HEADER.encode()).decode("latin-1")
        refused_traffic = False
        if sandbox.open_ports == "private" and traffic:
            # E2B's traffic access token, for a sandbox whose every port is private (the ports
            # exposed through Hangar's API too); a wrong one leaves the other ways in open.
            if await blocking(previews.traffic_token_valid)(traffic, sandbox):
                return None
            refused_traffic = True
        if token is not None and previews.verify(token, sandbox.id, self.port):
            if self.scope["type"] == "http" and self.scope.get("method") in ("GET", "HEAD"):
                # Into a cookie for this host, and the URL without it (not left in history). The
                # path keeps one leading slash: "//elsewhere/" would send the browser away.
                self.set_cookie = token
                path = "/" + (self.scope.get("raw_path") or self.scope["path"].encode()).decode(
                    "latin-1"
                ).lstrip("/")
                return path + (f"?{self.raw_query.decode('latin-1')}" if self.raw_query else "")
            return None
        cookie = SimpleCookie()
        with contextlib.suppress(Exception):
            cookie.load(_header(self.scope, b"cookie").decode("latin-1"))
        morsel = cookie.get(previews.COOKIE)
        if morsel is not None and previews.verify(morsel.value, sandbox.id, self.port):
            # A cookie rides along with requests other pages start, previews of other sandboxes
            # included (same site): whatever can change something must come from this origin.
            origin = _header(self.scope, b"origin").decode("latin-1")
            changes = self.scope["type"] == "websocket" or self.scope.get("method") not in (
                "GET",
                "HEAD",
                "OPTIONS",
            )
            if changes and origin and origin != f"{settings.HANGAR_PREVIEW_SCHEME}://{self.host}":
                raise Denied(403, "Cross-site request refused",
                             f"A request from {origin} may not use this preview's sign-in cookie.")  # fmt: skip
            return None
        auth = _header(self.scope, b"authorization").decode("latin-1")
        if auth.lower().startswith("bearer hgr_"):
            from runtime.services.auth import sandbox_reached, token_allows, token_authenticate

            api_token = await blocking(token_authenticate)(auth.split(None, 1)[1].strip())
            if (
                api_token is not None
                and api_token.team_id == sandbox.team_id
                and token_allows(api_token, "sandboxes:read")
                and await blocking(sandbox_reached)(caller=api_token, sandbox_id=sandbox.id)
            ):
                return None
        if refused_traffic:
            raise Denied(403, "Wrong traffic access token",
                         f"The {previews.TRAFFIC_HEADER} header does not hold a live traffic access token of "
                         "this sandbox (its API token revoked, or of another sandbox).")  # fmt: skip
        raise Denied(401, "This preview is private",
                     "Open it from the link Hangar gives (the sandbox's page, or its previews in the API), "
                     "or send an API token of the sandbox's team as Authorization: Bearer"
                     + (f", or the sandbox's traffic access token as {previews.TRAFFIC_HEADER}."
                        if sandbox.open_ports == "private" else "."))  # fmt: skip

    async def _running(self, sandbox: Sandbox) -> Sandbox:
        if sandbox.status == S.RUNNING:
            return sandbox
        resumable = sandbox.status in (S.PAUSED, S.PAUSING, S.RESUMING) and sandbox.auto_resume
        if not resumable:
            raise Denied(503, f"This sandbox is {sandbox.status}",
                         f"Sandbox {sandbox.id} is {sandbox.status}, so nothing answers on port {self.port}."
                         + (" Resume it to use this preview." if sandbox.status == S.PAUSED else ""))  # fmt: skip

        try:
            sandbox = await _wake(sandbox.id)
        except ServiceError as exc:  # over quota, say: the page says so
            raise Denied(exc.status_code, "This sandbox could not be resumed", exc.message) from None
        if sandbox.status in (S.FAILED, S.STOPPING, S.STOPPED, S.DELETED):
            # Not the reason itself: a public preview's visitors are anybody, and a node's
            # reasons name its paths. The sandbox's team sees it in Hangar.
            raise Denied(503, "This sandbox could not be resumed",
                         f"Sandbox {sandbox.id} is {sandbox.status}; its owners can see why in Hangar.")  # fmt: skip
        if sandbox.status != S.RUNNING:
            raise Denied(503, "This sandbox is waking up",
                         f"Sandbox {sandbox.id} did not start within {settings.HANGAR_PREVIEW_RESUME_WAIT_S} s "
                         f"(it is {sandbox.status}). Try again in a moment.")  # fmt: skip
        self.resumed = True
        return sandbox

    async def _tunnel(self, sandbox: Sandbox) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """A connection to the port inside, through the sandbox's one road (this node's
        launcher, or the sandbox's node's tunnel listener: :mod:`runtime.node.tunnels`)."""
        from runtime.node.tunnels import TunnelError
        from runtime.services.sandbox_access import NotRunningHere, NoTunnelListener, sandbox_access

        access = sandbox_access(sandbox)
        # Right after a resume the server inside may still be starting: wait for it a while.
        deadline = time.monotonic() + (settings.HANGAR_PREVIEW_RESUME_WAIT_S if self.resumed else 0)
        while True:
            try:
                return await access.open_tunnel(self.port)
            except NotRunningHere:
                raise Denied(
                    503, "The sandbox is not running", f"Sandbox {sandbox.id} has no running agent right now."
                ) from None
            except NoTunnelListener:
                raise Denied(502, "Preview unavailable here",
                             f"Sandbox {sandbox.id} runs on node {sandbox.node}, which takes no tunnels from other "
                             "machines: start it with HANGAR_TUNNEL_PORT set (and HANGAR_NODE_ADDRESS), or send the "
                             "request to that node's own Hangar server.") from None  # fmt: skip
            except TunnelError as exc:
                if time.monotonic() >= deadline:
                    if exc.refused:
                        raise Denied(502, "Nothing answers on this port",
                                     f"Nothing in sandbox {sandbox.id} accepts connections on port {self.port} "
                                     "yet. Start the server (listening on 127.0.0.1 or 0.0.0.0), then reload.") from None  # fmt: skip
                    raise Denied(502, "The sandbox did not answer", f"Sandbox {sandbox.id}: {exc}") from None
            await asyncio.sleep(0.25)

    async def _activity(self, force: bool = False, last: Any = None) -> None:
        """Preview traffic is activity. ``last``: the row's ``last_activity_at`` as loaded;
        recent enough, there is nothing to write (most requests: no database round trip)."""
        now = time.monotonic()
        if force or now - self.last_activity >= ACTIVITY_EVERY_S:
            self.last_activity = now
            from django.utils import timezone

            from runtime.services.sandbox_calls import ACTIVITY_EVERY_S as WRITE_EVERY_S
            from runtime.services.sandbox_calls import sandbox_mark_active

            if last is not None and (timezone.now() - last).total_seconds() < WRITE_EVERY_S:
                return
            await blocking(sandbox_mark_active)(self.sandbox_id, last)

    # -- answers of our own ----------------------------------------------------------------------

    async def _refuse(self, d: Denied) -> None:
        if self.scope["type"] == "websocket":
            await self.receive()  # websocket.connect
            await self.send({"type": "websocket.close", "code": 4000 + d.status if d.status < 1000 else 1011,
                             "reason": d.title[:120]})  # fmt: skip
            return
        body = (
            f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(d.title)} · Hangar</title>"
            "<style>body{font:15px/1.5 system-ui,sans-serif;max-width:560px;margin:12vh auto;padding:0 20px;"
            "color:#1d2433}h1{font-size:20px}p{color:#4b5567}code{background:#eef0f4;padding:1px 5px;"
            f"border-radius:4px}}</style></head><body><h1>{html.escape(d.title)}</h1><p>{html.escape(d.message)}</p><p><small>Hangar preview of port {self.port} of "
            f"sandbox {html.escape(self.sandbox_id)}</small></p></body></html>"
        )
        headers = [(b"content-type", b"text/html; charset=utf-8"), (b"cache-control", b"no-store")]
        if d.status == 503:
            headers.append((b"retry-after", b"5"))
        await self.send({"type": "http.response.start", "status": d.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body.encode()})

    async def _redirect(self, location: str) -> None:
        secure = "; Secure" if settings.HANGAR_PREVIEW_SCHEME == "https" else ""
        cookie = (f"{previews.COOKIE}={self.set_cookie}; Path=/; Max-Age={settings.HANGAR_PREVIEW_TOKEN_TTL_S}; "
                  f"HttpOnly; SameSite=Lax{secure}")  # fmt: skip
        await self.send({"type": "http.response.start", "status": 302, "headers": [
            (b"location", location.encode("latin-1")), (b"set-cookie", cookie.encode("latin-1")),
            (b"cache-control", b"no-store"), (b"content-length", b"0"),
        ]})  # fmt: skip
        await self.send({"type": "http.response.body", "body": b""})

    # -- what goes upstream ----------------------------------------------------------------------

    def _target(self) -> bytes:
        path = self.scope.get("raw_path") or self.scope["path"].encode()
        return path + (b"?" + self.raw_query if self.raw_query else b"")

    def _upstream_headers(self) -> list[tuple[bytes, bytes]]:
        out = []
        for k, v in self.scope.get("headers", []):
            k = k.lower()
            if k in HOP_BY_HOP or k.startswith(b"sec-websocket-"):
                continue
            if k == b"authorization" and v.lower().startswith(b"bearer hgr_"):
                continue  # a Hangar token is Hangar's, never the app's, whatever let the request in
            if k == previews.TRAFFIC_HEADER.encode():
                continue  # so is the sandbox's traffic access token
            if k == b"cookie":
                kept = [c for c in v.split(b";") if not c.strip().startswith(previews.COOKIE.encode() + b"=")]
                if not kept:
                    continue
                v = b";".join(kept).strip()
            out.append((k, v))
        client = self.scope.get("client") or ("", 0)
        out += [(b"x-forwarded-for", str(client[0]).encode()), (b"x-forwarded-host", self.host.encode("latin-1")),
                (b"x-forwarded-proto", settings.HANGAR_PREVIEW_SCHEME.encode())]  # fmt: skip
        return out

    # -- HTTP -------------------------------------------------------------------------------------

    async def _proxy_http(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.CLIENT)
        headers = [
            (k, v)
            for k, v in self._upstream_headers()
            if k != b"transfer-encoding" or v.lower() == b"chunked"
        ]
        headers.append((b"connection", b"close"))
        try:
            writer.write(
                conn.send(h11.Request(method=self.scope["method"], target=self._target(), headers=headers))
            )
            body_task = asyncio.create_task(self._request_body(conn, writer))
            try:
                await self._response(conn, reader)
            finally:
                await stop(body_task)
        except (h11.ProtocolError, OSError, ConnectionError) as exc:
            log.info("preview %s:%s: %s", self.sandbox_id, self.port, exc)
            if not self.started:
                await self._refuse(Denied(502, "Bad answer from the server",
                                          f"The server on port {self.port} did not answer in HTTP/1.1: {exc}"))  # fmt: skip
            else:
                # Mid-answer: the browser must see an incomplete body, never a complete-looking
                # short one, so the server cuts the connection (dashboard/server.py).
                raise BodyCut(f"the server on port {self.port} broke off its answer: {exc}") from exc
        finally:
            writer.close()

    async def _request_body(self, conn: h11.Connection, writer: asyncio.StreamWriter) -> None:
        while True:
            msg = await self.receive()
            if msg["type"] == "http.disconnect":
                writer.close()
                return
            body = msg.get("body", b"")
            if body and conn.their_state is not h11.CLOSED:
                writer.write(conn.send(h11.Data(data=body)))
            if not msg.get("more_body"):
                writer.write(conn.send(h11.EndOfMessage()))
                await writer.drain()
                return
            await writer.drain()
            await self._activity()

    async def _response(self, conn: h11.Connection, reader: asyncio.StreamReader) -> None:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(READ_CHUNK))
                continue
            if isinstance(event, h11.InformationalResponse):
                continue
            if isinstance(event, h11.Response):
                headers = [(k, v) for k, v in event.headers if k.lower() not in HOP_BY_HOP and k.lower() !=
                           b"transfer-encoding"]  # fmt: skip
                await self.send(
                    {"type": "http.response.start", "status": event.status_code, "headers": headers}
                )
                self.started = True
            elif isinstance(event, h11.Data):
                await self.send({"type": "http.response.body", "body": bytes(event.data), "more_body": True})
                await self._activity()
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                await self.send({"type": "http.response.body", "body": b"", "more_body": False})
                return

    # -- websockets -------------------------------------------------------------------------------

    async def _proxy_websocket(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from websockets.client import ClientProtocol
        from websockets.frames import Close, Opcode
        from websockets.http11 import Response
        from websockets.uri import parse_uri

        await self.receive()  # websocket.connect
        host = self.host.split(":")[0]
        offered = self.scope.get("subprotocols") or None
        proto = ClientProtocol(parse_uri(f"ws://{host}{self._target().decode('latin-1')}"),
                               subprotocols=offered, max_size=16 * 1024 * 1024)  # fmt: skip
        request = proto.connect()
        request.headers["Host"] = self.host
        for k, v in self._upstream_headers():
            if k in (b"host", b"origin", b"cookie", b"authorization", b"user-agent") or k.startswith(
                b"x-forwarded-"
            ):
                with contextlib.suppress(KeyError):
                    del request.headers[k.decode()]
                request.headers[k.decode()] = v.decode("latin-1")
        proto.send_request(request)

        def flush() -> None:
            for data in proto.data_to_send():
                if data:
                    writer.write(data)

        response = None
        early: list[Any] = []  # frames that came with the handshake's answer (a greeting)
        try:
            flush()
            while response is None:
                data = await reader.read(READ_CHUNK)
                if data:
                    proto.receive_data(data)
                else:
                    proto.receive_eof()
                for ev in proto.events_received():
                    if isinstance(ev, Response):
                        response = ev
                    elif response is not None:
                        early.append(ev)
                if not data and response is None:
                    break
        except (OSError, ConnectionError) as exc:
            log.info("preview websocket %s:%s: %s", self.sandbox_id, self.port, exc)
            response = None
        if response is None or proto.handshake_exc is not None:
            log.info(
                "preview websocket %s:%s refused upstream: %s",
                self.sandbox_id,
                self.port,
                proto.handshake_exc,
            )
            await self.send({"type": "websocket.close", "code": 1011})
            writer.close()
            return
        await self.send(
            {"type": "websocket.accept", "subprotocol": response.headers.get("Sec-WebSocket-Protocol")}
        )

        async def downstream() -> None:  # the server → the browser
            parts: list[bytes] = []
            text = False
            pending = early
            while True:
                data = b"-"
                if not pending:
                    data = await reader.read(READ_CHUNK)
                    if data:
                        proto.receive_data(data)
                    else:
                        proto.receive_eof()
                frames, pending = pending + proto.events_received(), []
                for frame in frames:
                    if frame.opcode in (Opcode.TEXT, Opcode.BINARY):
                        parts, text = [frame.data], frame.opcode == Opcode.TEXT
                    elif frame.opcode == Opcode.CONT:
                        parts.append(frame.data)
                    elif frame.opcode == Opcode.CLOSE:
                        close = Close.parse(frame.data) if frame.data else None
                        flush()
                        await self.send({"type": "websocket.close", "code": close.code if close else 1000})
                        return
                    else:
                        continue
                    if frame.fin:
                        msg = b"".join(parts)
                        await self.send(
                            {"type": "websocket.send", **({"text": msg.decode()} if text else {"bytes": msg})}
                        )
                        await self._activity()
                flush()
                await writer.drain()
                if not data:
                    await self.send({"type": "websocket.close", "code": 1006})
                    return

        async def upstream() -> None:  # the browser → the server
            while True:
                msg = await self.receive()
                if msg["type"] == "websocket.receive":
                    if msg.get("text") is not None:
                        proto.send_text(msg["text"].encode())
                    else:
                        proto.send_binary(msg.get("bytes") or b"")
                    flush()
                    await writer.drain()
                    await self._activity()
                elif msg["type"] == "websocket.disconnect":
                    with contextlib.suppress(Exception):
                        proto.send_close(msg.get("code", 1000) if msg.get("code", 1000) < 4999 else 1000)
                        flush()
                        await writer.drain()
                    return

        tasks = [asyncio.create_task(downstream()), asyncio.create_task(upstream())]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            try:
                await stop(*tasks)
            finally:
                writer.close()
