#!/usr/bin/env python3
"""Create → first command result, microVM against gVisor, interleaved in one run, at the
launcher level (no server: what the runtime itself costs). Each round creates a busybox
sandbox on each runtime, times create() and the first ``echo`` through its agent, reads the
idle memory it holds (QEMU's RSS and the guest's used RAM for the microVM; runsc's report for
gVisor), and destroys it. Prints a table and writes JSON (default bench/results/microvm.json).
Needs root, runsc, QEMU and the guest kernel (scripts/install-microvm.sh); run it under the
machine's heavy-work lock."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import summary, write_results  # noqa: E402

from runtime.host.images.store import ImageStore  # noqa: E402
from runtime.launchers.base import ExecRequest, SandboxSpec  # noqa: E402
from runtime.launchers.registry import new_launcher  # noqa: E402


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def one(launcher, rootfs: Path, memory_mb: int) -> dict[str, float]:
    spec = SandboxSpec(id="b" + uuid.uuid4().hex[:12], rootfs=rootfs, memory_mb=memory_mb, disk_mb=1024)
    start = time.perf_counter()
    handle = launcher.create(spec)
    created = time.perf_counter()
    r = launcher.exec(handle, ExecRequest(argv=["echo", "hi"]))
    done = time.perf_counter()
    try:
        if r.stdout != b"hi\n":
            raise RuntimeError(f"{launcher.name}: {r}")
        time.sleep(1.0)  # idle
        stats = launcher.stats(handle)
        qemu_rss = _rss(handle["qemu_pid"]) if "qemu_pid" in handle else 0
        return {"create_s": created - start, "first_result_s": done - start,
                "guest_used_bytes": stats.memory_bytes, "qemu_rss_bytes": qemu_rss}  # fmt: skip
    finally:
        launcher.destroy(handle)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "microvm.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-microvm-"))
    store = ImageStore(work / "images")
    rootfs = store.build_busybox().rootfs
    launchers = {name: new_launcher(name, state_dir=str(work / name), agent_cache_dir=str(work / "bin"))
                 for name in ("gvisor", "microvm")}  # fmt: skip
    accel = launchers["microvm"].accel()  # type: ignore[attr-defined]
    for launcher in launchers.values():  # a first one each builds what later ones reuse
        one(launcher, rootfs, args.memory_mb)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
    for _ in range(args.rounds):
        for name, launcher in launchers.items():  # interleaved: the same load for both
            rows[name].append(one(launcher, rootfs, args.memory_mb))
    results: dict = {"rounds": args.rounds, "memory_mb": args.memory_mb, "microvm_accel": accel}
    print(f"create -> first result, {args.rounds} rounds interleaved (microvm accel: {accel})")
    print(f"{'runtime':10} {'median s':>9} {'p95 s':>9} {'idle guest MB':>14} {'idle QEMU RSS MB':>17}")
    for name, samples in rows.items():
        s = summary([x["first_result_s"] for x in samples])
        guest = sorted(x["guest_used_bytes"] for x in samples)[len(samples) // 2] / 2**20
        rss = sorted(x["qemu_rss_bytes"] for x in samples)[len(samples) // 2] / 2**20
        results[name] = {"first_result": s, "create": summary([x["create_s"] for x in samples]),
                         "idle_guest_used_mb": guest, "idle_qemu_rss_mb": rss}  # fmt: skip
        print(f"{name:10} {s['median_s']:9.2f} {s['p95_s']:9.2f} {guest:14.1f} {rss:17.1f}")
    ratio = results["microvm"]["first_result"]["median_s"] / results["gvisor"]["first_result"]["median_s"]
    results["median_ratio_microvm_over_gvisor"] = ratio
    print(f"median ratio microvm/gvisor: {ratio:.1f}x")
    write_results(args.json, results)


if __name__ == "__main__":
    main()
