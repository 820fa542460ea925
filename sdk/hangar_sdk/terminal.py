"""Terminals: a shell on a PTY in the sandbox, over the API's websocket
(``/ws/v1/terminals/{id}``): binary frames carry the terminal's bytes both ways, small JSON
text frames resize it and say when it exits. ``websockets`` (a dependency of the package) is
imported only when a terminal is opened."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

from . import _api as api
from ._errors import CommandTimeout, HangarError, NetworkError, error_for
from ._transport import API_PREFIX, Config


def websocket_url(config: Config, terminal_id: str) -> str:
    origin = config.url.removesuffix(API_PREFIX)
    scheme, rest = origin.split("://", 1)
    return f"{'wss' if scheme == 'https' else 'ws'}://{rest}/ws/v1/terminals/{terminal_id}"


def _headers(config: Config) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.token}"}


def _websockets() -> Any:
    try:
        import websockets  # noqa: F401
    except ImportError:
        raise HangarError(
            "terminals need websockets (a dependency of hangar-runtime-sdk): pip install websockets"
        ) from None
    return websockets


class _Screen:
    """What a terminal's frames said: its bytes, kept for ``read_until``, and its exit."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.exit: dict[str, Any] | None = None

    def feed(self, frame: str | bytes) -> bytes:
        if isinstance(frame, bytes):
            return frame
        message = json.loads(frame)
        if message.get("type") == "exit":
            self.exit = message
        elif message.get("type") == "error":
            raise HangarError(f"the terminal refused: {message.get('message', '')}")
        return b""

    def take_all(self) -> bytes:
        out = bytes(self.buffer)
        self.buffer.clear()
        return out

    def take_until(self, marker: bytes) -> bytes | None:
        at = self.buffer.find(marker)
        if at < 0:
            return None
        end = at + len(marker)
        out = bytes(self.buffer[:end])
        del self.buffer[:end]
        return out


def resize_frame(rows: int, cols: int) -> str:
    return json.dumps({"type": "resize", "rows": rows, "cols": cols})


def open_error(terminal_id: str, exc: Exception) -> HangarError:
    """The SDK's exception for a websocket that did not open: the class of the HTTP status it
    was refused with (a proxy's 502, the server's 403…), else a :class:`NetworkError`."""
    ws = _websockets()
    where = f"terminal {terminal_id}: its websocket"
    if isinstance(exc, ws.exceptions.InvalidStatus):
        code = exc.response.status_code
        kind = type(error_for(code, b""))
        return kind(f"{where} was refused with HTTP {code}", status_code=code)
    return NetworkError(f"{where} did not open: {type(exc).__name__}: {exc}")


def closed_error(terminal_id: str, exc: Exception) -> NetworkError:
    """Sending on a websocket that has closed (the server or a proxy between dropped it)."""
    return NetworkError(f"terminal {terminal_id}: its connection closed ({exc})")


