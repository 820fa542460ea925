"""How the host reaches a sandbox's agent: one new stream connection per request.

gVisor's agent listens on a unix socket that is a real host socket (runsc's
``--host-uds=create``): :class:`UnixTransport`. A VM's agent would be reached over vsock or a
virtio-serial port (or a unix socket that QEMU connects to one): a transport of its own, with
the same two methods, and the client and everything above it unchanged.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from typing import Protocol


class Transport(Protocol):
    def connect(self, timeout: float) -> socket.socket:
        """A new connected stream to the agent, with ``timeout`` as its socket timeout. Raises
        :class:`BlockingIOError` when the agent's backlog is full (busy, not gone: try again),
        another :class:`OSError` (or ValueError) when nothing accepts there."""
        ...

    def listening(self) -> bool:
        """Whether the agent listens now, told without a round trip where the transport can."""
        ...


class UnixTransport:
    """A unix socket at ``path`` on the host, in a directory the sandbox can write to."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __str__(self) -> str:
        return self.path

    def __repr__(self) -> str:
        return f"UnixTransport({self.path!r})"

    def connect(self, timeout: float) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            # The socket's directory is one the sandbox writes in: never follow a symlink there
            # (it could aim at one of the host's own sockets), and connect only to a socket.
            # Connecting through /proc/self/fd also reaches a socket deeper than sun_path's 107 bytes.
            fd = os.open(self.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                    raise ConnectionRefusedError(errno.ECONNREFUSED, f"{self.path} is not a socket")
                sock.connect(f"/proc/self/fd/{fd}")
            finally:
                os.close(fd)
        except BaseException:
            sock.close()
            raise
        return sock

    def listening(self) -> bool:
        # The agent binds under a temporary name and renames the socket into place: its path
        # exists only once it listens.
        try:
            return stat.S_ISSOCK(os.lstat(self.path).st_mode)
        except OSError:
            return False
