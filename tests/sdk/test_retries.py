"""What the SDK sends twice and what it never does. A call that may have reached the server (no
answer in time, the connection reset after the request went out, a 502/503) is sent again
only when it is idempotent: a command (``exec``) is never run twice. The server here is a
stub that counts the requests reaching it (``CountingStub``): the real server cannot be made
to hang, reset or answer 503 on cue. A 429 with Retry-After from the real server, and a
refused connection, are in test_errors.py."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest

from hangar_sdk import _api as api
from hangar_sdk._errors import NetworkError, ServerError
from hangar_sdk._transport import MAX_TRIES, Config, Transport

pytestmark = pytest.mark.timeout(60)


class CountingStub:
    """An HTTP listener that reads each request whole, counts it, then does ``mode``: answer
    503, say nothing for a while (a read timeout), or reset the connection."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests: list[str] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                           if line.startswith(b"content-length:")), 0)  # fmt: skip
            while len(body) < length:
                body += conn.recv(65536)
            self.requests.append(" ".join(head.split(b"\r\n")[0].decode().split()[:2]))
            if self.mode == "503":
                conn.sendall(b'HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n'
                             b'Content-Length: 22\r\nConnection: close\r\n\r\n{"detail": "no room"}\n')  # fmt: skip
            elif self.mode == "hang":
                time.sleep(3)
            elif self.mode == "reset":  # an RST, not a FIN: "connection reset by peer"
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))

    def count(self, method: str) -> int:
        return sum(r.startswith(method + " ") for r in self.requests)

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def stub(request) -> Iterator[CountingStub]:
    server = CountingStub(request.param)
    yield server
    server.close()


def _exec(read_timeout: float | None = None) -> api.Call:
    call = api.exec_call("sb1", cmd="echo once >> /tmp/ran", cwd=None, env=None, stdin=None, timeout_s=5)
    return call if read_timeout is None else replace(call, read_timeout=read_timeout)


def _get(read_timeout: float | None = None) -> api.Call:
    call = api.sandbox_get("sb1")
    return call if read_timeout is None else replace(call, read_timeout=read_timeout)


@pytest.mark.parametrize("stub", ["hang"], indirect=True)
def test_a_command_is_not_sent_again_after_a_read_timeout(stub):
    t = Transport(Config(url=f"{stub.url}/api/v1", token="hgr_x"))
    try:
        with pytest.raises(NetworkError, match="ReadTimeout"):
            t.json(_exec(read_timeout=0.5))
        assert stub.requests == ["POST /api/v1/sandboxes/sb1/exec"]  # once: it may be running
        with pytest.raises(NetworkError):
            t.json(_get(read_timeout=0.5))
        assert stub.count("GET") == MAX_TRIES  # a read may be asked again
    finally:
        t.close()


@pytest.mark.parametrize("stub", ["reset"], indirect=True)
def test_a_command_is_not_sent_again_after_the_connection_reset_once_it_was_sent(stub):
    t = Transport(Config(url=f"{stub.url}/api/v1", token="hgr_x"))
    try:
        with pytest.raises(NetworkError):
            t.json(_exec())
        assert stub.count("POST") == 1
        with pytest.raises(NetworkError):
            t.json(_get())
        assert stub.count("GET") == MAX_TRIES
    finally:
        t.close()


@pytest.mark.parametrize("stub", ["503"], indirect=True)
def test_a_command_is_not_sent_again_after_a_503(stub):
    t = Transport(Config(url=f"{stub.url}/api/v1", token="hgr_x"))
    try:
        with pytest.raises(ServerError) as e:
            t.json(_exec())
        assert e.value.status_code == 503 and e.value.message == "no room"
        assert stub.count("POST") == 1
        with pytest.raises(ServerError):
            t.json(_get())
        assert stub.count("GET") == MAX_TRIES
    finally:
        t.close()
