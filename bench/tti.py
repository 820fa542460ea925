#!/usr/bin/env python3
"""Time to interactive: raw runsc against Hangar's API, in one run.

(a) raw: `runsc run --detach` of the busybox bundle, then `runsc exec … echo ok`;
(b) Hangar: `POST /sandboxes` (wait) then `POST /sandboxes/{id}/exec` `echo ok`, N times one
    after another, then N at once;
(a) and (b) one after another are interleaved (raw, Hangar, Hangar, raw, …), each starting once
the previous one's sandbox is gone: on a machine whose speed drifts from minute to minute, both
see the same conditions, so their ratio means something;
(c) exec on a running sandbox through the API, and through the launcher directly;
(d) resident memory of an idle sandbox (every runsc process of that sandbox).

Starts its own `hangar up` on the embedded default in a temporary data dir unless --url and
--token point at a running Hangar. Prints a table and writes JSON (default bench/results/tti.json).
Needs root and runsc.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import client, start_hangar, stop_hangar, summary, wait_deleted, write_results  # noqa: E402

from runtime.host.images.store import ImageStore  # noqa: E402
from runtime.launchers.gvisor.runsc import DEFAULT_PLATFORM, default_runsc  # noqa: E402

RUNSC = os.environ.get("HANGAR_RUNSC") or default_runsc()  # the one Hangar itself runs
PLATFORM = os.environ.get("HANGAR_RUNSC_PLATFORM", DEFAULT_PLATFORM)  # and the same platform

# -- (a) raw runsc ----------------------------------------------------------------------------


def raw_bundle(work: Path) -> tuple[Path, Path]:
    store = ImageStore(work / "images")
    rootfs = store.build_busybox().rootfs
    bundle = work / "bundle"
    if (bundle / "config.json").exists():
        return bundle, work / "runsc-root"
    bundle.mkdir(exist_ok=True)
    subprocess.run([RUNSC, "spec"], cwd=bundle, check=True)
    spec = json.loads((bundle / "config.json").read_text())
    spec["process"]["args"] = ["/bin/sleep", "3600"]
    spec["process"]["terminal"] = False
    spec["root"] = {"path": str(rootfs), "readonly": True}
    (bundle / "config.json").write_text(json.dumps(spec))
    return bundle, work / "runsc-root"


def raw_once(bundle: Path, root: Path) -> tuple[float, str]:
    cid = "raw" + uuid.uuid4().hex[:10]
    start = time.perf_counter()
    subprocess.run(
        [RUNSC, "--root", str(root), f"--platform={PLATFORM}", "--network=none", "run", "--detach", "--bundle", str(bundle), cid],
        check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    out = subprocess.run(
        [RUNSC, "--root", str(root), f"--platform={PLATFORM}", "exec", cid, "echo", "ok"],
        capture_output=True,
        check=True,
    )
    elapsed = time.perf_counter() - start
    assert out.stdout == b"ok\n"
    return elapsed, cid


def raw_cleanup(root: Path, cid: str) -> None:
    subprocess.run([RUNSC, "--root", str(root), "delete", "--force", cid], capture_output=True)


def raw_runsc_concurrent(n: int, work: Path) -> list[float]:
    bundle, root = raw_bundle(work)
    results: list[tuple[float, str]] = []
    barrier = threading.Barrier(n)

    def one() -> None:
        barrier.wait()
        results.append(raw_once(bundle, root))

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _, cid in results:
        raw_cleanup(root, cid)
    return [t for t, _ in results]


# -- (b) Hangar through the API ---------------------------------------------------------------


def hangar_once(api: httpx.Client, created: list[str]) -> float:
    start = time.perf_counter()
    r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256, "cpu": 1, "timeout_s": 600})
    sb = r.json()
    if r.status_code != 201 or sb.get("status") != "running":
        raise RuntimeError(f"create failed: {r.status_code} {r.text}")
    out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": ["echo", "ok"]}).json()
    elapsed = time.perf_counter() - start
    assert out["stdout"] == "ok\n", out
    created.append(sb["id"])
    return elapsed


def interleaved(api: httpx.Client, n: int, work: Path, created: list[str]) -> tuple[list[float], list[float]]:
    """n raw runs and n Hangar creates, alternating (ABBA), none timed while another's
    sandbox is still being torn down."""
    bundle, root = raw_bundle(work)
    raw: list[float] = []
    hangar: list[float] = []

    def raw_step() -> None:
        elapsed, cid = raw_once(bundle, root)
        raw.append(elapsed)
        raw_cleanup(root, cid)

    def hangar_step() -> None:
        hangar.append(hangar_once(api, created))
        sid = created.pop()
        api.delete(f"/sandboxes/{sid}")
        wait_deleted(api, sid)

    for i in range(n):
        steps = (raw_step, hangar_step) if i % 2 == 0 else (hangar_step, raw_step)
        for step in steps:
            step()
    return raw, hangar


def hangar_concurrent(url: str, token: str, n: int, created: list[str]) -> list[float]:
    times: list[float] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def one() -> None:
        with client(url, token) as api:
            barrier.wait()
            try:
                times.append(hangar_once(api, created))
            except BaseException as exc:  # reported below
                errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{len(errors)} concurrent creates failed: {errors[0]}")
    return times


def exec_latency(api: httpx.Client, sandbox_id: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        out = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": ["echo", "ok"]}).json()
        times.append(time.perf_counter() - start)
        assert out.get("stdout") == "ok\n", out
    return times


def launcher_exec_latency(data_dir: Path, sandbox_id: str, n: int) -> list[float]:
    from runtime.launchers.agent.client import AgentClient

    sock = data_dir / "runtime" / "gvisor" / "sandboxes" / sandbox_id / "run" / "agent.sock"
    agent = AgentClient(sock)
    times = []
    for _ in range(n):
        start = time.perf_counter()
        r = agent.exec(["echo", "ok"])
        times.append(time.perf_counter() - start)
        assert r.stdout == b"ok\n"
    return times


def idle_memory_mb(sandbox_id: str) -> dict[str, float]:
    """RSS, PSS and USS summed over the sandbox's runsc processes (sandbox and gofer). RSS counts
    the runsc binary's pages that every sandbox shares; USS is what this sandbox alone costs."""
    totals = {"rss": 0, "pss": 0, "uss": 0}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if sandbox_id.encode() not in cmdline:
                continue
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                key, _, rest = line.partition(":")
                kb = int(rest.split()[0]) if rest.strip() and rest.split()[0].isdigit() else 0
                if key == "Rss":
                    totals["rss"] += kb
                elif key == "Pss":
                    totals["pss"] += kb
                elif key in ("Private_Clean", "Private_Dirty"):
                    totals["uss"] += kb
        except OSError:
            continue
    return {k: v / 1024 for k, v in totals.items()}


