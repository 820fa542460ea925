"""hangar.internal's forwarder on its own: bytes both ways for peers in the sandboxes' pool,
nothing for anyone else."""

from __future__ import annotations

import asyncio

from runtime.gateway import Gateway

from .support import free_port


async def _echo_server() -> tuple[asyncio.base_events.Server, int]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(b"echo:" + data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def _exchange(pool: str) -> bytes:
    async def main() -> bytes:
        upstream, up_port = await _echo_server()
        port = free_port()
        gw = Gateway(port=port, target=f"http://127.0.0.1:{up_port}", pool=pool, bind="127.0.0.1")
        await gw.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"hello")
            await writer.drain()
            try:
                return await asyncio.wait_for(reader.read(100), 5)
            except ConnectionResetError:
                return b""  # closed with our bytes unread: a reset
            finally:
                writer.close()
        finally:
            await gw.close()
            upstream.close()

    return asyncio.run(main())


def test_a_peer_in_the_pool_reaches_hangar_through_it():
    assert _exchange("127.0.0.0/8") == b"echo:hello"


def test_a_peer_outside_the_pool_is_closed_at_once():
    assert _exchange("10.88.0.0/16") == b""
