#!/usr/bin/env python3
"""The E2B compatibility layer's cost: the real ``e2b`` SDK against Hangar's own API, in one run.

(a) create + first command: Hangar's ``POST /sandboxes`` (wait) then ``POST …/exec true``,
    against the SDK's ``Sandbox.create`` then ``sbx.commands.run("true")``; both without a
    network (the SDK's ``allow_internet_access=False``), the same image and size, interleaved
    (Hangar, E2B, E2B, Hangar, …) and each timed once the previous one's sandbox is gone;
(b) one command on a running sandbox: ``sbx.commands.run("true")`` through envd, and Hangar's
    own ``POST …/exec`` on the same sandbox, interleaved.

Targets (issue 21): (a) E2B's median at most 1.2 × Hangar's; (b) the SDK's median ≤ 25 ms.
``--baseline DIR`` also starts a `hangar up` from another checkout (the parent commit, in a
``git worktree`` of its own) and times (b) on both, alternating call by call (ABBA), so a
change is measured against its parent under the same load.
Starts its own `hangar up` on the embedded default in a temporary data dir unless --url and
--token point at a running Hangar. Prints a table and writes JSON (default bench/results/e2b.json).
Needs root and runsc.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _common import client, start_hangar, stop_hangar, summary, wait_deleted, write_results  # noqa: E402

# This file is bench/e2b.py: with its folder first on the path, `import e2b` would find itself.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

IMAGE = "busybox"
MEMORY_MB = 512
TIMEOUT_S = 600


def hangar_once(api: httpx.Client) -> tuple[float, str]:
    start = time.perf_counter()
    r = api.post(
        "/sandboxes", json={"image": IMAGE, "memory_mb": MEMORY_MB, "cpu": 1, "timeout_s": TIMEOUT_S}
    )
    sb = r.json()
    if r.status_code != 201 or sb.get("status") != "running":
        raise RuntimeError(f"create failed: {r.status_code} {r.text}")
    out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "true"}).json()
    elapsed = time.perf_counter() - start
    if out.get("exit_code") != 0:
        raise RuntimeError(f"exec failed: {out}")
    return elapsed, sb["id"]


def e2b_once() -> tuple[float, str]:
    from e2b import Sandbox

    start = time.perf_counter()
    sbx = Sandbox.create(IMAGE, timeout=TIMEOUT_S, allow_internet_access=False)
    result = sbx.commands.run("true")
    elapsed = time.perf_counter() - start
    if result.exit_code != 0:
        raise RuntimeError(f"command failed: {result}")
    return elapsed, sbx.sandbox_id


def create_interleaved(api: httpx.Client, n: int) -> tuple[list[float], list[float]]:
    """n of each, ABBA: Hangar, E2B, E2B, Hangar, …"""
    own: list[float] = []
    sdk: list[float] = []
    order = [(hangar_once, own), (e2b_once, sdk)]
    for i in range(n):
        for step, into in order if i % 2 == 0 else order[::-1]:
            elapsed, sid = step() if step is e2b_once else step(api)
            into.append(elapsed)
            api.delete(f"/sandboxes/{sid}")
            wait_deleted(api, sid)
    return own, sdk


def command_interleaved(api: httpx.Client, n: int) -> tuple[list[float], list[float]]:
    """``commands.run("true")`` and Hangar's exec on one running sandbox, alternating."""
    from e2b import Sandbox

    sbx = Sandbox.create(IMAGE, timeout=TIMEOUT_S, allow_internet_access=False)
    own: list[float] = []
    sdk: list[float] = []
    try:
        sbx.commands.run("true")  # the first call's connection set-up is not what is measured
        api.post(f"/sandboxes/{sbx.sandbox_id}/exec", json={"cmd": "true"})
        for _ in range(n):
            start = time.perf_counter()
            sbx.commands.run("true")
            sdk.append(time.perf_counter() - start)
            start = time.perf_counter()
            r = api.post(f"/sandboxes/{sbx.sandbox_id}/exec", json={"cmd": "true"})
            own.append(time.perf_counter() - start)
            if r.status_code != 200:
                raise RuntimeError(f"exec failed: {r.status_code} {r.text}")
    finally:
        sbx.kill()
    return own, sdk


