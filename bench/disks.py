#!/usr/bin/env python3
"""What a sandbox's own disk costs (runtime/host/disks.py), at the launcher level:

(a) making one disk (sparse copy of the size's template, loop attach, mount) and removing it,
    one after another and N at once (threads, as a node's worker makes them);
(b) create + `echo ok` of a busybox sandbox with a disk of its own (the default size, so a
    spare when there is one, as on a node) and without (`disk_mb=0`: its files on the node's
    filesystem), interleaved, sequential and N at once: the disk's share of a create;
(c) a 64 MB write inside a sandbox, onto its disk and onto the node's filesystem.

Works in a temporary state dir. Prints a table and writes JSON (default
bench/results/disks.json). Needs root, runsc, and loop devices.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import summary, write_results  # noqa: E402

from runtime.host import disks  # noqa: E402
from runtime.host.images.store import ImageStore  # noqa: E402
from runtime.launchers.base import ExecRequest, SandboxSpec  # noqa: E402
from runtime.launchers.gvisor.launcher import GVisorLauncher  # noqa: E402


def at_once(n: int, work) -> tuple[list[float], float]:
    """``work(i)`` in ``n`` threads at once; each one's time, and the wall time of all."""
    took: list[float] = [0.0] * n

    def one(i: int) -> None:
        start = time.perf_counter()
        work(i)
        took[i] = time.perf_counter() - start

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took, time.perf_counter() - start


def timed(work) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--size-mb", type=int, default=10240)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "disks.json"))
    args = parser.parse_args()
    n = args.n
    with tempfile.TemporaryDirectory(prefix="hangar-bench-disks-", dir="/var/tmp") as work:
        root = Path(work)
        pool = disks.Disks(root / "disks", default_mb=args.size_mb)
        first = timed(lambda: pool.template(args.size_mb))
        results: dict = {"size_mb": args.size_mb, "template_s": first}

        print(f"disks of {args.size_mb} MB: {n} one after another, then {n} at once…")
        made = [timed(lambda i=i: pool.make(root / f"s{i}" / "disk", args.size_mb)) for i in range(n)]
        removed = [timed(lambda i=i: disks.remove(root / f"s{i}" / "disk")) for i in range(n)]
        made_at_once, made_wall = at_once(n, lambda i: pool.make(root / f"c{i}" / "disk", args.size_mb))
        removed_at_once, removed_wall = at_once(n, lambda i: disks.remove(root / f"c{i}" / "disk"))
        results.update(make=summary(made), remove=summary(removed), make_at_once=summary(made_at_once),
                       make_at_once_wall_s=made_wall, remove_at_once_wall_s=removed_wall)  # fmt: skip

        print(f"sandbox create + exec, with and without a disk of its own, {n} each, interleaved…")
        image = ImageStore(root / "images").build_busybox()
        launcher = GVisorLauncher(
            state_dir=root / "gvisor", agent_cache_dir=root / "bin", disk_mb=args.size_mb
        )
        launcher.prepare()

        def boot(disk_mb: int | None) -> dict:
            spec = SandboxSpec(
                id="b" + uuid.uuid4().hex[:12], rootfs=image.rootfs, memory_mb=256, disk_mb=disk_mb
            )
            handle = launcher.create(spec)
            if launcher.exec(handle, ExecRequest(argv=["echo", "ok"])).stdout != b"ok\n":
                raise RuntimeError("echo ok did not answer ok")
            return handle

        launcher.destroy(boot(None))  # the agent binary and caches, warmed
        seq: dict[str, list[float]] = {"disk": [], "none": []}
        for i in range(n):
            for label, disk_mb in (("disk", None), ("none", 0)) if i % 2 else (("none", 0), ("disk", None)):
                start = time.perf_counter()
                handle = boot(disk_mb)
                seq[label].append(time.perf_counter() - start)
                launcher.destroy(handle)
        results["create_exec"] = {label: summary(v) for label, v in seq.items()}
        conc: dict[str, list[float]] = {}
        for label, disk_mb in (("none", 0), ("disk", None)):
            booted: list[dict] = []
            conc[label], _ = at_once(n, lambda i, d=disk_mb, out=booted: out.append(boot(d)))
            for h in booted:
                launcher.destroy(h)
        results["create_exec_at_once"] = {label: summary(v) for label, v in conc.items()}

        print("a 64 MB write inside a sandbox…")
        writes: dict[str, list[float]] = {"disk": [], "none": []}
        for label, disk_mb in (("disk", None), ("none", 0)):
            handle = boot(disk_mb)
            for _ in range(3):
                r = launcher.exec(handle, ExecRequest(
                    argv=["sh", "-c", "dd if=/dev/zero of=/w bs=1M count=64 2>/dev/null && sync && rm /w"],
                    timeout=120))  # fmt: skip
                if r.exit_code != 0:
                    raise RuntimeError(r.stderr.decode())
                writes[label].append(r.duration_ms / 1000)
            launcher.destroy(handle)
        results["write_64mb"] = {label: summary(v) for label, v in writes.items()}
        launcher.release_spares()

    ms = 1000.0
    rows = [
        ("format the size's template (once)", f"{first * ms:.1f} ms", "", 1),
        ("make a disk (copy, attach, mount)", f"{results['make']['median_s'] * ms:.1f} ms",
         f"{results['make']['p95_s'] * ms:.1f} ms", n),
        ("remove a disk (lazy unmount, delete)", f"{results['remove']['median_s'] * ms:.1f} ms",
         f"{results['remove']['p95_s'] * ms:.1f} ms", n),
        (f"make {n} at once: each / all", f"{results['make_at_once']['median_s'] * ms:.1f} ms",
         f"all: {made_wall * ms:.0f} ms", n),
        ("create + exec, own disk", f"{results['create_exec']['disk']['median_s']:.3f} s",
         f"{results['create_exec']['disk']['p95_s']:.3f} s", n),
        ("create + exec, no disk of its own", f"{results['create_exec']['none']['median_s']:.3f} s",
         f"{results['create_exec']['none']['p95_s']:.3f} s", n),
        (f"create + exec, {n} at once, own disk", f"{results['create_exec_at_once']['disk']['median_s']:.3f} s",
         f"{results['create_exec_at_once']['disk']['p95_s']:.3f} s", n),
        (f"create + exec, {n} at once, no disk", f"{results['create_exec_at_once']['none']['median_s']:.3f} s",
         f"{results['create_exec_at_once']['none']['p95_s']:.3f} s", n),
        ("write 64 MB + sync inside, own disk", f"{results['write_64mb']['disk']['median_s']:.3f} s",
         f"{results['write_64mb']['disk']['p95_s']:.3f} s", 3),
        ("write 64 MB + sync inside, no disk", f"{results['write_64mb']['none']['median_s']:.3f} s",
         f"{results['write_64mb']['none']['p95_s']:.3f} s", 3),
    ]  # fmt: skip
    print("\n| measure | median | p95 | n |\n| --- | --- | --- | --- |")
    for name, median, p95, count in rows:
        print(f"| {name} | {median} | {p95} | {count} |")
    share = statistics.median(seq["disk"]) - statistics.median(seq["none"])
    print(f"\nthe disk's share of a create (difference of medians): {share * ms:+.1f} ms")
    results["disk_share_s"] = share
    write_results(args.json, results)


if __name__ == "__main__":
    main()
