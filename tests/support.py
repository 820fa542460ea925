"""Helpers shared by tests (markers, process helpers)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Callable

import pytest

from runtime.launchers.gvisor import default_runsc

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


def die_with_parent() -> None:
    """In a service's child: get SIGTERM when pytest goes, even if it is killed before its
    fixtures tear down, so no worker is left to steal a later run's tasks."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


# The "internet" of the network tests: a namespace made by the tests (the ``world`` fixture),
# on the benchmarking range, with a web server on each of these two addresses, port 8080.
WORLD_NS = "hgtest-world"
WORLD_A, WORLD_B = "198.18.0.2", "198.18.0.3"
