"""hangar.internal: the node's door to Hangar for sandboxes allowed through it (harnesses).

A sandbox whose network says ``"hangar": true`` finds ``hangar.internal`` in its /etc/hosts,
pointing at the node's side of its veth; nftables lets it (and no other sandbox) reach this
port there. The stream bridge listens on the port and passes requests on to
``HANGAR_INTERNAL_URL``, but only those for what a harness needs there: the API and the OTLP
endpoints (``PASSED``). The dashboard's pages, ``/login/`` and ``/admin/`` are not for code
in a sandbox, and it gets a 403 for them that never reaches Hangar.

That needs the requests themselves, not bytes: each is parsed here (h11, strict HTTP/1.1
framing: a request with ambiguous framing is refused, not guessed at), its path checked, and
written again to Hangar with framing of this door's own making, so a sandbox cannot smuggle a
second request inside the body of one that was let through. Bodies stream both ways with
back-pressure, so an upload or a followed output costs this process a buffer, not its size.
Connections that do not come from one of the sandboxes' address pools to an address of the
same pool (the host side of a veth) are closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

import h11

from ..aio import within

log = logging.getLogger(__name__)
BUFFER = 64 * 1024
HEAD_MAX = 64 * 1024  # the most a request's line and headers may take
IDLE_S = 120.0  # a connection with no request in flight for this long is closed
UPSTREAM_TIMEOUT_S = 10.0
# What a sandbox may ask Hangar for here: the API, and the OTLP endpoints for its agents'
# telemetry (the MCP and E2B surfaces join this list when they land).
PASSED = ("/api/v1/", "/v1/traces", "/v1/logs")
# Not passed on: they are about this connection, or this door's own business.
HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authorization", b"te", b"trailer",
    b"upgrade", b"transfer-encoding", b"content-length", b"expect",
}  # fmt: skip


def path_passes(target: str) -> bool:
    """Whether a request target is one this door passes on: origin form, under ``PASSED``,
    with no dot segment or encoded slash or dot that could resolve elsewhere further on."""
    if not target.startswith("/"):
        return False  # absolute form (a proxy request), authority form, "*"
    path = target.split("?", 1)[0]
    lowered = path.lower()
    if "%2f" in lowered or "%2e" in lowered or "%5c" in lowered or "\\" in path:
        return False
    if any(seg in (".", "..") for seg in path.split("/")):
        return False
    return any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in PASSED)


class Door:
    def __init__(self, *, port: int, target: str, pools: Iterable[str], bind: str = "0.0.0.0") -> None:
        parts = urlsplit(target)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"HANGAR_INTERNAL_URL must be http(s)://host[:port], got {target!r}")
        self.port, self.bind = port, bind
        self.target_host = parts.hostname
        self.target_port = parts.port or (443 if parts.scheme == "https" else 80)
        self.target_tls = parts.scheme == "https"
        self.pools = [ipaddress.ip_network(pool) for pool in pools]  # one per launcher with networks
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.bind, self.port, reuse_address=True)
        log.info(
            "door: hangar.internal on port %d -> %s:%d (%s)", self.port, self.target_host, self.target_port,
            ", ".join(PASSED),
        )  # fmt: skip

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    def _from_a_sandbox(self, writer: asyncio.StreamWriter) -> bool:
        peer = writer.get_extra_info("peername") or ("", 0)
        local = writer.get_extra_info("sockname") or ("", 0)
        try:
            # From a sandbox's address to the node's side of a sandbox's veth: both in the pool
            # (a connection to the node's own addresses from elsewhere is not for this door).
            addresses = ipaddress.ip_address(peer[0]), ipaddress.ip_address(local[0])
            return any(all(address in pool for address in addresses) for pool in self.pools)
        except ValueError:
            return False

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._from_a_sandbox(writer):
            writer.close()
            return
        client = _Peer(h11.Connection(h11.SERVER, max_incomplete_event_size=HEAD_MAX), reader, writer)
        upstream: _Peer | None = None
        try:
            while True:
                try:
                    event = await within(client.next_event(), IDLE_S)
                except TimeoutError:
                    break
                except h11.RemoteProtocolError as exc:
                    await client.refuse(
                        exc.error_status_hint or 400, f"not a request this door can read: {exc}"
                    )
                    break
                if not isinstance(event, h11.Request):
                    break  # the client closed between requests
                target = event.target.decode("latin-1")
                if not path_passes(target):
                    log.info("door: refused %s %s from %s", event.method.decode("latin-1"), target[:200],
                             writer.get_extra_info("peername"))  # fmt: skip
                    await client.discard_body()
                    await client.refuse(
                        403, f"hangar.internal passes only {', '.join(PASSED)}; not {target[:200]}"
                    )
                else:
                    upstream = await self._exchange(client, event, upstream)
                    if upstream is None and client.conn.our_state is not h11.DONE:
                        break
                if client.conn.our_state is h11.MUST_CLOSE or client.conn.their_state is h11.MUST_CLOSE:
                    break
                if client.conn.our_state is not h11.DONE or client.conn.their_state is not h11.DONE:
                    break
                client.conn.start_next_cycle()
        except (ConnectionError, OSError, h11.ProtocolError) as exc:
            log.debug("door: connection ended: %s", exc)
        finally:
            for peer in (client, upstream):
                if peer is not None:
                    peer.close()

    async def _exchange(self, client: _Peer, request: h11.Request, upstream: _Peer | None) -> _Peer | None:
        """One request through to Hangar and its answer back; returns the upstream connection
        if it can carry the next request."""
        if upstream is None or upstream.conn.our_state is not h11.IDLE:
            if upstream is not None:
                upstream.close()
            try:
                up_reader, up_writer = await within(
                    asyncio.open_connection(self.target_host, self.target_port, ssl=self.target_tls or None),
                    UPSTREAM_TIMEOUT_S,
                )
            except (OSError, TimeoutError) as exc:
                log.warning(
                    "door: Hangar at %s:%d is unreachable: %s", self.target_host, self.target_port, exc
                )
                await client.discard_body()
                await client.refuse(502, "Hangar is unreachable from this node")
                return None
            upstream = _Peer(h11.Connection(h11.CLIENT), up_reader, up_writer)
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
        for k, v in request.headers:
            # The body's framing, as h11 read it: passed on in this door's own writing.
            if k.lower() == b"content-length":
                headers.append((b"content-length", v))
                break
        else:
            if any(k.lower() == b"transfer-encoding" for k, _ in request.headers):
                headers.append((b"transfer-encoding", b"chunked"))
        await upstream.send(h11.Request(method=request.method, target=request.target, headers=headers))
        if client.conn.they_are_waiting_for_100_continue:
            await client.send(h11.InformationalResponse(status_code=100, headers=[]))
        sending = asyncio.ensure_future(self._pump_body(client, upstream))
        try:
            response = await upstream.next_event()
            while isinstance(response, h11.InformationalResponse):
                response = await upstream.next_event()
            if not isinstance(response, h11.Response):
                raise ConnectionError("Hangar closed the connection without an answer")
            out = [(k, v) for k, v in response.headers if k.lower() not in HOP_BY_HOP]
            for k, v in response.headers:
                if k.lower() == b"content-length":
                    out.append((b"content-length", v))
                    break
            await client.send(
                h11.Response(status_code=response.status_code, headers=out, reason=response.reason)
            )
            while True:
                event = await upstream.next_event()
                if isinstance(event, h11.Data):
                    await client.send(h11.Data(data=event.data))
                elif isinstance(event, h11.EndOfMessage):
                    await client.send(h11.EndOfMessage())
                    break
                else:
                    raise ConnectionError("Hangar closed the connection in the middle of an answer")
            await sending
        except BaseException:
            sending.cancel()
            upstream.close()
            raise
        if upstream.conn.our_state is h11.DONE and upstream.conn.their_state is h11.DONE:
            upstream.conn.start_next_cycle()
            return upstream
        upstream.close()
        return None

    @staticmethod
    async def _pump_body(client: _Peer, upstream: _Peer) -> None:
        while True:
            event = await client.next_event()
            if isinstance(event, h11.Data):
                await upstream.send(h11.Data(data=event.data))
            elif isinstance(event, h11.EndOfMessage):
                await upstream.send(h11.EndOfMessage())
                return
            else:
                raise ConnectionError("the sandbox closed the connection in the middle of a request")


class _Peer:
    """One side of the door: an h11 connection over a stream, read and written with
    back-pressure."""

    def __init__(
        self, conn: h11.Connection, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.conn, self.reader, self.writer = conn, reader, writer

    async def next_event(self) -> h11.Event | type[h11.PAUSED] | type[h11.NEED_DATA]:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            self.conn.receive_data(await self.reader.read(BUFFER))

    async def send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            self.writer.write(data)
            await self.writer.drain()

    async def discard_body(self) -> None:
        """Read the rest of a refused request (up to a bound), so the connection can go on."""
        left = 1024 * 1024
        while self.conn.their_state is h11.SEND_BODY and left > 0:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                left -= len(event.data)
            elif not isinstance(event, h11.EndOfMessage):
                break

    async def refuse(self, status: int, message: str) -> None:
        if self.conn.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        body = json.dumps({"detail": message}).encode()
        keep = self.conn.their_state is h11.DONE
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if not keep:
            headers.append((b"connection", b"close"))
        with contextlib.suppress(h11.LocalProtocolError):
            await self.send(h11.Response(status_code=status, headers=headers))
            await self.send(h11.Data(data=body))
            await self.send(h11.EndOfMessage())

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
