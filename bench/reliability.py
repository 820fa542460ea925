"""The reliability suites (tests/reliability/) run as a report: every attack tried and held,
every bad input answered, the authorization cells checked, the load carried, with their figures
(a neighbour's exec latency during each bomb, schemathesis's operations, the sweep's statuses,
the load's latency percentiles per endpoint and the Hangar processes' memory over two rounds).
Prints the Markdown summary and writes one JSON (default bench/results/reliability.json) and the
Markdown beside it. Needs root and runsc, as the suites do; the load suite needs locust (the
test extra).

    python bench/reliability.py                  # every suite
    python bench/reliability.py escape bad_input # some of them
    python bench/reliability.py --quick          # without the slow cases (bombs, schemathesis, load)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, write_results

SUITES = ("escape", "authorization", "bad_input", "faults", "neighbours", "fleet", "load")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "suites", nargs="*", metavar="SUITE", help=f"some of {', '.join(SUITES)} (default: all)"
    )
    parser.add_argument("--quick", action="store_true", help="leave out the cases marked slow")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "reliability.json"))
    args = parser.parse_args()
    suites = args.suites or list(SUITES)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"no suite {', '.join(unknown)}: the suites are {', '.join(SUITES)}")
    with tempfile.TemporaryDirectory(prefix="hangar-reliability-") as tmp:
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                *(str(ROOT / "tests" / "reliability" / f"test_{s}.py") for s in suites)]  # fmt: skip
        if args.quick:
            argv += ["-m", "not slow"]
        started = time.monotonic()
        proc = subprocess.run(argv, cwd=ROOT, env={**os.environ, "HANGAR_RELIABILITY_DIR": tmp})
        took = time.monotonic() - started
        report = Path(tmp) / "report.json"
        results = json.loads(report.read_text())["results"] if report.exists() else []
        markdown = (
            (Path(tmp) / "report.md").read_text() if results else "(nothing held: see the failures above)\n"
        )
    print()
    print(markdown)
    by_suite: dict[str, int] = {}
    for r in results:
        by_suite[r["suite"]] = by_suite.get(r["suite"], 0) + 1
    print(f"suites: {', '.join(suites)}; held: {by_suite}; pytest exit {proc.returncode}; {took:.0f} s")
    write_results(args.out, {"suites": suites, "quick": args.quick, "pytest_exit": proc.returncode,
                             "seconds": round(took, 1), "held": results})  # fmt: skip
    Path(args.out).with_suffix(".md").write_text(markdown)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
