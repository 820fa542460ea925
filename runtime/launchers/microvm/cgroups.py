"""A microVM's CPU quota on the host: QEMU's process (every vCPU thread and its own) in a cgroup
of the sandbox's under the node's cgroup parent, with ``cpu`` × the period as its quota, so a
sandbox asking for 1.5 CPUs runs two vCPUs that together get one and a half. cgroup v1 (the cpu
controller's hierarchy) or v2 (unified)."""

from __future__ import annotations

import contextlib
from pathlib import Path

BASE = Path("/sys/fs/cgroup")
PERIOD_US = 100_000


def _unified() -> bool:
    return (BASE / "cgroup.controllers").exists()


def cgroup_dir(parent: str, sandbox_id: str) -> Path:
    return (BASE if _unified() else BASE / "cpu") / parent / sandbox_id


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


def pids(parent: str, sandbox_id: str) -> list[int]:
    try:
        return [int(p) for p in (cgroup_dir(parent, sandbox_id) / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def remove(parent: str, sandbox_id: str) -> None:
    with contextlib.suppress(OSError):  # busy until QEMU is gone
        cgroup_dir(parent, sandbox_id).rmdir()
