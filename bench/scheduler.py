#!/usr/bin/env python3
"""The scheduler against simulated fleets: placements per second with the real ``node_pick``
and the real Postgres, for 10, 100 and 1,000 nodes.

A fleet is node rows with fresh heartbeats, launchers and labels, and one image row held by
every node; nothing runs. A placement in a batch of one (``--batch 1``) is what
``sandbox_create`` does around the choice: ``node_pick`` in a transaction that then writes the
sandbox's row (pending) and commits, so every placement counts the ones before it. A larger
batch is what a warm pool's refill does (``sandbox_start_members``): ``node_pick_many`` for the
whole batch, every row in one statement, one commit. Measured single-threaded and with N worker
processes, each with its own database connection. Runs in a database of its own
(``<DATABASE_URL's name>_bench_scheduler``, created, migrated and dropped here).

Prints a table and writes JSON (default bench/results/scheduler.json). Needs DATABASE_URL to
name a Postgres server (the issue's target: 5,000 placements/s on this machine).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [
    str(ROOT),
    str(ROOT / "bench"),
]  # the repo first: bench/dashboard.py must not hide the package

from _common import write_results  # noqa: E402

LAUNCHERS = {
    "gvisor": {"network": True, "checkpoint": True, "kvm": False, "gpu": False, "max_command_bytes": 1 << 20}
}


def bench_database(url: str) -> tuple[str, str]:
    """The bench's own database on DATABASE_URL's server: (its URL, the server's admin URL)."""
    parsed = urlparse(url)
    if parsed.scheme not in ("postgres", "postgresql"):
        raise SystemExit("bench/scheduler.py needs DATABASE_URL=postgres://…")
    name = (parsed.path.lstrip("/") or "hangar") + "_bench_scheduler"
    return urlunparse(parsed._replace(path=f"/{name}")), urlunparse(parsed._replace(path="/postgres"))


def recreate(admin_url: str, name: str, *, drop_only: bool = False) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        if not drop_only:
            conn.execute(f'CREATE DATABASE "{name}"')


def setup_django() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
    import django

    django.setup()


def make_fleet(nodes: int, live_per_node: int) -> None:
    """``nodes`` ready node rows (16 cpu, 64 GB each) already running ``live_per_node`` sandboxes
    each, one image on all of them, one team."""
    from django.utils import timezone

    from runtime.models import Image, Node, Sandbox, Team

    Sandbox.objects.all().delete()
    Image.objects.all().delete()
    Node.objects.all().delete()
    Team.objects.get_or_create(name="bench")
    now = timezone.now()
    rows = Node.objects.bulk_create(
        Node(name=f"sim-{i:05d}", launchers=LAUNCHERS, cpu_capacity=16, memory_mb_capacity=65536,
             labels={"zone": "abc"[i % 3]}, state=Node.State.READY, heartbeat_at=now, started_at=now,
             disk_free_mb=500_000)
        for i in range(nodes)
    )  # fmt: skip
    image = Image.objects.create(name="bench", digest="sha256:" + "b" * 64)
    image.nodes.add(*rows)
    team = Team.objects.get(name="bench")
    Sandbox.objects.bulk_create(
        (Sandbox(team=team, image=image.name, image_digest=image.digest, runtime="gvisor", node=node, cpu=0.25,
                 memory_mb=128, status=Sandbox.Status.RUNNING)
         for node in rows for _ in range(live_per_node)),
        batch_size=2000,
    )  # fmt: skip


def place(count: int, selector: dict[str, str] | None = None, batch: int = 1) -> int:
    """``count`` placements, in committed transactions of ``batch`` each; how many were refused.
    A batch of one is a create's placement (``node_pick``, then the sandbox's row); a larger
    one is a pool refill's (``node_pick_many``, then every row in one statement)."""
    from django.db import transaction

    from runtime.errors import NoCapacity
    from runtime.models import Image, Sandbox, Team
    from runtime.services.placement import node_pick, node_pick_many

    team = Team.objects.get(name="bench")
    image = Image.objects.get(name="bench")
    spec = {"runtime": "gvisor", "cpu": 0.25, "memory_mb": 128}
    refused = 0
    done = 0
    while done < count:
        n = min(batch, count - done)
        done += n
        try:
            with transaction.atomic():
                if batch == 1:
                    node = node_pick(image=image, node_selector=selector, **spec)
                    Sandbox.objects.create(team=team, image=image.name, image_digest=image.digest, node=node,
                                           node_selector=selector or {}, **spec)  # fmt: skip
                    continue
                nodes = node_pick_many(count=n, partial=True, image=image, node_selector=selector, **spec)
                Sandbox.objects.bulk_create(
                    Sandbox(team=team, image=image.name, image_digest=image.digest, node=node,
                            node_selector=selector or {}, **spec)
                    for node in nodes
                )  # fmt: skip
                refused += n - len(nodes)
        except NoCapacity:
            refused += n
    return refused


def heartbeats(stop: Any) -> None:
    """The fleet's heartbeats while it is measured, as its nodes would send them: every
    ``HANGAR_NODE_HEARTBEAT_S`` each node's row is written (in one statement here; real nodes
    write one row each). Without them the nodes would count as lost after
    ``HANGAR_NODE_OFFLINE_AFTER_S`` and placements would be refused."""
    import psycopg

    every = float(os.environ.get("HANGAR_NODE_HEARTBEAT_S", "5"))
    with psycopg.connect(os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1),
                         autocommit=True) as conn:  # fmt: skip
        while not stop.wait(every):
            conn.execute("UPDATE runtime_node SET heartbeat_at = now()")


