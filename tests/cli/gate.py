"""A TCP proxy in front of the real test server, as a reverse proxy stands in front of a real
Hangar: HTTP passes through untouched; a websocket upgrade is refused with an HTTP status (a
proxy not set up for websockets) or passed through and later cut (a proxy's idle timeout, a
network that drops). Not a fake server: every answer that passes comes from the real one."""

from __future__ import annotations

import contextlib
import socket
import threading
from urllib.parse import urlsplit


class WebsocketGate:
    def __init__(self, upstream: str, *, refuse_websockets: int | None = None) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.refuse = refuse_websockets
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.websockets: list[tuple[socket.socket, socket.socket]] = []
        self.upgrades = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="gate-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = client.recv(65536)
            if not chunk:
                client.close()
                return
            head += chunk
        upgrade = b"upgrade: websocket" in head.lower()
        if upgrade:
            with self._lock:
                self.upgrades += 1
        if upgrade and self.refuse is not None:
            client.sendall(
                f"HTTP/1.1 {self.refuse} Refused\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".encode()
            )
            client.close()
            return
        upstream = socket.create_connection(self.upstream)
        upstream.sendall(head)
        if upgrade:
            with self._lock:
                self.websockets.append((client, upstream))
        threading.Thread(target=self._pipe, args=(upstream, client), daemon=True).start()
        self._pipe(client, upstream)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                dst.sendall(chunk)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def cut(self) -> None:
        """Drop every websocket that passed, both ways, with no closing handshake."""
        with self._lock:
            pairs, self.websockets = self.websockets, []
        for pair in pairs:
            for s in pair:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        self.cut()
