#!/usr/bin/env python3
"""Pause and resume in `stop` mode, through the API: a sandbox that has written files (in its
root filesystem and on a volume) and touched --touch-mb of memory is paused and resumed -n
times; each call is timed from request to answer (`wait: true`: paused, or running again), and
after every resume the files are read back.

Starts its own `hangar up` on the embedded default in a temporary data dir. Prints a table and
writes JSON (default bench/results/pause.json). Needs root and runsc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from _common import client, start_hangar, stop_hangar, summary  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=10)
    parser.add_argument("--touch-mb", type=int, default=256)
    parser.add_argument("--port", type=int, default=8767)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "pause.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    pauses: list[float] = []
    resumes: list[float] = []
    try:
        hangar = start_hangar(work / "data", args.port)
        with client(hangar.url, hangar.token) as api:
            api.post("/volumes", json={"name": "bench", "size_mb": 64}).raise_for_status()
            sb = api.post("/sandboxes", json={
                "image": "busybox", "memory_mb": args.touch_mb + 256, "timeout_s": 3600,
                "volumes": [{"volume": "bench", "mount_path": "/v"}],
            }).json()  # fmt: skip
            if sb.get("status") != "running":
                raise RuntimeError(f"create failed: {sb}")
            sid = sb["id"]
            api.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo root > /root/f; echo vol > /v/f; sync"})
            for i in range(args.n):
                # Memory in use when it is paused: a process holding --touch-mb of written pages.
                # (tail -c keeps the last N bytes of its input in memory until its input ends.)
                api.post(f"/sandboxes/{sid}/exec", json={
                    "cmd": f"(head -c {args.touch_mb}m /dev/zero; sleep 3600) | tail -c {args.touch_mb}m >/dev/null",
                    "background": True,
                })  # fmt: skip
                time.sleep(1.0 + args.touch_mb / 40)  # a gVisor pipe moves some 40+ MB/s here
                start = time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/pause", json={"mode": "stop"})
                pauses.append(time.perf_counter() - start)
                if r.json().get("status") != "paused":
                    raise RuntimeError(f"pause {i}: {r.text}")
                start = time.perf_counter()
                r = api.post(f"/sandboxes/{sid}/resume", json={})
                resumes.append(time.perf_counter() - start)
                if r.json().get("status") != "running":
                    raise RuntimeError(f"resume {i}: {r.text}")
                out = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "cat /root/f /v/f"}).json()
                if out.get("stdout") != "root\nvol\n":
                    raise RuntimeError(f"files after resume {i}: {out}")
                print(f"cycle {i + 1}: pause {pauses[-1]:.3f} s, resume {resumes[-1]:.3f} s", flush=True)
            api.delete(f"/sandboxes/{sid}")
    finally:
        stop_hangar(hangar, work)

    results = {"cpus": os.cpu_count(), "touch_mb": args.touch_mb, "pause_stop": summary(pauses),
               "resume_stop": summary(resumes)}  # fmt: skip
    print()
    print("| measure | median | p95 | n |")
    print("| --- | --- | --- | --- |")
    for name, key in (("pause, mode stop", "pause_stop"), ("resume, mode stop", "resume_stop")):
        s = results[key]
        print(
            f"| {name} ({args.touch_mb} MB touched) | {s['median_s']:.3f} s | {s['p95_s']:.3f} s | {s['n']} |"
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
