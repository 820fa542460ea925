"""The suite across several processes (`pytest -n N`, pytest-xdist, as ``scripts/run-tests.sh``
runs it): each worker is a node of its own on this machine (``tests/worker_env.py``), modules go
to workers whole (``--dist loadfile``), the longest first, and a test marked ``alone`` (it
measures the host as a whole: its disk, its load) runs while no other worker's test does.

Registered by ``tests/conftest.py`` in the controller and in each worker (and in a run without
``-n``, where the turns are no-ops and the rest works as before)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import worker_env

# Modules that take a minute or more on the 2-core development machine (seconds, from a
# `--junitxml` run), the longest first: they are handed out first, so that no worker is left
# with a long one at the end while the others idle. The rest follow in collection order.
LONGEST_FIRST = [
    "tests/reliability/test_escape.py",  # its `alone` bombs early, beside the next one's short tests
    "tests/launchers/test_conformance.py",  # one `alone` test
    "tests/reliability/test_load.py",
    "tests/reliability/test_bad_input.py",  # schemathesis: its --max-time 400
    "tests/api/test_harness_agents.py",
    "tests/reliability/test_fleet.py",
    "tests/reliability/test_neighbours.py",
    "tests/reliability/test_authorization.py",
    "tests/reliability/test_faults.py",
    "tests/launchers/test_network.py",
    "tests/api/test_sandboxes_api.py",
]

# How long a test waits for its turn on the host before failing (an `alone` test waits for the
# other workers' tests in progress to end; theirs, for the `alone` test's).
TURN_WAIT_S = 1500.0


def run_id() -> str:
    """This run's, shared by its controller and workers (set before the workers start)."""
    return os.environ["HANGAR_TEST_RUN_ID"]


def _turn_files() -> tuple[Path, Path]:
    base = Path(tempfile.gettempdir()) / f"hangar-tests-{run_id()}"
    return base.with_suffix(".turnstile"), base.with_suffix(".host")


def pytest_configure(config) -> None:
    if not worker_env.WORKER:  # the controller, or a run without -n: workers inherit it
        os.environ["HANGAR_TEST_RUN_ID"] = uuid.uuid4().hex[:12]


def pytest_unconfigure(config) -> None:
    if not worker_env.WORKER:
        for path in _turn_files():
            path.unlink(missing_ok=True)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    """In a worker: the modules in ``LONGEST_FIRST``'s order, then the rest as collected, each
    module's tests together (``--no-loadscope-reorder`` keeps this order for the controller)."""
    if not worker_env.WORKER:
        return
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_module(item.nodeid), len(first_seen))
    items.sort(key=lambda item: (rank.get(_module(item.nodeid), len(rank)), first_seen[_module(item.nodeid)]))


def _lock(path: Path, how: int, what: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + TURN_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(fd, how | fcntl.LOCK_NB)
                return fd
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"waited {TURN_WAIT_S:.0f} s for {what} ({path}): another worker held it"
                    ) from None
                time.sleep(0.05)
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def host_turn(alone: bool) -> Iterator[None]:
    """Every test of a worker holds the host shared; an ``alone`` test holds it exclusively.
    The turnstile (held only while taking the host) keeps a stream of shared holders from
    starving an exclusive one: once an ``alone`` test waits, no new test starts beside it."""
    turnstile_path, host_path = _turn_files()
    turnstile = _lock(turnstile_path, fcntl.LOCK_EX, "the turnstile")
    try:
        host = _lock(host_path, fcntl.LOCK_EX if alone else fcntl.LOCK_SH, "the host")
    except BaseException:
        os.close(turnstile)
        raise
    if not alone:
        os.close(turnstile)  # closing the descriptor releases its lock
    try:
        yield
    finally:
        os.close(host)
        if alone:
            os.close(turnstile)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The whole of a test's turn: its setup (module and session fixtures included, which the
    first test of a module sets up), call and teardown. A test marked ``beside_alone`` takes no
    turn: it neither writes much to the host's disk nor measures the host (schemathesis against
    the API for its fixed 400 s), so an ``alone`` test need not wait for it to end."""
    if not worker_env.WORKER or item.get_closest_marker("beside_alone") is not None:
        return (yield)
    with contextlib.ExitStack() as turn:
        try:
            turn.enter_context(host_turn(alone=item.get_closest_marker("alone") is not None))
        except RuntimeError as exc:  # no turn in TURN_WAIT_S: this test fails, the run goes on
            why = str(exc)
            item.runtest = lambda: pytest.fail(why, pytrace=False)
        return (yield)