def wait_all_deleted(api: httpx.Client, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while api.get("/sandboxes").json() and time.monotonic() < deadline:
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--url")
    parser.add_argument("--token")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "tti.json"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-"))
    hangar = None
    results: dict[str, object] = {"n": args.n, "cpus": os.cpu_count(), "runsc": subprocess.run(
        [RUNSC, "--version"], capture_output=True, text=True).stdout.splitlines()[0]}  # fmt: skip
    try:
        url, token = args.url, args.token
        if not url:
            hangar = start_hangar(work / "data", args.port)
            token, url = hangar.token, hangar.url
        created: list[str] = []
        with client(url, token) as api:
            hangar_once(api, created)  # warm-up: first-use costs (agent build, caches) are not TTI
            bundle, root = raw_bundle(work)
            raw_cleanup(root, raw_once(bundle, root)[1])  # and the raw side's
            api.delete(f"/sandboxes/{created[-1]}")
            wait_deleted(api, created.pop())
            print(f"raw runsc (run --detach + exec echo ok) and Hangar (create + exec), {args.n} each, "
                  "interleaved…", flush=True)  # fmt: skip
            raw, seq = interleaved(api, args.n, work, created)
            print(f"raw runsc: {args.n} at once…", flush=True)
            raw_conc = raw_runsc_concurrent(args.n, work)
            print(f"hangar: {args.n} concurrent creates + exec…", flush=True)
            conc = hangar_concurrent(url, token, args.n, created)
            for sid in created:
                api.delete(f"/sandboxes/{sid}")
            created.clear()
            hangar_once(api, created)
            sid = created[0]
            print("exec latency on a running sandbox…", flush=True)
            api_exec = exec_latency(api, sid, 200)
            direct_exec = launcher_exec_latency(work / "data", sid, 200) if not args.url else []
            api.delete(f"/sandboxes/{sid}")
            hangar_once(api, created)  # a fresh sandbox that only ran `echo ok`, then sits idle
            time.sleep(2)
            memory = idle_memory_mb(created[-1])
            api.delete(f"/sandboxes/{created[-1]}")
            wait_all_deleted(api)
        results.update(
            raw_runsc=summary(raw), raw_runsc_concurrent=summary(raw_conc), hangar_sequential=summary(seq), hangar_concurrent=summary(conc),
            api_exec=summary(api_exec), agent_exec=summary(direct_exec) if direct_exec else None,
            idle_sandbox_memory_mb=memory,
            ratio_sequential_median=statistics.median(seq) / statistics.median(raw),
        )  # fmt: skip
    finally:
        stop_hangar(hangar, work)

    def row(name: str, s: dict[str, float] | None, unit: float = 1.0, label: str = "s") -> str:
        if not s:
            return f"| {name} | – | – | – |"
        return f"| {name} | {s['median_s'] * unit:.3f} {label} | {s['p95_s'] * unit:.3f} {label} | {s['n']} |"

    print()
    print("| measure | median | p95 | n |")
    print("| --- | --- | --- | --- |")
    print(row("raw runsc: run --detach + exec", results["raw_runsc"]))  # type: ignore[arg-type]
    print(row(f"raw runsc: run --detach + exec, {args.n} at once", results["raw_runsc_concurrent"]))  # type: ignore[arg-type]
    print(row("Hangar API: create (wait) + exec, sequential", results["hangar_sequential"]))  # type: ignore[arg-type]
    print(row(f"Hangar API: create (wait) + exec, {args.n} at once", results["hangar_concurrent"]))  # type: ignore[arg-type]
    print(row("exec on a running sandbox, through the API", results["api_exec"], 1000, "ms"))  # type: ignore[arg-type]
    print(row("exec on a running sandbox, agent socket", results["agent_exec"], 1000, "ms"))  # type: ignore[arg-type]
    mem = results["idle_sandbox_memory_mb"]
    print(
        f"| idle sandbox memory, runsc sandbox + gofer: RSS / PSS / USS | {mem['rss']:.1f} / {mem['pss']:.1f} / {mem['uss']:.1f} MB | | 1 |"
    )  # type: ignore[index]
    print(f"\nHangar / raw (sequential medians): {results['ratio_sequential_median']:.2f}×")
    write_results(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
