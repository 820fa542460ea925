"""What the launcher tests share: which launchers to run them against, how to make one with a
state of its own, and how to check a sandbox left nothing behind (through the public interface
and the host's own tables, never a launcher's internals)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from runtime.launchers.base import ExecRequest, Launcher, ProcessRequest
from runtime.launchers.registry import launcher_class, launcher_names, new_launcher


def usable_launchers() -> list[str]:
    """Every registered launcher whose own probe passes here: gVisor, the reduced test
    registration of it (tests/launchers/reduced.py, registered by tests/settings.py), and the
    microVM launcher where QEMU and its guest kernel are installed."""
    return [name for name in launcher_names() if launcher_class(name).probe({}) is None]


def make_launcher(name: str, state_dir: Path, agent_cache_dir: Path, **config: Any) -> Launcher:
    """A launcher with a state dir (so names, a node id and a pool) of its own: it cannot meet
    the test node's sandboxes, or another run's."""
    return new_launcher(name, state_dir=str(state_dir), agent_cache_dir=str(agent_cache_dir), **config)


def remove_all(launcher: Launcher, *, network: bool = True) -> None:
    """Destroy every sandbox of a test's own launcher, its spares, and (``network``) its node's
    nftables tables and address pool: a launcher of a test has a node id of its own, so what it
    leaves is never reused."""
    for sandbox_id in launcher.states():
        launcher.destroy(launcher.handle_for(sandbox_id))
    launcher.release_spares()
    if network and (net := getattr(launcher, "network", None)) is not None:
        net.remove_base()


def loop_backing_files() -> list[str]:
    files = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        with contextlib.suppress(OSError):
            files.append(backing.read_text().strip())
    return files


def assert_nothing_left(launcher: Launcher, sandbox_id: str) -> None:
    assert sandbox_id not in launcher.states()
    with open("/proc/self/mountinfo") as f:
        assert sandbox_id not in f.read()
    # Its disk's loop device goes once the kernel has let go of the (lazily unmounted) disk.
    wait_until_true(lambda: not [f for f in loop_backing_files() if sandbox_id in f], 10)


def wait_until_true(check: Callable[[], object], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@contextlib.contextmanager
def listener(launcher: Launcher, handle: Any, address: str, port: int, reply: str = "hi") -> Iterator[None]:
    """A server on ``port`` in the sandbox for as long as the block runs (an exec's leftover
    processes end with it: this is a process of its own), answering ``reply`` to whoever
    connects; it has answered on ``address``, the sandbox's own, before the block starts, so a
    connection refused from elsewhere is the network's doing, not a server that never ran."""
    proc = launcher.open_process(handle, ProcessRequest(argv=["nc", "-ll", "-p", str(port), "-e", "echo", reply],
                                                        stdin=False))  # fmt: skip
    try:
        probe = ExecRequest(argv=["sh", "-c", f"nc -w 2 {address} {port} </dev/null"], timeout=20)
        wait_until_true(lambda: reply.encode() in launcher.exec(handle, probe).stdout, 20)
        yield
    finally:
        proc.close()
