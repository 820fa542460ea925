"""The reliability suites (docs/reliability.md): each test says what it tried and what held
through the ``report`` fixture; at the end of the session the whole is written as one JSON and
a Markdown summary in ``HANGAR_RELIABILITY_DIR`` (default ``/tmp/hangar-reliability``), which
``bench/reliability.py`` prints. A test that fails records nothing: its failure is the report."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

RESULTS: list[dict[str, Any]] = []

# Each suite's time budget in seconds (its tests' setup, call and teardown, as pytest times
# them), about twice what it takes on the 2-core development machine: a suite past it fails the
# session, naming it, so that none grows unnoticed into the CI's time (docs/reliability.md).
BUDGET_S = {
    "test_escape": 600,
    "test_authorization": 360,
    "test_authorization_ws": 120,
    "test_authorization_pages": 150,
    "test_authorization_edges": 150,
    "test_authorization_ssh": 180,
    "test_bad_input": 900,  # schemathesis alone runs its --max-time 400
    "test_load": 300,
    "test_faults": 400,
    "test_neighbours": 300,
    "test_fleet": 400,
}
SPENT_S: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    if report.nodeid.startswith("tests/reliability/"):
        suite = report.nodeid.split("/")[2].split(".py")[0]
        SPENT_S[suite] = SPENT_S.get(suite, 0.0) + report.duration


def report_dir() -> Path:
    return Path(os.environ.get("HANGAR_RELIABILITY_DIR", "/tmp/hangar-reliability"))


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
    over = [f"{suite}: {spent:.0f} s, over its budget of {BUDGET_S[suite]} s"
            for suite, spent in sorted(SPENT_S.items()) if spent > BUDGET_S.get(suite, float("inf"))]  # fmt: skip
    over += [f"{suite}: {spent:.0f} s, and no budget in BUDGET_S" for suite, spent in sorted(SPENT_S.items())
             if suite not in BUDGET_S]  # fmt: skip
    if over:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "reliability suites over their time budget (tests/reliability/conftest.py):", red=True
            )
            for line in over:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if not RESULTS:
        return
    out = report_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"results": RESULTS}, indent=2, default=str))
    lines = ["| suite | kind | what held | figures |", "| --- | --- | --- | --- |"]
    for e in RESULTS:
        figures = ", ".join(
            f"{k}={v}" for k, v in e.items() if k not in ("suite", "test", "kind", "what", "test_s")
        )
        lines.append(f"| {e['suite']} | {e['kind']} | {e['what']} | {figures} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
