"""Volumes on a node: each one an ext4 filesystem in a sparse file, loop-mounted on the host and
bind-mounted into the sandboxes that use it.

A filesystem of its own is what makes the size real: a write past it fails with ENOSPC inside
the sandbox (gVisor's gofer passes the host's error through), and the host's disk is never
filled beyond the volume's size. The file is created sparse, so an empty 10 GB volume costs
almost nothing. Mounts are host kernel state: sandboxes and Hangar's processes may restart
around them; after a reboot the next sandbox to use a volume mounts it again.

A microVM attaches the file itself as a disk, and its own kernel mounts it: a filesystem is
mounted by one kernel at a time, so while a VM holds a volume the host does not mount it and no
other VM attaches it. The holder is written beside the image (:func:`hold`): its process (pid and
start time, so a reused pid holds nothing) and its sandbox; a holder whose process is gone holds
nothing.

No Django here: ids and sizes in, paths and numbers out.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
        return _image_lock(self.image(volume_id))

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
            held = holder(image)
            if held is not None:
                raise VolumeError(f"volume {volume_id} is attached as a disk to microVM sandbox {held}")
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
        """Used and total bytes as ``df`` counts them. While a microVM holds the volume the host
        cannot mount it: then as its superblock last said (written when the guest unmounts it;
        the caller asks the guest for a current figure)."""
        image = self.image(volume_id)
        if holder(image) is not None:
            return superblock_usage(image)
        st = os.statvfs(self.mount(volume_id))
        total = st.f_blocks * st.f_frsize
        return VolumeUsage(used_bytes=total - st.f_bfree * st.f_frsize, total_bytes=total)

    def attach_as_disk(self, volume_id: str, sandbox_id: str) -> Path:
        """The volume's image for ``sandbox_id``'s microVM to attach: unmounted from the host (a
        volume still in use there is refused), held for the sandbox by this process until its VM
        holds it (:func:`hold`). VolumeError if another sandbox's VM holds it."""
        image, target = self.image(volume_id), self.mountpoint(volume_id)
        with self._lock(volume_id):
            if not image.exists():
                raise VolumeError(f"volume {volume_id} has no data on this node")
            held = holder(image)
            if held is not None and held != sandbox_id:
                raise VolumeError(f"volume {volume_id} is attached as a disk to microVM sandbox {held}")
            if held is None:  # (held: the sandbox's VM runs already, and keeps holding it)
                if _is_mounted(target):
                    try:  # not lazily: a filesystem still in use on the host must not go to a VM
                        run_tool(["umount", str(target)], VolumeError)
                    except VolumeError as exc:
                        raise VolumeError(f"volume {volume_id} is still in use on this node: {exc}") from None
                _write_holder(image, sandbox_id, os.getpid())
        return image

    def delete(self, volume_id: str) -> None:
        """Unmount and remove the volume's data (idempotent)."""
        held = holder(self.image(volume_id))
        if held is not None:
            raise VolumeError(f"volume {volume_id} is attached as a disk to microVM sandbox {held}")
        self.unmount(volume_id)
        with self._lock(volume_id):
            holder_path(self.image(volume_id)).unlink(missing_ok=True)
            self.image(volume_id).unlink(missing_ok=True)
            target = self.mountpoint(volume_id)
            if target.exists() and not _is_mounted(target):
                shutil.rmtree(target, ignore_errors=True)

    def list(self) -> list[str]:
        d = self.root / "images"
        return sorted(p.stem for p in d.glob("*.ext4")) if d.exists() else []


# -- a volume attached as a VM's disk ---------------------------------------------------------


def _image_lock(image: Path) -> contextlib.AbstractContextManager[None]:
    """The volume's lock (``<root>/locks/<id>.lock``), from its image's path."""
    locks = image.parent.parent / "locks"
    locks.mkdir(parents=True, exist_ok=True)
    return file_lock(locks / f"{image.stem}.lock")