def commands_against_baseline(
    ours: dict[str, str], theirs: dict[str, str], n: int
) -> tuple[list[float], list[float]]:
    """``commands.run("true")`` on one running sandbox of each Hangar (``api_url``,
    ``sandbox_url``, ``api_key``), alternating ABBA: (this checkout's, the baseline's)."""
    from e2b import Sandbox

    boxes = [
        Sandbox.create(IMAGE, timeout=TIMEOUT_S, allow_internet_access=False, **o) for o in (ours, theirs)
    ]
    times: tuple[list[float], list[float]] = ([], [])
    try:
        for sbx in boxes:
            for _ in range(3):  # connection set-up and first-use costs are not what is measured
                sbx.commands.run("true")
        for i in range(n):
            for k in (0, 1) if i % 2 == 0 else (1, 0):
                start = time.perf_counter()
                result = boxes[k].commands.run("true")
                times[k].append(time.perf_counter() - start)
                if result.exit_code != 0:
                    raise RuntimeError(f"command failed: {result}")
    finally:
        for sbx in boxes:
            sbx.kill()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-n", type=int, default=20, help="creates of each kind")
    parser.add_argument("--commands", type=int, default=200, help="commands of each kind")
    parser.add_argument("--url")
    parser.add_argument("--token")
    parser.add_argument("--port", type=int, default=8794)
    parser.add_argument("--json", default=str(ROOT / "bench" / "results" / "e2b.json"))
    parser.add_argument(
        "--baseline", help="another checkout (the parent commit's worktree) to time commands.run against"
    )
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hangar-bench-e2b-"))
    hangar = baseline = None
    # Two Hangars at once (--baseline): neither takes the host-wide ports (SSH gateway,
    # hangar.internal), which the bench's sandboxes (no network, no harness) do not use.
    side_by_side = {"HANGAR_SSH_PORT": "0", "HANGAR_SANDBOX_GATEWAY_PORT": "0"} if args.baseline else None
    results: dict[str, object] = {"n": args.n, "commands": args.commands, "cpus": os.cpu_count()}
    try:
        url, token = args.url, args.token
        if not url:
            hangar = start_hangar(work / "data", args.port, extra_env=side_by_side)
            token, url = hangar.token, hangar.url
        os.environ.update(E2B_API_URL=f"{url}/e2b", E2B_SANDBOX_URL=f"{url}/e2b/envd", E2B_API_KEY=token)
        import e2b

        results["e2b"] = getattr(e2b, "__version__", None) or _version("e2b")
        with client(url, token) as api:
            for _ in range(2):  # warm-up: first-use costs (agent build, caches) are not what is measured
                _, sid = hangar_once(api)
                api.delete(f"/sandboxes/{sid}")
                wait_deleted(api, sid)
                _, sid = e2b_once()
                api.delete(f"/sandboxes/{sid}")
                wait_deleted(api, sid)
            print(
                f"create + first command: Hangar's API and the E2B SDK, {args.n} each, interleaved…",
                flush=True,
            )
            own, sdk = create_interleaved(api, args.n)
            print(f"one command on a running sandbox, {args.commands} each, interleaved…", flush=True)
            own_cmd, sdk_cmd = command_interleaved(api, args.commands)
        if args.baseline:
            baseline = start_hangar(
                work / "baseline" / "data",
                args.port + 1,
                root=Path(args.baseline).resolve(),
                extra_env=side_by_side,
            )
            print(
                f"commands.run against the baseline ({args.baseline}), {args.commands} each, ABBA…",
                flush=True,
            )
            ours_, theirs_ = (
                {"api_url": f"{u}/e2b", "sandbox_url": f"{u}/e2b/envd", "api_key": k}
                for u, k in ((url, token), (baseline.url, baseline.token))
            )
            after, before = commands_against_baseline(ours_, theirs_, args.commands)
            results.update(baseline=args.baseline, ab_commands_run_after=summary(after),
                           ab_commands_run_before=summary(before))  # fmt: skip
        results.update(
            hangar_create_first_command=summary(own), e2b_create_first_command=summary(sdk),
            ratio_create_median=statistics.median(sdk) / statistics.median(own),
            hangar_exec=summary(own_cmd), e2b_commands_run=summary(sdk_cmd),
        )  # fmt: skip
    finally:
        if baseline is not None:
            stop_hangar(baseline, work / "baseline")
        stop_hangar(hangar, work)

    def row(name: str, s: dict[str, float], unit: float, label: str) -> str:
        return f"| {name} | {s['median_s'] * unit:.1f} {label} | {s['p95_s'] * unit:.1f} {label} | {s['n']} |"

    print()
    print("| measure | median | p95 | n |")
    print("| --- | --- | --- | --- |")
    print(row("create + first command, Hangar API", results["hangar_create_first_command"], 1000, "ms"))  # type: ignore[arg-type]
    print(row("create + first command, E2B SDK", results["e2b_create_first_command"], 1000, "ms"))  # type: ignore[arg-type]
    print(row("exec `true`, Hangar API", results["hangar_exec"], 1000, "ms"))  # type: ignore[arg-type]
    print(row('commands.run("true"), E2B SDK', results["e2b_commands_run"], 1000, "ms"))  # type: ignore[arg-type]
    if args.baseline:
        print(row('commands.run("true"), this checkout (ABBA)', results["ab_commands_run_after"], 1000, "ms"))  # type: ignore[arg-type]
        print(row('commands.run("true"), baseline (ABBA)', results["ab_commands_run_before"], 1000, "ms"))  # type: ignore[arg-type]
    ratio = results["ratio_create_median"]
    print(f"\nE2B / Hangar create + first command (medians): {ratio:.2f}× (target ≤ 1.2×)")
    write_results(args.json, results)
    return 0


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    sys.exit(main())
