"""The reliability suites' time budgets and their report, for the run as a whole: registered by
``tests/conftest.py`` (a plugin, so that under `pytest -n` it runs in the controller, which sees
every worker's test reports; a worker never loads ``tests/reliability/conftest.py`` there).

Each process that ran reliability tests writes its results as a part
(``tests/reliability/conftest.py``); at the end of the run the parts become one JSON and a
Markdown summary in ``HANGAR_RELIABILITY_DIR`` (default ``/tmp/hangar-reliability``), which
``bench/reliability.py`` prints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests import worker_env

# Each suite's time budget in seconds (its tests' setup, call and teardown, as pytest times
# them), about twice what it takes on the 2-core development machine: a suite past it fails the
# session, naming it, so that none grows unnoticed into the CI's time (docs/reliability.md).
BUDGET_S = {
    "test_escape": 600,
    "test_authorization": 600,  # its object matrix takes minutes beside another worker
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


def report_dir() -> Path:
    return Path(os.environ.get("HANGAR_RELIABILITY_DIR", "/tmp/hangar-reliability"))


def _parts() -> Path:
    return report_dir() / "parts"


def write_part(results: list[dict[str, Any]]) -> None:
    """One process's results, named by the run and the worker."""
    _parts().mkdir(parents=True, exist_ok=True)
    name = f"{os.environ['HANGAR_TEST_RUN_ID']}-{worker_env.WORKER or 'main'}.json"
    (_parts() / name).write_text(json.dumps(results, default=str))


def pytest_runtest_logreport(report) -> None:
    if report.nodeid.startswith("tests/reliability/"):
        suite = report.nodeid.split("/")[2].split(".py")[0]
        SPENT_S[suite] = SPENT_S.get(suite, 0.0) + report.duration


@pytest.hookimpl(trylast=True)  # after the reliability conftest has written this process's part
def pytest_sessionfinish(session, exitstatus) -> None:
    if worker_env.WORKER:
        return  # the controller sums every worker's reports
    over = [f"{suite}: {spent:.0f} s, over its budget of {BUDGET_S[suite]} s"
            for suite, spent in sorted(SPENT_S.items()) if spent > BUDGET_S.get(suite, float("inf"))]  # fmt: skip
    over += [f"{suite}: {spent:.0f} s, and no budget in BUDGET_S" for suite, spent in sorted(SPENT_S.items())
             if suite not in BUDGET_S]  # fmt: skip
    if over:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                "reliability suites over their time budget (tests/reliability/budgets.py):", red=True
            )
            for line in over:
                reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _merge_parts()


def _merge_parts() -> None:
    parts = sorted(_parts().glob(f"{os.environ['HANGAR_TEST_RUN_ID']}-*.json")) if _parts().is_dir() else []
    if not parts:
        return
    results: list[dict[str, Any]] = []
    for part in parts:
        results += json.loads(part.read_text())
        part.unlink()
    out = report_dir()
    (out / "report.json").write_text(json.dumps({"results": results}, indent=2, default=str))
    lines = ["| suite | kind | what held | figures |", "| --- | --- | --- | --- |"]
    for e in results:
        figures = ", ".join(
            f"{k}={v}" for k, v in e.items() if k not in ("suite", "test", "kind", "what", "test_s")
        )
        lines.append(f"| {e['suite']} | {e['kind']} | {e['what']} | {figures} |")
    (out / "report.md").write_text("\n".join(lines) + "\n")
