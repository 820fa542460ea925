#!/usr/bin/env python3
"""A burst: N concurrent creates and first commands on this one node, through the API, against
N raw `runsc` starts at once, in the same run.

(a) raw: N threads released together, each `runsc run --detach` of the busybox bundle and then
    `runsc exec … echo ok` (bench/tti.py's raw start), no network;
(b) Hangar: N threads released together, each with a client of its own, `POST /sandboxes`
    (wait) then `POST /sandboxes/{id}/exec` `echo ok`.

Each burst starts once the previous one's sandboxes are gone. With ``--rounds 2`` the order is
raw, Hangar, Hangar, raw (ABBA), so both see the machine's drift alike. Reported per burst: how
many succeeded (every failure is kept with its answer), the wall time from release to the last
`ok`, and the median and p95 per sandbox; and Hangar's wall over raw's. The issue's target:
100% success and a wall at most 1.5× raw runsc's (anchor: ComputeSDK's burst medians,
0.65–1.33 s per sandbox across E2B, Daytona and Modal on their fleets).

Starts its own `hangar up` (the single-machine default: SQLite and an embedded Redis) in a
temporary data dir unless --url and --token point at a running Hangar; with ``--postgres URL``
(a server, e.g. postgres://postgres@127.0.0.1:5432/) that `hangar up` keeps its rows in a fresh
database of its own there (created, then dropped), as a node of a fleet does. Prints a table and writes JSON (default
bench/results/burst.json). Needs root and runsc.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import client, pct, start_hangar, stop_hangar, wait_deleted, write_results  # noqa: E402
from tti import hangar_once, raw_bundle, raw_cleanup, raw_once  # noqa: E402

SANDBOX = {"image": "busybox", "memory_mb": 128, "cpu": 0.25, "timeout_s": 600}


def _release(n: int, one: Callable[[], float]) -> tuple[float, list[float], list[str]]:
    """``one()`` in n threads released at once: (wall from release to the last one's end, each
    success's time, each failure's reason)."""
    times: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(n + 1)

    def run() -> None:
        barrier.wait()
        try:
            elapsed = one()
        except BaseException as exc:  # kept and reported
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:300])
        else:
            with lock:
                times.append(elapsed)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - started, times, errors


def raw_burst(n: int, work: Path) -> dict:
    bundle, root = raw_bundle(work)
    cids: list[str] = []

    def one() -> float:
        elapsed, cid = raw_once(bundle, root)
        cids.append(cid)
        return elapsed

    wall, times, errors = _release(n, one)
    for cid in cids:
        raw_cleanup(root, cid)
    return _row("raw runsc", n, wall, times, errors)


def hangar_burst(n: int, url: str, token: str) -> dict:
    created: list[str] = []
    clients = [client(url, token) for _ in range(n)]  # one client per sandbox, as n callers would have
    free = list(clients)

    def one() -> float:
        api = free.pop()
        start = time.perf_counter()
        r = api.post("/sandboxes", json=SANDBOX)
        if r.status_code != 201 or r.json().get("status") != "running":
            raise RuntimeError(f"create: {r.status_code} {r.text[:200]}")
        sid = r.json()["id"]
        created.append(sid)
        out = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["echo", "ok"]})
        if out.status_code != 200 or out.json().get("stdout") != "ok\n":
            raise RuntimeError(f"exec: {out.status_code} {out.text[:200]}")
        return time.perf_counter() - start

    wall, times, errors = _release(n, one)
    for c in clients:
        c.close()
    with client(url, token) as api:
        for sid in created:
            api.delete(f"/sandboxes/{sid}")
        for sid in created:
            wait_deleted(api, sid, timeout=180)
    return _row("Hangar API", n, wall, times, errors)


def _row(what: str, n: int, wall: float, times: list[float], errors: list[str]) -> dict:
    return {
        "what": what, "n": n, "succeeded": len(times), "wall_s": round(wall, 3),
        "median_s": round(statistics.median(times), 3) if times else None,
        "p95_s": round(pct(times, 95), 3) if times else None,
        "errors": errors[:10], "error_count": len(errors),
    }  # fmt: skip


def _server(url: str, database: str = "postgres") -> str:
    """The server of ``url``, at ``database``."""
    return urlsplit(url)._replace(path=f"/{database}").geturl()


def _fresh_database(url: str) -> str:
    import psycopg

    name = f"hangar_burst_{os.getpid()}_{int(time.time())}"
    with psycopg.connect(_server(url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _server(url, name)


def _drop_database(url: str, database: str) -> None:
    import psycopg

    with psycopg.connect(_server(url), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{database.rsplit("/", 1)[1]}" WITH (FORCE)')


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=100, help="sandboxes per burst")
    parser.add_argument(
        "--rounds", type=int, default=2, help="1: raw then Hangar; 2: raw, Hangar, Hangar, raw"
    )
    parser.add_argument("--url")
    parser.add_argument("--token")
    parser.add_argument("--port", type=int, default=8766)
    parser.add_argument("--postgres", help="a Postgres server's URL: the rows in a fresh database there")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "burst.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-burst-"))
    hangar = None
    database = ""
    rows: list[dict] = []
    try:
        url, token = args.url, args.token
        if not url:
            # n sandboxes of a quarter CPU on this node: let the scheduler overcommit that far,
            # and the team's quota and its blocking execs in flight on this server take n.
            burst_env = {"HANGAR_CPU_OVERCOMMIT": "64", "HANGAR_QUOTA_SANDBOXES": str(2 * args.n),
                         "HANGAR_EXEC_BLOCKING_PER_TEAM": str(args.n)}  # fmt: skip
            if args.postgres:
                burst_env["DATABASE_URL"] = database = _fresh_database(args.postgres)
            hangar = start_hangar(work / "data", args.port, extra_env=burst_env)
            token, url = hangar.token, hangar.url
        with client(url, token) as api:  # warm-up: first-use costs (agent build, caches) are not the burst's
            warm: list[str] = []
            hangar_once(api, warm)
            api.delete(f"/sandboxes/{warm[0]}")
            wait_deleted(api, warm[0])
        bundle, root = raw_bundle(work)
        raw_cleanup(root, raw_once(bundle, root)[1])
        order = (
            ["raw", "hangar"] if args.rounds == 1 else ["raw", "hangar", "hangar", "raw"] * (args.rounds // 2)
        )
        for side in order:
            print(f"{side}: {args.n} at once…", flush=True)
            rows.append(raw_burst(args.n, work) if side == "raw" else hangar_burst(args.n, url, token))
            print(f"  {rows[-1]['succeeded']}/{args.n} in {rows[-1]['wall_s']} s", flush=True)
    finally:
        stop_hangar(hangar, work)
        if database:
            _drop_database(args.postgres, database)

    raw = [r["wall_s"] for r in rows if r["what"] == "raw runsc"]
    ours = [r["wall_s"] for r in rows if r["what"] == "Hangar API"]
    ratio = statistics.median(ours) / statistics.median(raw) if raw and ours else None
    print()
    print(f"| burst of {args.n} | succeeded | wall | median per sandbox | p95 per sandbox |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['what']} | {r['succeeded']}/{r['n']} | {r['wall_s']:.2f} s | {r['median_s']} s | {r['p95_s']} s |"
        )
    if ratio is not None:
        print(f"\nHangar's wall / raw runsc's (medians): {ratio:.2f}× (target ≤ 1.5×, and {args.n}/{args.n})")
    for r in rows:
        for e in r["errors"]:
            print(f"  {r['what']} failure: {e}")
    write_results(args.json, {"n": args.n, "cpus": os.cpu_count(), "rounds": rows, "wall_ratio": ratio,
                              "target_ratio": 1.5, "database": "postgres" if args.postgres else "sqlite"})  # fmt: skip
    return 0 if all(r["succeeded"] == r["n"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
