"""Tunnels between machines: how a Hangar server reaches a port inside a sandbox that runs on
another node (a preview URL's request).

Each node's bridge (``hangar node``) listens on ``HANGAR_TUNNEL_PORT`` when it is set, and
registers ``HANGAR_NODE_ADDRESS:HANGAR_TUNNEL_PORT`` as the node's ``tunnel_address``. A
server opens a TCP connection there and sends one line of JSON, ``{"sandbox", "port",
"expires", "sig"}``, signed with HMAC-SHA256 under the ``SECRET_KEY`` every machine of a
Hangar shares (valid for 30 s); the node checks it, checks that the sandbox runs on it,
opens its launcher's tunnel to the port (:meth:`Launcher.open_tunnel`) and answers ``OK`` (or
``ERR <reason>``, ``REFUSED <reason>`` when nothing listens there), after which the connection
carries the raw bytes both ways. Only sandbox ports are reachable this way, and only with a
signature: keep the port on the machines' private network all the same. The same port serves
another node copying a paused sandbox that moves there (:mod:`.moves`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from typing import Any

from django.conf import settings

from ..aio import within

log = logging.getLogger("hangar.tunnels")
VALID_S = 30
LINE_LIMIT = 2048


class TunnelError(Exception):
    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


def _sig(sandbox_id: str, port: int, expires: int) -> str:
    key = hashlib.sha256(b"hangar.tunnel:" + settings.SECRET_KEY.encode()).digest()
    return hmac.new(key, f"{sandbox_id}:{port}:{expires}".encode(), hashlib.sha256).hexdigest()


def request_line(sandbox_id: str, port: int) -> bytes:
    expires = int(time.time()) + VALID_S
    body = {"sandbox": sandbox_id, "port": port, "expires": expires, "sig": _sig(sandbox_id, port, expires)}
    return json.dumps(body).encode() + b"\n"


def check_line(line: bytes) -> tuple[str, int]:
    """(sandbox id, port) of a request line, or ValueError."""
    body = json.loads(line)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    sandbox_id, port, expires = str(body["sandbox"]), int(body["port"]), int(body["expires"])
    if not hmac.compare_digest(str(body.get("sig", "")), _sig(sandbox_id, port, expires)):
        raise ValueError("bad signature")
    if not time.time() <= expires <= time.time() + VALID_S + 5:
        raise ValueError("expired")
    return sandbox_id, port


async def open_local(
    runtime: str, handle: dict[str, Any], port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A tunnel to the port of a sandbox on this node (``handle``: its row's), through its launcher."""
    from ..launchers.base import FileOpError, LauncherError
    from .local import launcher_for

    try:
        sock = await asyncio.to_thread(launcher_for(runtime).open_tunnel, handle, port)
    except FileOpError as exc:
        raise TunnelError(exc.message, refused=exc.errno_name == "ECONNREFUSED") from None
    except LauncherError as exc:
        raise TunnelError(str(exc)) from None
    sock.setblocking(False)
    return await asyncio.open_connection(sock=sock, limit=65536)


async def open_remote(
    address: str, sandbox_id: str, port: int
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A tunnel through the node at ``address`` (host:port)."""
    host, _, tport = address.rpartition(":")
    try:
        reader, writer = await within(asyncio.open_connection(host, int(tport), limit=65536), 10)
    except (OSError, ValueError, TimeoutError) as exc:
        raise TunnelError(f"cannot reach the node's tunnel at {address}: {exc}") from None
    writer.write(request_line(sandbox_id, port))
    try:
        answer = await within(reader.readline(), 30)
    except (OSError, TimeoutError) as exc:
        writer.close()
        raise TunnelError(f"the node's tunnel at {address} did not answer: {exc}") from None
    if answer.strip() == b"OK":
        return reader, writer
    writer.close()
    kind, _, reason = answer.decode(errors="replace").strip().partition(" ")
    raise TunnelError(reason or "the node refused the tunnel", refused=kind == "REFUSED")


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close the other side."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ConnectionError):
        pass


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, node_name: str) -> None:
    from asgiref.sync import sync_to_async

    from ..models import Sandbox

    try:
        line = await within(reader.readline(), 10)
        if len(line) > LINE_LIMIT:
            raise ValueError("request too long")
        body = json.loads(line)
        if isinstance(body, dict) and "move" in body:  # another node copying a paused sandbox
            from . import moves

            try:
                await moves.serve(body, writer, node_name)
            finally:
                writer.close()
            return
        sandbox_id, port = check_line(line)
    except (ValueError, KeyError, TypeError, TimeoutError, OSError) as exc:
        log.warning("tunnel from %s refused: %s", writer.get_extra_info("peername"), exc)
        writer.write(b"ERR a bad tunnel request\n")
        writer.close()
        return
    row: Any = await sync_to_async(
        lambda: Sandbox.objects.filter(id=sandbox_id, node__name=node_name, status=Sandbox.Status.RUNNING)
        .values_list("runtime", "handle").first(), thread_sensitive=False,
    )()  # fmt: skip
    if not row or not row[1]:
        writer.write(f"ERR sandbox {sandbox_id} is not running on node {node_name}\n".encode())
        writer.close()
        return
    try:
        up_reader, up_writer = await open_local(row[0], row[1], port)
    except TunnelError as exc:
        writer.write(f"{'REFUSED' if exc.refused else 'ERR'} {exc}\n".encode())
        writer.close()
        return
    writer.write(b"OK\n")
    try:
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
    finally:
        for w in (writer, up_writer):
            with contextlib.suppress(Exception):
                w.close()


async def serve(host: str, port: int, node_name: str) -> asyncio.Server:
    server = await asyncio.start_server(lambda r, w: _handle(r, w, node_name), host, port, limit=65536)
    log.info("tunnels for node %s on %s:%d", node_name, host, port)
    return server
