"""Helpers shared by tests (markers, process helpers)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from runtime.launchers.gvisor.runsc import default_runsc

from . import worker_env

# A node row's launchers for a node that runs gVisor with everything it can do.
GVISOR = {
    "gvisor": {
        "network": True,
        "checkpoint": True,
        "kvm": False,
        "gpu": False,
        "vm": False,
        "max_command_bytes": 1 << 20,
    }
}

requires_runsc = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which(default_runsc()) is None,
    reason="needs root and runsc (gVisor); .ci/run installs runsc and runs as root",
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], object], timeout: float = 30.0, interval: float = 0.05, what: str = "condition"
):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


async def refused_with(comm) -> int:
    """The close code a refused websocket gets. A refusal comes after the handshake is
    accepted: one before it would reach a real client as an HTTP 403, with no code at all."""
    connected, _ = await comm.connect()
    assert connected, "refused at the handshake: a real client sees HTTP 403, not a close code"
    message = await comm.receive_output(5)
    assert message["type"] == "websocket.close", message
    await comm.disconnect()  # as a client does once it has the close (daphne then tells the consumer)
    return message["code"]


def die_with_parent() -> None:
    """In a service's child: get SIGTERM when pytest goes, even if it is killed before its
    fixtures tear down, so no worker is left to steal a later run's tasks."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


# The "internet" of the network tests: a namespace made by the tests (the ``world`` fixture),
# on the benchmarking range, with a web server on each of these two addresses, port 8080. Its
# names and /24 are the run's own (from its data dir), so two runs on one machine never meet,
# and the workers of one `pytest -n` run differ in the /24's last two bits.
_RUN = hashlib.sha1(os.environ["HANGAR_DATA_DIR"].encode()).hexdigest()
WORLD_NS = f"hgtest-world-{_RUN[:6]}"
WORLD_IFACE = f"wld{_RUN[:6]}"  # never a prefix any node matches (h<hex>, hg)
_WORLD_NET = f"198.18.{int(_RUN[6:10], 16) % 64 * 4 + worker_env.INDEX % 4}"
WORLD_GW, WORLD_A, WORLD_B = f"{_WORLD_NET}.1", f"{_WORLD_NET}.2", f"{_WORLD_NET}.3"


# -- a server's memory, and a client that reads slowly -----------------------------------------


def rss_bytes(pid: int) -> int:
    """A process's resident memory now (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"process {pid} has no VmRSS")


def unix_sockets(pid: int) -> int:
    """How many unix sockets the process holds open: a sandbox's agent is reached over one per
    request (its database and Redis connections are TCP)."""
    with open(f"/proc/{pid}/net/unix") as f:
        inodes = {line.split()[6] for line in f.readlines()[1:]}
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            count += link.startswith("socket:[") and link[8:-1] in inodes
    return count


class RssWatch:
    """A process's resident memory sampled every ``interval`` s while in the block: ``start``,
    ``peak`` and ``growth`` (peak less start)."""

    def __init__(self, pid: int, interval: float = 0.01) -> None:
        self.pid, self.interval = pid, interval
        self.start = self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> RssWatch:
        self.start = self.peak = rss_bytes(self.pid)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(self.interval):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        return self.peak - self.start


MiB = 1024 * 1024


class SlowReader:
    """An HTTP/1.1 GET over a plain socket with a small receive buffer, whose body is read 16 KiB
    every 10 ms (at most ~1.6 MB/s): a client on a slow link. The server (``base`` URL) sees
    ``Host: host`` when given (a preview)."""

    def __init__(self, base: str, target: str, headers: dict[str, str] | None = None, host: str = "") -> None:
        url = urlsplit(base)
        self.sock = socket.create_connection((url.hostname, url.port), timeout=60)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
        lines = [f"GET {target} HTTP/1.1", f"Host: {host or url.netloc}", "Connection: close"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        self.sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            data = self.sock.recv(4096)
            assert data, f"the server hung up before answering: {head!r}"
            head += data
        head, self.received = head.split(b"\r\n\r\n", 1)[0], len(head.split(b"\r\n\r\n", 1)[1])
        status_line, *fields = head.decode("latin-1").split("\r\n")
        self.status = int(status_line.split()[1])
        self.headers = {k.strip().lower(): v.strip() for k, v in (f.split(":", 1) for f in fields)}

    def read_slowly(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            data = self.sock.recv(16 * 1024)
            assert data, "the server ended the body early"
            self.received += len(data)
            time.sleep(0.01)

    def read_rest(self) -> int:
        """Read to the end (or a reset) at full speed; the body's length."""
        try:
            while data := self.sock.recv(1024 * 1024):
                self.received += len(data)
        except ConnectionResetError:
            pass
        self.sock.close()
        return self.received

    def close(self) -> None:
        self.sock.close()


@contextlib.contextmanager
def volume_store(root, **sizes_mb: int):
    """A node's volume store in ``root`` with the volumes named (id=size in MB), removed after,
    whatever holder a test left recorded beside them."""
    from runtime.host import volumes
    from runtime.host.volumes import VolumeStore

    store = VolumeStore(root)
    for volume_id, size_mb in sizes_mb.items():
        store.create(volume_id, size_mb)
    try:
        yield store
    finally:
        for volume_id in store.list():
            volumes.holder_path(store.image(volume_id)).unlink(missing_ok=True)
            store.delete(volume_id)
