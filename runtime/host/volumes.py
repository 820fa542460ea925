"""Volumes on a node: each one an ext4 filesystem in a sparse file, loop-mounted on the host and
bind-mounted into the sandboxes that use it.

A filesystem of its own is what makes the size real: a write past it fails with ENOSPC inside
the sandbox (gVisor's gofer passes the host's error through), and the host's disk is never
filled beyond the volume's size. The file is created sparse, so an empty 10 GB volume costs
almost nothing. Mounts are host kernel state: sandboxes and Hangar's processes may restart
around them; after a reboot the next sandbox to use a volume mounts it again.

No Django here: ids and sizes in, paths and numbers out.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .locks import file_lock

ID_RE = re.compile(r"vol[a-z0-9]{6,40}")


class VolumeError(Exception):
    pass


@dataclass(frozen=True)
class VolumeUsage:
    used_bytes: int
    total_bytes: int


class VolumeStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    # -- paths -------------------------------------------------------------------------------

    def _check(self, volume_id: str) -> str:
        if not ID_RE.fullmatch(volume_id):
            raise VolumeError(f"invalid volume id {volume_id!r}")
        return volume_id

    def image(self, volume_id: str) -> Path:
        return self.root / "images" / f"{self._check(volume_id)}.ext4"

    def mountpoint(self, volume_id: str) -> Path:
        return self.root / "mnt" / self._check(volume_id)

    def _lock(self, volume_id: str) -> contextlib.AbstractContextManager[None]:
        (self.root / "locks").mkdir(parents=True, exist_ok=True)
        return file_lock(self.root / "locks" / f"{self._check(volume_id)}.lock")

    # -- lifecycle ---------------------------------------------------------------------------

    def exists(self, volume_id: str) -> bool:
        return self.image(volume_id).exists()

    def create(self, volume_id: str, size_mb: int) -> None:
        """Make the volume's filesystem (idempotent: an existing one is kept as it is)."""
        if size_mb < 16:
            raise VolumeError("a volume needs at least 16 MB")
        image = self.image(volume_id)
        with self._lock(volume_id):
            if image.exists():
                return
            image.parent.mkdir(parents=True, exist_ok=True)
            tmp = image.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.truncate(size_mb * 1024 * 1024)
            # No reserved blocks (the whole size is the user's); root-owned root directory.
            _run(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-m",
                    "0",
                    "-E",
                    "root_owner=0:0,lazy_itable_init=1",
                    "-L",
                    volume_id[:16],
                    str(tmp),
                ]
            )
            os.replace(tmp, image)

    def mount(self, volume_id: str) -> Path:
        """Mount the volume if it is not mounted yet; returns where (idempotent)."""
        image, target = self.image(volume_id), self.mountpoint(volume_id)
        with self._lock(volume_id):
            if _is_mounted(target):
                return target
            if not image.exists():
                raise VolumeError(f"volume {volume_id} has no data on this node")
            target.mkdir(parents=True, exist_ok=True)
            _run(["mount", "-o", "loop,nodev,nosuid", str(image), str(target)])
            with contextlib.suppress(OSError):
                (target / "lost+found").rmdir()  # mkfs's; the user's files only
            return target

    def unmount(self, volume_id: str) -> None:
        target = self.mountpoint(volume_id)
        with self._lock(volume_id):
            if _is_mounted(target):
                # Lazy: a sandbox's gofer may let go of it a moment later.
                _run(["umount", "-l", str(target)])

    def usage(self, volume_id: str) -> VolumeUsage:
        st = os.statvfs(self.mount(volume_id))
        total = st.f_blocks * st.f_frsize
        return VolumeUsage(used_bytes=total - st.f_bfree * st.f_frsize, total_bytes=total)

    def delete(self, volume_id: str) -> None:
        """Unmount and remove the volume's data (idempotent)."""
        self.unmount(volume_id)
        with self._lock(volume_id):
            self.image(volume_id).unlink(missing_ok=True)
            target = self.mountpoint(volume_id)
            if target.exists() and not _is_mounted(target):
                shutil.rmtree(target, ignore_errors=True)

    def list(self) -> list[str]:
        d = self.root / "images"
        return sorted(p.stem for p in d.glob("*.ext4")) if d.exists() else []


def _is_mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f if len(line.split()) > 1)


def _run(cmd: list[str]) -> None:
    run_tool(cmd, VolumeError)


def run_tool(cmd: list[str], error: type[Exception], timeout: float = 120) -> None:
    """Run a host tool (mkfs.ext4, mount, umount); ``error`` with its words if it fails."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise error(f"{cmd[0]} is not installed (e2fsprogs, mount)") from None
    except subprocess.TimeoutExpired:
        raise error(f"{cmd[0]} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        raise error(f"{' '.join(cmd[:2])} failed: {(proc.stderr or proc.stdout).strip()[:500]}")
