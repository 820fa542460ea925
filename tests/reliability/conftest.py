"""The reliability suites (docs/reliability.md): each test says what it tried and what held
through the ``report`` fixture; at the end of the session the whole is written as one JSON and
a Markdown summary in ``HANGAR_RELIABILITY_DIR`` (default ``/tmp/hangar-reliability``), which
``bench/reliability.py`` prints. A test that fails records nothing: its failure is the report."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .budgets import write_part

RESULTS: list[dict[str, Any]] = []


class Report:
    """What one test tried: ``held(kind, what, **figures)`` for each attack or fault that held."""

    def __init__(self, suite: str, test: str) -> None:
        self.suite, self.test = suite, test
        self.runtime = ""  # set by a test that runs against one runtime
        self.entries: list[dict[str, Any]] = []

    def held(self, kind: str, what: str, **figures: Any) -> None:
        where = {"runtime": self.runtime} if self.runtime else {}
        self.entries.append(
            {"suite": self.suite, "test": self.test, **where, "kind": kind, "what": what, **figures}
        )


@pytest.fixture
def report(request) -> Iterator[Report]:
    suite = Path(str(request.node.fspath)).stem.removeprefix("test_")
    r = Report(suite, request.node.name)
    started = time.monotonic()
    yield r
    if request.node.rep_call.passed if hasattr(request.node, "rep_call") else False:
        for entry in r.entries:
            RESULTS.append({**entry, "test_s": round(time.monotonic() - started, 2)})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if rep.when == "call":
        item.rep_call = rep


def pytest_sessionfinish(session, exitstatus) -> None:
    """This process's results, as one part of the run's report: ``tests/reliability/budgets.py``
    puts the parts together (from each worker of a `pytest -n` run, or this process's alone)."""
    if RESULTS:
        write_part(RESULTS)
