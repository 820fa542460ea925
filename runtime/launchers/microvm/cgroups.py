"""A microVM's CPU quota and memory limit on the host: QEMU's process (every vCPU thread and its
own) in a cgroup of the sandbox's under the node's cgroup parent, with ``cpu`` × the period as
its quota, so a sandbox asking for 1.5 CPUs runs two vCPUs that together get one and a half, and
a memory limit of the guest's RAM plus QEMU's own allowance (its code, device buffers and, under
TCG, translated code): the guest is bounded by its RAM, QEMU by this. cgroup v1 (the cpu and
memory controllers' hierarchies) or v2 (unified)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

BASE = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _unified() -> bool:
    return (BASE / "cgroup.controllers").exists()


def cgroup_dir(parent: str, sandbox_id: str, controller: str = "cpu") -> Path:
    return (BASE if _unified() else BASE / controller) / parent / sandbox_id


def limit_cpu(parent: str, sandbox_id: str, pid: int, cpu: float) -> Path | None:
    """Put ``pid`` in the sandbox's cgroup with a quota of ``cpu`` CPUs; None where the host's
    cgroups cannot (no cpu controller, not root): the VM is then bounded by its vCPUs alone."""
    d = cgroup_dir(parent, sandbox_id)
    quota = max(1000, int(cpu * PERIOD_US))
    try:
        if _unified():
            # The cpu controller has to be enabled on the way down for cpu.max to exist.
            with contextlib.suppress(OSError):
                (BASE / "cgroup.subtree_control").write_text("+cpu")
            d.parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (d.parent / "cgroup.subtree_control").write_text("+cpu")
            d.mkdir(exist_ok=True)
            (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:
            d.mkdir(parents=True, exist_ok=True)
            (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (d / "cpu.cfs_quota_us").write_text(str(quota))
        (d / "cgroup.procs").write_text(str(pid))
    except OSError:
        return None
    return d


def limit_memory(parent: str, sandbox_id: str, pid: int, limit_bytes: int) -> Path | None:
    """Put ``pid`` in the sandbox's memory cgroup, limited to ``limit_bytes`` (no swap beyond
    it); None where the host's cgroups cannot (no memory controller, not root)."""
    d = cgroup_dir(parent, sandbox_id, "memory")
    try:
        if _unified():
            with contextlib.suppress(OSError):
                (BASE / "cgroup.subtree_control").write_text("+memory")
            d.parent.mkdir(exist_ok=True)
            with contextlib.suppress(OSError):
                (d.parent / "cgroup.subtree_control").write_text("+memory")
            d.mkdir(exist_ok=True)
            (d / "memory.max").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # no swap accounting: nothing to bound
                (d / "memory.swap.max").write_text("0")
        else:
            d.mkdir(parents=True, exist_ok=True)
            (d / "memory.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):
                (d / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            with contextlib.suppress(OSError):  # what QEMU touched before it joined comes with it
                (d / "memory.move_charge_at_immigrate").write_text("3")
        (d / "cgroup.procs").write_text(str(pid))
    except OSError:
        return None
    return d


def memory_limit(parent: str, sandbox_id: str) -> int | None:
    """The bytes the sandbox's memory cgroup allows (None: no cgroup, or no limit)."""
    d = cgroup_dir(parent, sandbox_id, "memory")
    try:
        text = (d / ("memory.max" if _unified() else "memory.limit_in_bytes")).read_text().strip()
    except OSError:
        return None
    return None if text == "max" or int(text) >= 1 << 62 else int(text)


def oom_killed(parent: str, sandbox_id: str) -> bool:
    """Whether the kernel killed a process of the sandbox's memory cgroup for its limit."""
    d = cgroup_dir(parent, sandbox_id, "memory")
    try:
        text = (d / ("memory.events" if _unified() else "memory.oom_control")).read_text()
    except OSError:
        return False
    counts = dict(line.split()[:2] for line in text.splitlines() if len(line.split()) >= 2)
    return int(counts.get("oom_kill", "0")) > 0


def quota(parent: str, sandbox_id: str) -> float | None:
    """The CPUs the sandbox's cgroup allows (None: no cgroup, or no quota)."""
    d = cgroup_dir(parent, sandbox_id)
    try:
        if _unified():
            limit, period = (d / "cpu.max").read_text().split()
            return None if limit == "max" else int(limit) / int(period)
        quota_us = int((d / "cpu.cfs_quota_us").read_text())
        return None if quota_us < 0 else quota_us / int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def pids(parent: str, sandbox_id: str, controller: str = "cpu") -> list[int]:
    try:
        return [
            int(p) for p in (cgroup_dir(parent, sandbox_id, controller) / "cgroup.procs").read_text().split()
        ]
    except (OSError, ValueError):
        return []


def remove(parent: str, sandbox_id: str, wait_s: float = 10.0) -> None:
    """The sandbox's cgroups gone, once QEMU has left them: a killed QEMU that this process did
    not start (one re-adopted after a restart) cannot be waited for, and stays in its cgroup
    while it exits (a large guest's memory takes a while to free), so the removal waits up to
    ``wait_s`` for it rather than leaving the cgroup behind."""
    deadline = time.monotonic() + wait_s
    for controller in ("cpu",) if _unified() else ("cpu", "memory"):
        d = cgroup_dir(parent, sandbox_id, controller)
        while True:
            try:
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:  # busy until QEMU is gone
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
