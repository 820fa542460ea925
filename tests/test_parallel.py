"""The suite across processes (tests/parallel.py): an ``alone`` test's turn on the host waits for
the other workers' tests in progress and holds off their next ones, and a stream of ordinary
tests cannot keep it waiting. Real processes, as xdist's workers are."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from tests import parallel


def _turn(run_id: str, alone: bool, log: str, name: str, release: str) -> None:
    """A test's turn: in, then out once ``release`` exists (or at once when it is "")."""
    os.environ["HANGAR_TEST_RUN_ID"] = run_id
    with open(log, "a") as f:
        f.write(f"{name} asks {time.monotonic():.3f}\n")
    with parallel.host_turn(alone=alone):
        with open(log, "a") as f:
            f.write(f"{name} in {time.monotonic():.3f}\n")
        while release and not os.path.exists(release):
            time.sleep(0.02)
        time.sleep(0.1)
        with open(log, "a") as f:
            f.write(f"{name} out {time.monotonic():.3f}\n")


def _events(log: Path) -> dict[str, dict[str, float]]:
    seen: dict[str, dict[str, float]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            name, what, at = line.split()
            seen.setdefault(name, {})[what] = float(at)
    return seen


def _wait(log: Path, name: str, what: str) -> None:
    deadline = time.monotonic() + 30
    while what not in _events(log).get(name, {}):
        assert time.monotonic() < deadline, f"{name} never logged {what!r}: {_events(log)}"
        time.sleep(0.02)


def test_an_alone_turn_waits_for_the_others_and_holds_off_new_ones(tmp_path, monkeypatch):
    run_id = f"selftest-{os.getpid()}-{time.monotonic_ns()}"
    monkeypatch.setenv("HANGAR_TEST_RUN_ID", run_id)
    log, release = tmp_path / "log", tmp_path / "release"
    ctx = multiprocessing.get_context("spawn")
    procs = []

    def start(name: str, alone: bool = False, held: bool = False) -> None:
        p = ctx.Process(target=_turn, args=(run_id, alone, str(log), name, str(release) if held else ""))
        p.start()
        procs.append(p)

    try:
        # Two ordinary tests in progress at once, held until released.
        start("a", held=True)
        start("b", held=True)
        _wait(log, "a", "in")
        _wait(log, "b", "in")
        # An alone one asks while they run; then ordinary ones ask while it waits.
        start("alone", alone=True)
        _wait(log, "alone", "asks")
        time.sleep(0.5)  # it holds the turnstile by now
        for i in range(3):
            start(f"late{i}")
        for i in range(3):
            _wait(log, f"late{i}", "asks")
        time.sleep(0.5)
        assert "in" not in _events(log)["alone"] and not any(
            "in" in _events(log)[f"late{i}"] for i in range(3)
        )
        release.touch()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            p.kill()
        for path in parallel._turn_files():
            path.unlink(missing_ok=True)
    ev = _events(log)
    # The ordinary ones overlapped each other; the alone one came after both, and the late ones
    # (which asked while it waited) after it.
    assert ev["a"]["in"] < ev["b"]["out"] and ev["b"]["in"] < ev["a"]["out"]
    assert ev["alone"]["in"] >= max(ev["a"]["out"], ev["b"]["out"])
    assert all(ev[f"late{i}"]["in"] >= ev["alone"]["out"] for i in range(3)), ev
