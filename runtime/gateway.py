"""hangar.internal: the node's door to Hangar for sandboxes allowed through it (harnesses).

A sandbox whose network says ``"hangar": true`` finds ``hangar.internal`` in its /etc/hosts,
pointing at the node's side of its veth; nftables lets it (and no other sandbox) reach this
port there. The stream bridge listens on the port and forwards each connection, bytes as
they are, to ``HANGAR_INTERNAL_URL`` (the API and the OTLP endpoint behind it): what the
sandbox may do there is what its API token allows. Connections that do not come from the
sandboxes' address pool to an address of it (the host side of a veth) are closed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
from urllib.parse import urlsplit

log = logging.getLogger(__name__)
BUFFER = 64 * 1024


class Gateway:
    def __init__(self, *, port: int, target: str, pool: str, bind: str = "0.0.0.0") -> None:
        parts = urlsplit(target)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"HANGAR_INTERNAL_URL must be http(s)://host[:port], got {target!r}")
        self.port, self.bind = port, bind
        self.target_host = parts.hostname
        self.target_port = parts.port or (443 if parts.scheme == "https" else 80)
        self.pool = ipaddress.ip_network(pool)
        self.server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.bind, self.port, reuse_address=True)
        log.info(
            "gateway: hangar.internal on port %d -> %s:%d", self.port, self.target_host, self.target_port
        )

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        local = writer.get_extra_info("sockname") or ("", 0)
        try:
            # From a sandbox's address to the node's side of a sandbox's veth: both in the pool
            # (a connection to the node's own addresses from elsewhere is not for this door).
            allowed = (
                ipaddress.ip_address(peer[0]) in self.pool and ipaddress.ip_address(local[0]) in self.pool
            )
        except ValueError:
            allowed = False
        if not allowed:
            writer.close()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(self.target_host, self.target_port), 10
            )
        except (OSError, TimeoutError) as exc:
            log.warning(
                "gateway: Hangar at %s:%d is unreachable: %s", self.target_host, self.target_port, exc
            )
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            with contextlib.suppress(Exception):
                await writer.drain()
            writer.close()
            return
        await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer), return_exceptions=True)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(BUFFER):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            if reader.at_eof():
                writer.close()
