"""What the benchmarks share: percentiles, an API client, and a `hangar up` of their own."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[k]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "median_s": statistics.median(values),
        "p95_s": pct(values, 95),
        "min_s": min(values),
        "max_s": max(values),
    }


def under_a_reaper() -> None:
    """Go on in a child process whose parent reaps orphans, as a node's ``hangar node`` / ``hangar
    up`` does (a child subreaper): a gVisor sandbox outlives the ``runsc`` that started it, and
    once it exits (after a checkpoint, say) it stays a zombie until someone reaps it, which
    ``runsc delete`` waits for (over a second under a lazy init). The parent reaps every orphan
    and leaves with the child's exit status; the child's own subprocesses stay the child's."""
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        return  # measured as it is, under the host's init
    child = os.fork()
    if child == 0:
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _frame: os.kill(child, signum))
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(1)
        if pid == child:
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)


def write_results(path: str, results: dict) -> None:
    """The bench's figures as JSON at ``path`` (its directory made if need be)."""
    import json

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"wrote {out}")


def client(url: str, token: str) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=120)


def wait_deleted(api: httpx.Client, sandbox_id: str, timeout: float = 60) -> None:
    """Until the node has destroyed it: the next measurement starts on a quiet machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = api.get(f"/sandboxes/{sandbox_id}")
        if r.status_code == 404 or r.json().get("status") in ("deleted", "failed"):
            return
        time.sleep(0.02)
    raise RuntimeError(f"sandbox {sandbox_id} was not deleted within {timeout:g}s")


@dataclass
class Hangar:
    proc: subprocess.Popen[str]
    url: str
    token: str
    admin: str
    password: str


def start_hangar(
    data_dir: Path, port: int, root: Path = ROOT, extra_env: dict[str, str] | None = None,
    extra_args: list[str] | None = None,
) -> Hangar:  # fmt: skip
    """`hangar up` on the embedded default in ``data_dir``; its first start prints the admin's
    login and an API token, which this reads. ``root``: the checkout whose code it runs (another
    commit's, in a worktree of its own, for a before-and-after in one run)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE")
    }
    # 20 sandboxes of 1 cpu at once on a 2-core machine: let the scheduler overcommit that far.
    env.update(HANGAR_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1", HANGAR_CPU_OVERCOMMIT="16")
    env.update(extra_env or {})
    proc = subprocess.Popen(
        [sys.executable, "-m", "dashboard.cli", "up", "--port", str(port), *(extra_args or [])],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    token = admin = password = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        if "API token" in line:
            token = line.split(": ", 1)[1].strip()
        if line.strip().startswith("admin:") and " / " in line:
            admin, _, rest = line.split(":", 1)[1].strip().partition(" / ")
            password = rest.split()[0]
        if "Press Ctrl-C" in line:
            break
    # BENCH_LOG=path keeps what Hangar logs during the run (the node's timings, for one).
    log_path = os.environ.get("BENCH_LOG")
    sink = open(log_path, "a") if log_path else None  # noqa: SIM115 - lives as long as the thread

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if sink is not None:
                sink.write(line)
                sink.flush()

    threading.Thread(target=drain, daemon=True).start()
    if not token:
        raise RuntimeError("hangar up did not print an API token")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/api/v1/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("hangar up did not answer within 60 s")
        time.sleep(0.1)
    return Hangar(proc=proc, url=url, token=token, admin=admin, password=password)


def destroy_leftovers(data_dir: Path) -> None:
    """Whatever a run left behind (sandboxes, spare disks, volume mounts) must not outlive the bench's
    data dir."""
    sys.path.insert(0, str(ROOT))
    from runtime.host.hostnames import node_id
    from runtime.host.volumes import VolumeStore
    from runtime.launchers.gvisor.launcher import GVisorLauncher

    # The node's own id (kept in its data dir): its names, its nftables table, are the node's.
    launcher = GVisorLauncher(state_dir=data_dir / "runtime" / "gvisor", node_id=node_id(data_dir))
    for sandbox_id in launcher.states():
        launcher.destroy(launcher.handle_for(sandbox_id))
    launcher.release_spares()  # the node's spare sandbox disks (loop mounts)
    launcher.network.remove_base()  # its nftables tables and address pool
    store = VolumeStore(data_dir / "volumes")
    for volume_id in store.list():
        store.delete(volume_id)


def stop_hangar(hangar: Hangar | None, work: Path) -> None:
    """Ctrl-C the bench's `hangar up`, clean up after it and remove its temporary dir."""
    if hangar is not None:
        hangar.proc.send_signal(signal.SIGINT)
        hangar.proc.wait(60)
        destroy_leftovers(work / "data")
    shutil.rmtree(work, ignore_errors=True)
