#!/usr/bin/env python3
"""Claim from a warm pool: `POST /sandboxes` with a pool's spec, then `POST …/exec` `echo ok`,
timed from the create request to the command's result, -n times (the pool refills between
claims, as it would between users). For comparison, the same with no pool.

Starts its own `hangar up` on the embedded default in a temporary data dir. Prints a table and
writes JSON (default bench/results/pools.json). Needs root and runsc.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import client, start_hangar, stop_hangar, summary, write_results  # noqa: E402

SPEC = {"image": "busybox", "memory_mb": 256, "cpu": 1}


def create_and_exec(api, body: dict) -> tuple[float, dict]:
    start = time.perf_counter()
    sb = api.post("/sandboxes", json=body).json()
    created = time.perf_counter()
    out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": ["echo", "ok"]}).json()
    elapsed = time.perf_counter() - start
    if out.get("stdout") != "ok\n":
        raise RuntimeError(f"exec failed: {sb} {out}")
    sb["_create_s"] = created - start
    return elapsed, sb


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--size", type=int, default=3)
    parser.add_argument("--port", type=int, default=8768)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "pools.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    claims: list[float] = []
    cold: list[float] = []
    claim_parts: list[float] = []
    try:
        hangar = start_hangar(work / "data", args.port)
        with client(hangar.url, hangar.token) as api:
            pool = api.post("/pools", json={**SPEC, "size": args.size}).json()

            def wait_full() -> None:
                deadline = time.monotonic() + 120
                while api.get(f"/pools/{pool['id']}").json()["ready"] < args.size:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the pool did not fill within 120 s")
                    time.sleep(0.1)

            for i in range(args.n):
                wait_full()
                elapsed, sb = create_and_exec(api, {**SPEC, "env": {"RUN": str(i)}})
                if sb.get("pool") != pool["id"]:
                    raise RuntimeError(f"claim {i} did not come from the pool: {sb}")
                claims.append(elapsed)
                claim_parts.append(sb["_create_s"])
                api.delete(f"/sandboxes/{sb['id']}")
            api.delete(f"/pools/{pool['id']}")
            time.sleep(2)
            for _ in range(max(5, args.n // 4)):
                elapsed, sb = create_and_exec(api, {**SPEC, "memory_mb": 320})
                cold.append(elapsed)
                api.delete(f"/sandboxes/{sb['id']}")
    finally:
        stop_hangar(hangar, work)

    results = {"cpus": os.cpu_count(), "pool_size": args.size, "claim_create_to_exec": summary(claims),
               "claim_create_only": summary(claim_parts), "no_pool_create_to_exec": summary(cold)}  # fmt: skip
    print()
    print("| measure | median | p95 | n |")
    print("| --- | --- | --- | --- |")
    for name, values in (
        ("claim from a warm pool + exec echo ok", claims),
        ("of which the claim (POST /sandboxes)", claim_parts),
        ("no pool: create + exec echo ok", cold),
    ):
        s = summary(values)
        print(f"| {name} | {s['median_s'] * 1000:.1f} ms | {s['p95_s'] * 1000:.1f} ms | {s['n']} |")
    print(f"\nclaim / cold, medians: {statistics.median(claims) / statistics.median(cold):.2f}")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
