"""hangar.internal's door on its own, against a real HTTP server standing in for Hangar: it
passes the API and OTLP paths for peers in the sandboxes' pool, and nothing else; requests are
parsed and written again, so nothing can be smuggled past the path check."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from runtime.node.door import Door, path_passes
from tests.support import free_port


class _Upstream(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            while (size := int(self.rfile.readline().strip(), 16)) > 0:
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        self.seen.append(f"{self.command} {self.path}")
        if self.path.startswith("/api/v1/stream"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                chunk = f"line {i}\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            self.wfile.write(b"0\r\n\r\n")
            return
        out = json.dumps(
            {"path": self.path, "body": body.decode(), "host": self.headers.get("Host")}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def door() -> Iterator[tuple[int, list[str]]]:
    """A door for the 127.0.0.0/8 "pool" in a thread of its own, before a real HTTP server."""
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    _Upstream.seen = []
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    loop = asyncio.new_event_loop()
    gw = Door(port=port, target=f"http://127.0.0.1:{upstream.server_address[1]}", pools=["127.0.0.0/8"],
                 bind="127.0.0.1")  # fmt: skip
    loop.run_until_complete(gw.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield port, _Upstream.seen
    asyncio.run_coroutine_threadsafe(gw.close(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    upstream.shutdown()


def _raw(port: int, data: bytes, *, read_for: float = 1.0) -> bytes:
    async def main() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        out = b""
        try:
            while chunk := await asyncio.wait_for(reader.read(65536), read_for):
                out += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        writer.close()
        return out

    return asyncio.run(main())


def test_the_api_and_otlp_paths_pass_with_their_bodies(door):
    port, seen = door
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as c:
        r = c.post("/api/v1/sandboxes?x=1", json={"image": "busybox"})
        assert r.status_code == 200 and r.json()["path"] == "/api/v1/sandboxes?x=1"
        assert json.loads(r.json()["body"]) == {"image": "busybox"}
        assert c.post("/v1/traces", content=b"\x0a\x00").status_code == 200
        assert c.post("/v1/logs", content=(b"x" for _ in range(3))).json()["body"] == "xxx"  # chunked
        with c.stream("GET", "/api/v1/stream") as r:
            assert list(r.iter_lines()) == ["line 0", "line 1", "line 2"]
    assert seen == ["POST /api/v1/sandboxes?x=1", "POST /v1/traces", "POST /v1/logs", "GET /api/v1/stream"]


@pytest.mark.parametrize("path", ["/login/", "/admin/", "/admin/login/?next=/", "/", "/sandboxes/", "/static/x.js",
                                  "/api/v1/../../admin/", "/api/v1/%2e%2e/%2e%2e/admin/", "/api/v1%2f..%2fadmin",
                                  "/v1/tracesX", "/api/v2/x"])  # fmt: skip
def test_pages_login_and_admin_never_reach_hangar(door, path):
    port, seen = door
    r = httpx.get(f"http://127.0.0.1:{port}{path}", timeout=10)
    assert r.status_code == 403 and "passes only" in r.json()["detail"]
    assert seen == []


def test_a_refused_request_leaves_the_connection_usable_and_unsmuggled(door):
    """On one connection: a refused request, then an allowed one; and a body that holds a
    second request is passed on as a body, never as a request."""
    port, seen = door
    smuggled = b"GET /admin/ HTTP/1.1\r\nHost: x\r\n\r\n"
    out = _raw(port, b"GET /login/ HTTP/1.1\r\nHost: hangar.internal\r\n\r\n"
                     b"POST /api/v1/x HTTP/1.1\r\nHost: hangar.internal\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(smuggled), smuggled))  # fmt: skip
    assert out.startswith(b"HTTP/1.1 403") and b"HTTP/1.1 200" in out
    assert seen == ["POST /api/v1/x"]
    # Framing that could be read two ways is refused outright.
    out = _raw(
        port, b"POST /api/v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nContent-Length: 40\r\n\r\nhello"
    )
    assert out.startswith(b"HTTP/1.1 400")
    assert seen == ["POST /api/v1/x"]


def test_absolute_and_odd_request_targets_are_refused():
    for target in (
        "http://127.0.0.1:8000/admin/",
        "127.0.0.1:8000",
        "*",
        "/api/v1\\..\\admin",
        "/api/v1/./x",
    ):
        assert not path_passes(target), target
    for target in ("/api/v1/", "/api/v1", "/api/v1/sandboxes/sb1/exec?x=../y", "/v1/traces", "/v1/logs"):
        assert path_passes(target), target


def test_a_peer_outside_the_pool_is_closed_at_once():
    async def main() -> bytes:
        port = free_port()
        gw = Door(port=port, target="http://127.0.0.1:9", pools=["10.88.0.0/16"], bind="127.0.0.1")
        await gw.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /api/v1/ HTTP/1.1\r\nHost: x\r\n\r\n")
            await writer.drain()
            try:
                return await asyncio.wait_for(reader.read(100), 5)
            except ConnectionResetError:
                return b""
            finally:
                writer.close()
        finally:
            await gw.close()

    assert asyncio.run(main()) == b""
