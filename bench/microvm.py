#!/usr/bin/env python3
"""Create → first command result, microVM against gVisor, interleaved in one run, at the
launcher level (no server: what the runtime itself costs). Each round creates a busybox
sandbox on each runtime, times create() and the first ``echo`` through its agent, reads the
idle memory it holds (QEMU's RSS and the guest's used RAM for the microVM; runsc's report for
gVisor), pauses it in checkpoint mode and continues it (the checkpoint's time and size, the
restore's time and its first result: ``--no-checkpoint`` skips them), and destroys it. Prints a table and writes JSON (default bench/results/microvm.json).
Needs root, runsc, QEMU and the guest kernel (scripts/install-microvm.sh); run it under the
machine's heavy-work lock."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _common import summary, under_a_reaper, write_results  # noqa: E402

from runtime.host.images.store import ImageStore  # noqa: E402
from runtime.launchers.base import ExecRequest, SandboxSpec  # noqa: E402
from runtime.launchers.registry import new_launcher  # noqa: E402


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _checkpoint_bytes(launcher, sandbox_id: str) -> int:
    """The saved state on disk: the microVM's checkpoint.img, every file of gVisor's checkpoint/."""
    d = launcher.sandboxes_dir / sandbox_id
    saved = [
        f for f in d.rglob("*") if f.name == "checkpoint.img" or f.relative_to(d).parts[0] == "checkpoint"
    ]
    return sum(f.stat().st_size for f in saved if f.is_file())


def one(launcher, rootfs: Path, memory_mb: int, *, checkpoint: bool) -> dict[str, float]:
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
        row = {"create_s": created - start, "first_result_s": done - start,
               "guest_used_bytes": stats.memory_bytes, "qemu_rss_bytes": qemu_rss}  # fmt: skip
        if checkpoint:  # pause in checkpoint mode and continue: the saved image, then the next result
            launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", "echo 41 > /tmp/n"]))
            t0 = time.perf_counter()
            launcher.checkpoint(handle)
            t1 = time.perf_counter()
            row["checkpoint_bytes"] = _checkpoint_bytes(launcher, spec.id)
            handle = launcher.restore(spec)
            t2 = time.perf_counter()
            r = launcher.exec(handle, ExecRequest(argv=["cat", "/tmp/n"]))
            t3 = time.perf_counter()
            if r.stdout != b"41\n":
                raise RuntimeError(f"{launcher.name} after restore: {r}")
            row.update(checkpoint_s=t1 - t0, restore_s=t2 - t1, restore_result_s=t3 - t1)
        return row
    finally:
        launcher.destroy(launcher.handle_for(spec.id))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpoint-and-restore figures")
    ap.add_argument("--json", default=str(ROOT / "bench" / "results" / "microvm.json"))
    args = ap.parse_args()
    under_a_reaper()  # as on a node: exited sandboxes are reaped at once
    work = Path(tempfile.mkdtemp(prefix="bench-microvm-"))
    store = ImageStore(work / "images")
    rootfs = store.build_busybox().rootfs
    launchers = {name: new_launcher(name, state_dir=str(work / name), agent_cache_dir=str(work / "bin"))
                 for name in ("gvisor", "microvm")}  # fmt: skip
    accel = launchers["microvm"].accel()  # type: ignore[attr-defined]
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in launchers}
    try:
        for launcher in launchers.values():  # a first one each builds what later ones reuse
            one(launcher, rootfs, args.memory_mb, checkpoint=not args.no_checkpoint)
        for _ in range(args.rounds):
            for name, launcher in launchers.items():  # interleaved: the same load for both
                rows[name].append(one(launcher, rootfs, args.memory_mb, checkpoint=not args.no_checkpoint))
    finally:  # the spare disks each launcher keeps ready are mounted: nothing is left behind
        for launcher in launchers.values():
            launcher.release_spares()
        shutil.rmtree(work, ignore_errors=True)
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
    if not args.no_checkpoint:
        print(f"\npause (checkpoint) and resume, {args.memory_mb} MB sandbox, the same rounds")
        print(
            f"{'runtime':10} {'checkpoint s':>13} {'image MB':>9} {'restore s':>10} {'restore -> result s':>20}"
        )
        for name, samples in rows.items():
            ck, rs, rr = (
                summary([x[k] for x in samples]) for k in ("checkpoint_s", "restore_s", "restore_result_s")
            )
            size = sorted(x["checkpoint_bytes"] for x in samples)[len(samples) // 2] / 2**20
            results[name].update(checkpoint=ck, restore=rs, restore_result=rr, checkpoint_mb=size)
            print(
                f"{name:10} {ck['median_s']:13.2f} {size:9.1f} {rs['median_s']:10.2f} {rr['median_s']:20.2f}"
            )
    ratio = results["microvm"]["first_result"]["median_s"] / results["gvisor"]["first_result"]["median_s"]
    results["median_ratio_microvm_over_gvisor"] = ratio
    print(f"median ratio microvm/gvisor: {ratio:.1f}x")
    write_results(args.json, results)


if __name__ == "__main__":
    main()