def holder_path(image: Path) -> Path:
    return image.with_suffix(".holder")


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[19].decode() if len(fields) > 19 and fields[0] != b"Z" else None


def _holder_record(image: Path) -> dict[str, Any]:
    try:
        record = json.loads(holder_path(image).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def holder(image: Path) -> str | None:
    """The sandbox that has the volume's image as a disk, if any: while its process (a VM's
    QEMU) lives, or while the checkpoint of its VM, which has the volume mounted in its saved
    memory, is kept."""
    record = _holder_record(image)
    sandbox_id = record.get("sandbox")
    if not isinstance(sandbox_id, str):
        return None
    if "checkpoint" in record:
        return sandbox_id if Path(str(record["checkpoint"])).exists() else None
    try:
        return sandbox_id if _start_time(int(record["pid"])) == record.get("start") else None
    except (KeyError, TypeError, ValueError):
        return None


def _write_record(image: Path, record: dict[str, Any]) -> None:
    tmp = holder_path(image).with_suffix(".holder.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, holder_path(image))


def _write_holder(image: Path, sandbox_id: str, pid: int) -> None:
    start = _start_time(pid)
    if start is None:
        raise VolumeError(f"process {pid} is not running")
    _write_record(image, {"sandbox": sandbox_id, "pid": pid, "start": start})


def hold(image: Path, sandbox_id: str, pid: int) -> None:
    """Record that process ``pid`` (``sandbox_id``'s VM) has the volume's image as a disk.
    VolumeError if another sandbox's live process holds it, or the host has it mounted."""
    with _image_lock(image):
        held = holder(image)
        if held is not None and held != sandbox_id:
            raise VolumeError(f"volume {image.stem} is attached as a disk to microVM sandbox {held}")
        if _is_mounted(image.parent.parent / "mnt" / image.stem):
            raise VolumeError(f"volume {image.stem} is mounted on the host")
        _write_holder(image, sandbox_id, pid)


def hold_for_checkpoint(image: Path, sandbox_id: str, checkpoint: Path) -> None:
    """``sandbox_id``'s VM was saved with the volume mounted: it stays held while the checkpoint
    is kept (a filesystem changed meanwhile would not be the one its restored kernel knows)."""
    with _image_lock(image):
        held = holder(image)
        if held is not None and held != sandbox_id:
            raise VolumeError(f"volume {image.stem} is attached as a disk to microVM sandbox {held}")
        _write_record(image, {"sandbox": sandbox_id, "checkpoint": str(checkpoint)})


def let_go(image: Path, sandbox_id: str) -> None:
    """``sandbox_id`` no longer has the image as a disk (its VM has stopped)."""
    with _image_lock(image):
        if _holder_record(image).get("sandbox") == sandbox_id:
            holder_path(image).unlink(missing_ok=True)


def superblock_usage(image: Path) -> VolumeUsage:
    """Used and total bytes from the ext4 superblock, counted as ``df`` does (the filesystem's
    own overhead is neither): as of the last time a kernel wrote it (at unmount)."""
    try:
        with open(image, "rb") as f:
            f.seek(1024)
            sb = f.read(1024)
    except OSError as exc:
        raise VolumeError(f"cannot read volume {image.stem}: {exc}") from None
    if len(sb) < 0x250 or sb[0x38:0x3A] != b"\x53\xef":
        raise VolumeError(f"volume {image.stem} holds no ext4 filesystem")

    def u32(offset: int) -> int:
        return int.from_bytes(sb[offset : offset + 4], "little")

    wide = u32(0x60) & 0x80  # INCOMPAT_64BIT: the counts' high halves are used
    blocks = u32(0x04) | (u32(0x150) << 32 if wide else 0)
    free = u32(0x0C) | (u32(0x158) << 32 if wide else 0)
    size = 1024 << u32(0x18)
    total = blocks - u32(0x248)  # s_overhead_clusters (0 where mkfs did not record it)
    return VolumeUsage(used_bytes=max(0, total - free) * size, total_bytes=total * size)


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