class Terminal:
    """A shell on a PTY (``sb.terminal()``). It lives in the sandbox whatever happens to this
    connection; :meth:`kill` ends it, :meth:`close` only leaves."""

    def __init__(self, sandbox: Any, info: dict[str, Any]) -> None:
        _websockets()
        from websockets.sync.client import connect

        self.sandbox = sandbox
        self.id: str = info["id"]
        self.info = info
        config = sandbox._t.config
        # Entered as a context manager: websockets 17 warns about a bare connect(), and the
        # ``legacy`` flag that silences it is unknown to earlier versions.
        try:
            self._ws = connect(websocket_url(config, self.id), additional_headers=_headers(config),
                               open_timeout=30, max_size=None).__enter__()  # fmt: skip
        except BaseException as exc:  # a shell nobody can reach: end it
            with contextlib.suppress(HangarError):  # the server may be what is unreachable
                sandbox._t.json(api.terminal_delete(sandbox.id, self.id))
            if isinstance(exc, Exception):
                raise open_error(self.id, exc) from exc
            raise
        self._screen = _Screen()

    @property
    def exit_code(self) -> int | None:
        return None if self._screen.exit is None else self._screen.exit.get("exit_code")

    @property
    def exit_info(self) -> dict[str, Any] | None:
        """The server's word on how the shell ended (``exit_code``, ``signal``, ``error``), once
        it has; None while it runs, or when the connection closed without one."""
        return self._screen.exit

    def _send(self, frame: str | bytes) -> None:
        try:
            self._ws.send(frame)
        except _websockets().exceptions.ConnectionClosed as exc:
            raise closed_error(self.id, exc) from None

    def send(self, data: str | bytes) -> None:
        """Type into it (``"ls\\n"``, ``b"\\x03"`` for Ctrl-C). A connection that closed is a
        :class:`NetworkError`."""
        self._send(data.encode() if isinstance(data, str) else data)

    def write(self, data: str | bytes) -> None:
        """Type into it: :meth:`send`."""
        self.send(data)

    def resize(self, rows: int, cols: int) -> None:
        self._send(resize_frame(rows, cols))

    def recv(self, timeout: float | None = None) -> bytes:
        """The terminal's next bytes (b"" once it has exited)."""
        if self._screen.buffer:
            return self._screen.take_all()
        while self._screen.exit is None:
            try:
                got = self._screen.feed(self._ws.recv(timeout=timeout))
            except TimeoutError:
                raise CommandTimeout(f"nothing from terminal {self.id} in {timeout} s") from None
            except _websockets().exceptions.ConnectionClosed:
                return b""
            if got:
                return got
        return b""

    def read(self, timeout: float | None = None) -> bytes:
        """What it has printed since the last read, waiting up to ``timeout`` for something
        (b"" once it has exited): :meth:`recv`."""
        return self.recv(timeout)

    def read_until(self, marker: str | bytes, timeout: float = 30.0) -> bytes:
        """Everything up to and including ``marker`` (e.g. a prompt, or a line a command prints)."""
        want = marker.encode() if isinstance(marker, str) else marker
        deadline = time.monotonic() + timeout
        while (out := self._screen.take_until(want)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self._screen.exit is not None:
                raise CommandTimeout(f"{want!r} did not appear in terminal {self.id} within {timeout} s")
            try:
                self._screen.buffer += self._screen.feed(self._ws.recv(timeout=left))
            except TimeoutError:
                continue
        return out

    def close(self) -> None:
        self._ws.close()

    def kill(self) -> None:
        """End its shell (its process group is killed) and close the connection."""
        self.close()
        self.sandbox._t.json(api.terminal_delete(self.sandbox.id, self.id))

    def __enter__(self) -> Terminal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


class AsyncTerminal:
    """:class:`Terminal`, awaited (``await sb.terminal()``)."""

    def __init__(self, sandbox: Any, info: dict[str, Any], ws: Any) -> None:
        self.sandbox = sandbox
        self.id: str = info["id"]
        self.info = info
        self._ws = ws
        self._screen = _Screen()

    @classmethod
    async def open(cls, sandbox: Any, info: dict[str, Any]) -> AsyncTerminal:
        _websockets()
        from websockets.asyncio.client import connect

        config = sandbox._t.config
        try:
            ws = await connect(websocket_url(config, info["id"]), additional_headers=_headers(config),
                               open_timeout=30, max_size=None)  # fmt: skip
        except BaseException as exc:
            with contextlib.suppress(HangarError):
                await sandbox._t.json(api.terminal_delete(sandbox.id, info["id"]))
            if isinstance(exc, Exception):
                raise open_error(info["id"], exc) from exc
            raise
        return cls(sandbox, info, ws)

    @property
    def exit_code(self) -> int | None:
        return None if self._screen.exit is None else self._screen.exit.get("exit_code")

    @property
    def exit_info(self) -> dict[str, Any] | None:
        return self._screen.exit

    async def _send(self, frame: str | bytes) -> None:
        try:
            await self._ws.send(frame)
        except _websockets().exceptions.ConnectionClosed as exc:
            raise closed_error(self.id, exc) from None

    async def send(self, data: str | bytes) -> None:
        await self._send(data.encode() if isinstance(data, str) else data)

    async def write(self, data: str | bytes) -> None:
        """Type into it: :meth:`send`."""
        await self.send(data)

    async def resize(self, rows: int, cols: int) -> None:
        await self._send(resize_frame(rows, cols))

    async def recv(self, timeout: float | None = None) -> bytes:
        """The terminal's next bytes (b"" once it has exited)."""
        import asyncio

        if self._screen.buffer:
            return self._screen.take_all()
        while self._screen.exit is None:
            try:
                got = self._screen.feed(await asyncio.wait_for(self._ws.recv(), timeout))
            except TimeoutError:
                raise CommandTimeout(f"nothing from terminal {self.id} in {timeout} s") from None
            except _websockets().exceptions.ConnectionClosed:
                return b""
            if got:
                return got
        return b""

    async def read(self, timeout: float | None = None) -> bytes:
        """What it has printed since the last read (b"" once it has exited): :meth:`recv`."""
        return await self.recv(timeout)

    async def read_until(self, marker: str | bytes, timeout: float = 30.0) -> bytes:
        import asyncio

        want = marker.encode() if isinstance(marker, str) else marker
        deadline = time.monotonic() + timeout
        while (out := self._screen.take_until(want)) is None:
            left = deadline - time.monotonic()
            if left <= 0 or self._screen.exit is not None:
                raise CommandTimeout(f"{want!r} did not appear in terminal {self.id} within {timeout} s")
            try:
                self._screen.buffer += self._screen.feed(await asyncio.wait_for(self._ws.recv(), left))
            except TimeoutError:
                continue
        return out

    async def close(self) -> None:
        await self._ws.close()

    async def kill(self) -> None:
        await self.close()
        await self.sandbox._t.json(api.terminal_delete(self.sandbox.id, self.id))

    async def __aenter__(self) -> AsyncTerminal:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()