def _worker(count: int, batch: int, start: Any, out: Any) -> None:
    from django.db import connections

    connections.close_all()  # a connection of its own, not the parent's
    start.wait()
    out.put(place(count, batch=batch))


def run_concurrent(workers: int, total: int, batch: int) -> tuple[float, int]:
    from django.db import connections

    connections.close_all()
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(total // workers, batch, start, out)) for _ in range(workers)]
    for p in procs:
        p.start()
    time.sleep(0.5)  # every worker ready (its imports are the parent's)
    t0 = time.perf_counter()
    start.set()
    refused = sum(out.get() for _ in procs)
    elapsed = time.perf_counter() - t0
    for p in procs:
        p.join()
    return elapsed, refused


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", default="10,100,1000", help="fleet sizes, comma-separated")
    parser.add_argument("-n", type=int, default=1000, help="placements per measurement")
    parser.add_argument("--workers", default="2,4,8", help="concurrent worker processes, comma-separated")
    parser.add_argument(
        "--batch",
        default="1,100",
        help="placements per transaction, comma-separated (1: a create's; more: a pool refill's)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="times each measurement is repeated, interleaved"
    )
    parser.add_argument("--live", type=int, default=10, help="sandboxes already running on each node")
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "scheduler.json"))
    args = parser.parse_args()

    url, admin_url = bench_database(os.environ.get("DATABASE_URL", ""))
    name = urlparse(url).path.lstrip("/")
    recreate(admin_url, name)
    os.environ["DATABASE_URL"] = url
    rows: list[dict] = []
    try:
        setup_django()
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connections

        call_command("migrate", verbosity=0)
        stop = threading.Event()
        beating = threading.Thread(target=heartbeats, args=(stop,), daemon=True)
        beating.start()
        batches = [int(x) for x in args.batch.split(",")]
        for nodes in [int(x) for x in args.nodes.split(",")]:
            for workers in [1] + [int(x) for x in args.workers.split(",")]:
                for _ in range(args.rounds):  # the batch sizes alternated, so each sees the same machine
                    for batch in batches:
                        make_fleet(nodes, args.live)
                        if workers == 1:
                            t0 = time.perf_counter()
                            refused = place(args.n, batch=batch)
                            elapsed = time.perf_counter() - t0
                        else:
                            elapsed, refused = run_concurrent(workers, args.n, batch)
                        placed = (args.n // workers) * workers - refused
                        row = {"nodes": nodes, "live": nodes * args.live, "workers": workers, "batch": batch,
                               "placements": placed, "refused": refused, "seconds": round(elapsed, 3),
                               "per_s": round(placed / elapsed, 1), "policy": settings.HANGAR_PLACEMENT}  # fmt: skip
                        rows.append(row)
                        print(f"{nodes:>5} nodes, {workers} worker(s), batches of {batch:>4}: "
                              f"{row['per_s']:>8.1f} placements/s", flush=True)  # fmt: skip
        connections.close_all()
        stop.set()
        beating.join()
    finally:
        recreate(admin_url, name, drop_only=True)

    print()
    print(f"policy {rows[0]['policy']}, {args.live} sandboxes already running on each node")
    print("| nodes | live sandboxes | workers | batch | placements/s | placements | refused |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['nodes']} | {r['live']} | {r['workers']} | {r['batch']} | {r['per_s']:.0f} | {r['placements']} "
              f"| {r['refused']} |")  # fmt: skip
    write_results(args.json, {"cpus": os.cpu_count(), "target_per_s": 5000, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
