"""A sandbox's cgroups on the host: found under the node's cgroup parent (or the one every node
used before names carried the node's id), its memory limit lifted for a checkpoint and put back,
and whether the kernel killed it for memory."""

from __future__ import annotations

import contextlib
from pathlib import Path

LEGACY_CGROUP_PARENT = "hangar"  # every node's, before names carried the node's id


def cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]  # cgroup v2, unified
    return [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()] if base.exists() else []


def cgroup_dirs(parents: tuple[str, ...], sandbox_id: str) -> list[Path]:
    """The sandbox's cgroup in each hierarchy, under the first of ``parents`` that has it."""
    for parent in parents:
        found = [r / parent / sandbox_id for r in cgroup_roots() if (r / parent / sandbox_id).is_dir()]
        if found:
            return found
    return []


def remove(parents: tuple[str, ...], sandbox_id: str) -> None:
    for controller_dir in cgroup_dirs(parents, sandbox_id):
        with contextlib.suppress(OSError):  # still busy until runsc's processes are gone
            controller_dir.rmdir()


def lift_memory_limit(parents: tuple[str, ...], sandbox_id: str) -> list[tuple[Path, str]]:
    """Remove the memory limit of the sandbox's cgroup; returns what to write back."""
    lifted = []
    for d in cgroup_dirs(parents, sandbox_id):
        for name, unlimited in (("memory.limit_in_bytes", "-1"), ("memory.max", "max")):
            path = d / name
            with contextlib.suppress(OSError):
                old = path.read_text().strip()
                path.write_text(unlimited)
                lifted.append((path, old))
    return lifted


def restore_limits(lifted: list[tuple[Path, str]]) -> None:
    for path, old in lifted:
        with contextlib.suppress(OSError):
            path.write_text(old)


def oom_killed(parents: tuple[str, ...], sandbox_id: str) -> bool:
    for d in cgroup_dirs(parents, sandbox_id):
        for name in ("memory.oom_control", "memory.events"):
            with contextlib.suppress(OSError):
                for line in (d / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value or 0) > 0:
                        return True
    return False
