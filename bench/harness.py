#!/usr/bin/env python3
"""Harnesses: how long until a new one is ready (its volume, its sandbox, its setup), how long
a run takes end to end when the agent itself does nothing (`true`: what Hangar adds to every
run: queueing, the workspace tree before and after, the process, the diff), and a run handed
to a paused harness (the resume included).

Starts its own `hangar up` on the embedded default in a temporary data dir and builds the
`minimal` image there (about a minute, not timed). Prints a table and writes JSON (default
bench/results/harness.json). Needs root and runsc.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import client, start_hangar, stop_hangar, summary, write_results  # noqa: E402


def wait(api, path: str, field: str, wanted: set[str], timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = api.get(path).json()
        if body[field] in wanted:
            return body
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path}: still {body[field]} after {timeout} s: {body}")
        time.sleep(0.05)


def timed_run(api, hid: str) -> float:
    start = time.perf_counter()
    run = api.post(f"/harnesses/{hid}/runs", json={"prompt": "nothing"}).json()
    done = wait(api, f"/runs/{run['id']}", "status", {"succeeded", "failed", "timed_out", "cancelled"})
    if done["status"] != "succeeded":
        raise RuntimeError(f"run failed: {done}")
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5, help="harnesses to create (default 5)")
    parser.add_argument("--runs", type=int, default=10, help="runs per harness on a running one (default 10)")
    parser.add_argument("--port", type=int, default=8793)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "harness.json"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("needs root (runsc)", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    ready: list[float] = []
    runs: list[float] = []
    paused_runs: list[float] = []
    try:
        hangar = start_hangar(work / "data", args.port)
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
        }
        env["HANGAR_DATA_DIR"] = str(work / "data")
        subprocess.run([sys.executable, "-m", "dashboard.cli", "image", "build", "minimal"], cwd=ROOT, env=env,
                       check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        with client(hangar.url, hangar.token) as api:
            for i in range(args.n):
                start = time.perf_counter()
                h = api.post("/harnesses", json={
                    "name": f"bench-{i}", "agent": "custom", "command": "true", "image": "minimal",
                    "memory_mb": 512, "disk_mb": 256, "network": {"egress": "none", "hangar": False},
                }).json()  # fmt: skip
                if "id" not in h:
                    raise RuntimeError(f"create failed: {h}")
                wait(api, f"/harnesses/{h['id']}", "status", {"running"})
                ready.append(time.perf_counter() - start)
                runs += [timed_run(api, h["id"]) for _ in range(args.runs)]
                api.post(f"/harnesses/{h['id']}/pause", json={"wait": True})
                paused_runs.append(timed_run(api, h["id"]))
                api.delete(f"/harnesses/{h['id']}", params={"delete_volume": "true"})
    finally:
        stop_hangar(hangar, work)
    results = {
        "create_to_ready": summary(ready),
        "run_end_to_end": summary(runs),
        "run_on_paused_harness": summary(paused_runs),
        "note": "agent `true`, no repository, minimal image, egress none",
    }
    print(f"{'what':<28}{'n':>4}{'median':>10}{'p95':>10}{'min':>10}{'max':>10}")
    for name, s in results.items():
        if isinstance(s, dict):
            print(
                f"{name:<28}{s['n']:>4}{s['median_s']:>9.3f}s{s['p95_s']:>9.3f}s{s['min_s']:>9.3f}s{s['max_s']:>9.3f}s"
            )
    write_results(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
