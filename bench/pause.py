#!/usr/bin/env python3
"""Pause and resume through the API, in both modes, of a sandbox holding --touch-mb of
written memory. Each call is timed from request to answer (`wait: true`: paused, or running
again).

- `stop`: a process holds the memory when the sandbox is paused (and ends with the pause);
  after every resume the files (root filesystem and volume) are read back.
- `checkpoint`: one process fills --touch-mb with random bytes (nothing for a checkpoint to
  compress or skip) and holds it across every cycle, next to a counter whose count lives only
  in memory; after every resume the counter must have gone on from where it was and the
  memory holder must still run. The counter starts no process (shell builtins only; it sleeps
  in `read -t 0.1` on a FIFO): gVisor 20240729 keeps ~80 KB of saved state for every process
  a sandbox has ever started, so a counter that ran `mv` and `sleep` ten times a second (as
  `--churn` does) measures how many processes the sandbox started as much as its memory.

Starts its own `hangar up` on the embedded default in a temporary data dir. Prints a table and
writes JSON (default bench/results/pause.json). Needs root and runsc.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import client, start_hangar, stop_hangar, summary, write_results  # noqa: E402


def _timed(api, url: str, body: dict, want: str) -> float:
    start = time.perf_counter()
    r = api.post(url, json=body)
    took = time.perf_counter() - start
    if r.json().get("status") != want:
        raise RuntimeError(f"{url}: {r.text}")
    return took


def _run(api, sid: str, cmd: str) -> str:
    out = api.post(f"/sandboxes/{sid}/exec", json={"cmd": cmd}).json()
    if out.get("exit_code") != 0:
        raise RuntimeError(f"{cmd}: {out}")
    return str(out["stdout"])


def bench_stop(api, n: int, touch_mb: int) -> tuple[list[float], list[float]]:
    pauses: list[float] = []
    resumes: list[float] = []
    sb = api.post("/sandboxes", json={
        "image": "busybox", "memory_mb": touch_mb + 256, "timeout_s": 3600,
        "volumes": [{"volume": "bench", "mount_path": "/v"}],
    }).json()  # fmt: skip
    if sb.get("status") != "running":
        raise RuntimeError(f"create failed: {sb}")
    sid = sb["id"]
    _run(api, sid, "echo root > /root/f; echo vol > /v/f; sync")
    for i in range(n):
        # Memory in use when it is paused: a process holding --touch-mb of written pages.
        # (tail -c keeps the last N bytes of its input in memory until its input ends.)
        api.post(f"/sandboxes/{sid}/exec", json={
            "cmd": f"(head -c {touch_mb}m /dev/zero; sleep 3600) | tail -c {touch_mb}m >/dev/null",
            "background": True,
        })  # fmt: skip
        time.sleep(1.0 + touch_mb / 40)  # a gVisor pipe moves some 40+ MB/s here
        pauses.append(_timed(api, f"/sandboxes/{sid}/pause", {"mode": "stop"}, "paused"))
        resumes.append(_timed(api, f"/sandboxes/{sid}/resume", {}, "running"))
        if _run(api, sid, "cat /root/f /v/f") != "root\nvol\n":
            raise RuntimeError(f"files lost after resume {i}")
        print(f"stop cycle {i + 1}: pause {pauses[-1]:.3f} s, resume {resumes[-1]:.3f} s", flush=True)
    api.delete(f"/sandboxes/{sid}")
    return pauses, resumes


COUNTER = "mkfifo /root/tick; exec 3<>/root/tick; i=0; while :; do i=$((i+1)); echo $i > /root/count; read -t 0.1 -u 3 x; done"
CHURNING_COUNTER = (
    "i=0; while :; do i=$((i+1)); echo $i > /root/c.new; mv /root/c.new /root/count; sleep 0.1; done"
)


def _count(api, sid: str) -> int:
    """The counter's count (the builtin counter truncates its file before each write: a read
    may come in between)."""
    for _ in range(50):
        text = _run(api, sid, "cat /root/count").strip()
        if text:
            return int(text)
        time.sleep(0.01)
    raise RuntimeError("the counter's file stayed empty")


def bench_checkpoint(api, n: int, touch_mb: int, churn: bool = False) -> tuple[list[float], list[float], int]:
    pauses: list[float] = []
    resumes: list[float] = []
    sb = api.post("/sandboxes", json={
        "image": "busybox", "memory_mb": touch_mb + 256, "timeout_s": 3600, "pause_mode": "checkpoint",
    }).json()  # fmt: skip
    if sb.get("status") != "running":
        raise RuntimeError(f"create failed: {sb}")
    sid = sb["id"]
    # Random bytes, held by tail (it keeps the last N bytes of its input in memory).
    holder = api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": f"(head -c {touch_mb}m /dev/urandom; echo held > /root/held; sleep 36000) | tail -c {touch_mb}m >/dev/null",
        "background": True,
    }).json()  # fmt: skip
    counter = api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": CHURNING_COUNTER if churn else COUNTER,
        "background": True,
    }).json()  # fmt: skip
    deadline = time.monotonic() + 300
    while _run(api, sid, "cat /root/held 2>/dev/null || true").strip() != "held":
        if time.monotonic() > deadline:
            raise RuntimeError("the memory was not filled within 300 s")
        time.sleep(1)
    time.sleep(2)
    used = api.get(f"/sandboxes/{sid}/stats").json().get("memory_bytes", 0) if touch_mb else 0
    for i in range(n):
        before = _count(api, sid)
        pauses.append(_timed(api, f"/sandboxes/{sid}/pause", {"mode": "checkpoint"}, "paused"))
        paused = api.get(f"/sandboxes/{sid}").json()
        if paused["paused_mode"] != "checkpoint":
            raise RuntimeError(f"cycle {i}: the checkpoint failed: {paused['status_reason']}")
        resumes.append(_timed(api, f"/sandboxes/{sid}/resume", {}, "running"))
        resumed = [
            e["message"] for e in api.get(f"/sandboxes/{sid}/events").json() if "resumed" in e["message"]
        ]
        if not resumed[-1].startswith("resumed from its checkpoint"):
            raise RuntimeError(
                f"cycle {i}: {[e['message'] for e in api.get(f'/sandboxes/{sid}/events').json()][-6:]}"
            )
        after = _count(api, sid)
        if not before <= after < before + 50:
            raise RuntimeError(f"the counter did not carry on across cycle {i}: {before} -> {after}")
        for proc in (holder, counter):
            row = api.get(f"/sandboxes/{sid}/processes/{proc['id']}").json()
            if row["status"] != "running":
                raise RuntimeError(f"process {proc['id']} did not survive cycle {i}: {row}")
        if i == 0:
            for e in api.get(f"/sandboxes/{sid}/events").json()[-4:]:
                print("   ", e["created_at"], e["message"])
        print(f"checkpoint cycle {i + 1}: pause {pauses[-1]:.3f} s, resume {resumes[-1]:.3f} s "
              f"(counter {before} -> {after})", flush=True)  # fmt: skip
    api.delete(f"/sandboxes/{sid}")
    return pauses, resumes, int(used)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--touch-mb", type=int, default=512)
    parser.add_argument("--mode", choices=["stop", "checkpoint", "both"], default="both")
    parser.add_argument(
        "--churn",
        action="store_true",
        help="the checkpoint's counter runs mv and sleep ten times a second (processes)",
    )
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "pause.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    results: dict[str, object] = {"cpus": os.cpu_count(), "touch_mb": args.touch_mb}
    try:
        hangar = start_hangar(work / "data", args.port)
        with client(hangar.url, hangar.token) as api:
            api.post("/volumes", json={"name": "bench", "size_mb": 64}).raise_for_status()
            if args.mode in ("stop", "both"):
                pauses, resumes = bench_stop(api, args.n, args.touch_mb)
                results |= {"pause_stop": summary(pauses), "resume_stop": summary(resumes)}
            if args.mode in ("checkpoint", "both"):
                pauses, resumes, used = bench_checkpoint(api, args.n, args.touch_mb, churn=args.churn)
                results |= {"churn": args.churn, "pause_checkpoint": summary(pauses), "resume_checkpoint": summary(resumes),
                            "checkpoint_sandbox_memory_bytes": used}  # fmt: skip
    finally:
        stop_hangar(hangar, work)

    print()
    print("| measure | median | p95 | n |")
    print("| --- | --- | --- | --- |")
    for key, name in (("pause_stop", "pause, mode stop"), ("resume_stop", "resume, mode stop"),
                      ("pause_checkpoint", "pause, mode checkpoint"),
                      ("resume_checkpoint", "resume, mode checkpoint")):  # fmt: skip
        s = results.get(key)
        if isinstance(s, dict):
            print(
                f"| {name} ({args.touch_mb} MB touched) | {s['median_s']:.3f} s | {s['p95_s']:.3f} s | {s['n']} |"
            )
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
