"""Sandbox disks: each sandbox's writable layer on an ext4 filesystem of its own size.

A sandbox's root filesystem is an overlay whose upper dir takes every file it writes. On the
host's own filesystem that dir could grow until the node's disk is full; on a filesystem of a
fixed size a write past it fails with ENOSPC inside the sandbox and the host is not touched.
Each disk is a directory::

    <dir>/disk.ext4   the filesystem, a sparse file (an empty 10 GB disk holds ~4 MB)
    <dir>/fs/         where it is mounted (loop, ``discard``: files deleted inside the sandbox
                      give their space back to the host)

Making one with ``mkfs.ext4`` then ``mount -o loop`` took ~25 ms here, too much for the create
path. So each size is formatted once, as a template kept under ``<root>/templates/``, and a
new disk is a copy of its data extents only (~4 MB, ~2 ms), attached to a loop device and
mounted with ioctls and syscalls from this process (~5 ms more, the loop device's set-up
most of it): no process started. Copies share the template's filesystem UUID, which ext4
does not mind. Even those ~8 ms are kept off the create path for the default size: a few
spares are made ahead, and a create takes one with a rename. Disks are host kernel state: they
outlive Hangar's processes; after a reboot the next start of a sandbox mounts its disk again.

No Django here: paths and sizes in, paths and numbers out.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import shutil
import struct
import threading
import time
import uuid
from pathlib import Path

from ..launchers.base import LauncherError
from .locks import file_lock
from .volumes import run_tool

log = logging.getLogger(__name__)

IMAGE = "disk.ext4"
MOUNT = "fs"
MIN_MB = 64
MAX_TEMPLATES = 8  # sizes other than the default whose templates are kept

MS_NOSUID, MS_NODEV = 2, 4
MNT_DETACH = 2
LOOP_CTL_GET_FREE = 0x4C82
LOOP_CONFIGURE = 0x4C0A  # Linux 5.8+: set the backing file and flags in one call
LO_FLAGS_AUTOCLEAR = 4  # the loop device lets go of its file once the disk is unmounted
_libc = ctypes.CDLL(None, use_errno=True)


class Disks:
    """Makes disks from per-size templates kept under ``root``, and keeps ``spare`` disks of the
    default size made ahead under ``root/ready/`` (``<size>-<token>/``): a create takes one
    with a ``rename(2)`` and a thread makes another."""

    def __init__(self, root: str | os.PathLike[str], default_mb: int, spare: int = 0) -> None:
        self.root = Path(root)
        self.ready_dir = self.root / "ready"
        self.default_mb = default_mb
        self.spare = spare if default_mb else 0
        self._refilling = threading.Lock()

    def make(self, dest: Path, size_mb: int) -> None:
        """A disk of ``size_mb`` at ``dest`` (which must not exist), mounted: a spare when
        there is one of that size, else made now. Made beside it and renamed into place, so
        ``dest`` is either whole or absent."""
        if size_mb == self.default_mb and self.spare and self._take_spare(dest):
            return
        tmp = dest.with_name(f".{dest.name}.making")
        self._make(tmp, size_mb)
        tmp.rename(dest)  # a directory holding a mount point can be renamed; the mount goes with it

    def _make(self, path: Path, size_mb: int) -> None:
        remove(path)  # a make that died half-way
        (path / MOUNT).mkdir(parents=True)
        try:
            _sparse_copy(self.template(size_mb), path / IMAGE)
        except FileNotFoundError:  # its template was pruned between the two: made again
            (path / IMAGE).unlink(missing_ok=True)
            _sparse_copy(self.template(size_mb), path / IMAGE)
        mount(path)

    def _take_spare(self, dest: Path) -> bool:
        with contextlib.suppress(FileNotFoundError):
            for entry in sorted(self.ready_dir.iterdir()):
                if not entry.name.startswith(f"{self.default_mb}-"):
                    continue
                try:
                    entry.rename(dest)  # atomic: another process taking the same one gets ENOENT
                except FileNotFoundError:
                    continue
                mount(dest)  # a no-op unless the node rebooted since it was made
                return True
        return False

    def spares(self) -> int:
        with contextlib.suppress(FileNotFoundError):
            return sum(1 for p in self.ready_dir.iterdir() if p.name.startswith(f"{self.default_mb}-"))
        return 0

    def refill(self) -> int:
        """Make spares until there are ``spare`` of them; remove ones of another size and
        half-made ones. One thread of one process at a time (the others return at once).
        Returns how many it made."""
        if not self._refilling.acquire(blocking=False):
            return 0
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            with open(self.root / ".refill.lock", "w") as lock:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return 0
                for stale in self.root.glob(".making-*"):
                    remove(stale)  # a refill that died half-way
                with contextlib.suppress(FileNotFoundError):
                    for entry in self.ready_dir.iterdir():
                        if not entry.name.startswith(f"{self.default_mb}-") or not self.spare:
                            remove(entry)  # the default size changed since it was made
                made = 0
                while self.spares() < self.spare:
                    token = uuid.uuid4().hex[:12]
                    self._make(self.root / f".making-{token}", self.default_mb)
                    self.ready_dir.mkdir(mode=0o700, exist_ok=True)
                    (self.root / f".making-{token}").rename(self.ready_dir / f"{self.default_mb}-{token}")
                    made += 1
                return made
        finally:
            self._refilling.release()

    def refill_soon(self) -> None:
        """Refill from a thread (after a create has answered: making disks takes the CPU the
        create needs), if spares are short."""
        if not self.spare or self.spares() >= self.spare:
            return

        def run() -> None:
            try:
                self.refill()
            except (LauncherError, OSError) as exc:
                log.warning("could not make spare sandbox disks: %s", exc)

        threading.Thread(target=run, name="hangar-disks", daemon=True).start()

    def drain(self) -> None:
        """Remove every spare (and half-made ones), once no refill is making more."""
        if not self.root.is_dir():
            return
        with open(self.root / ".refill.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ready = list(self.ready_dir.iterdir()) if self.ready_dir.is_dir() else []
            for entry in [*self.root.glob(".making-*"), *ready]:
                remove(entry)

    def template(self, size_mb: int) -> Path:
        """The formatted, empty filesystem of ``size_mb`` new disks are copied from (made on
        first use, then kept)."""
        if size_mb < MIN_MB:
            raise LauncherError(f"a sandbox disk needs at least {MIN_MB} MB, got {size_mb}")
        path = self.root / "templates" / f"{size_mb}.ext4"
        if path.exists():
            if size_mb != self.default_mb:
                with contextlib.suppress(OSError):
                    os.utime(path)  # recently used: the last to be pruned
            return path
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with file_lock(path.with_suffix(".lock")):
            if path.exists():
                return path
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as f:
                f.truncate(size_mb << 20)
            # No reserved blocks (the whole size is the sandbox's); a journal of at most 16 MB
            # (the default would be 64 MB at 10 GB: host disk a busy sandbox fills for nothing);
            # inode tables and journal left unwritten, since the sparse file reads as zeros.
            journal_mb = max(4, min(16, size_mb // 64))
            options = "root_owner=0:0,lazy_itable_init=1,lazy_journal_init=1,nodiscard"
            mkfs = ["mkfs.ext4", "-q", "-F", "-m", "0", "-J", f"size={journal_mb}", "-E", options, str(tmp)]
            run_tool(mkfs, LauncherError)
            os.replace(tmp, path)
        self._prune_templates()
        return path

    def _prune_templates(self) -> None:
        """Keep the default size's template and the MAX_TEMPLATES other sizes used last: each
        holds a few MB (5 MB at 100 GB), and a team could ask for every size there is."""
        others = [p for p in (self.root / "templates").glob("*.ext4") if p.stem != str(self.default_mb)]
        if len(others) <= MAX_TEMPLATES:
            return
        others.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True)
        for old in others[MAX_TEMPLATES:]:
            old.unlink(missing_ok=True)

    def prepare(self) -> None:
        """The default size's template, and the spares."""
        if self.default_mb:
            self.template(self.default_mb)
            self.refill()


def mount(dest: Path) -> None:
    """Mount the disk at ``dest`` if it is not mounted (a new one, or one whose mount went with
    a reboot)."""
    target = dest / MOUNT
    if os.path.ismount(target):
        return
    image = dest / IMAGE
    if not image.is_file():
        raise LauncherError(f"the sandbox's disk is missing ({image})")
    device, fd = _attach(image)
    try:
        # noinit_itable: ext4 would otherwise zero the inode tables in the background (up to
        # 160 MB written per 10 GB disk) that the sparse file already reads as zeros.
        if _libc.mount(device.encode(), str(target).encode(), b"ext4", MS_NOSUID | MS_NODEV,
                       b"discard,noinit_itable") != 0:  # fmt: skip
            err = ctypes.get_errno()
            raise LauncherError(f"mounting the sandbox's disk failed: {os.strerror(err)}")
    finally:
        os.close(fd)  # the mount holds the device now; without a mount, AUTOCLEAR frees it


def remove(dest: Path) -> None:
    """Delete the disk at ``dest``, unmounted lazily: the kernel lets go of it (and writes back
    what it still caches, into a file nobody will read) in its own time, not the caller's."""
    if dest.exists():
        if os.path.ismount(dest / MOUNT):
            _libc.umount2(str(dest / MOUNT).encode(), MNT_DETACH)
        shutil.rmtree(dest, ignore_errors=True)


def unmount(dest: Path) -> None:
    """Unmount the disk at ``dest`` now, its writes in its file when this returns (a copy of the
    file is then the whole filesystem); :func:`mount` mounts it again."""
    target = dest / MOUNT
    for _ in range(50):
        if not os.path.ismount(target):
            return
        if _libc.umount2(str(target).encode(), 0) == 0:
            return
        if ctypes.get_errno() != errno.EBUSY:
            break
        time.sleep(0.05)  # the gofer of a sandbox that just exited may hold it for a moment
    raise LauncherError(f"the sandbox's disk at {dest} could not be unmounted: it is in use")


def usage(dest: Path) -> tuple[int, int]:
    """(bytes used, bytes it holds) of a mounted disk: its size less the filesystem's own."""
    if not os.path.ismount(dest / MOUNT):
        raise FileNotFoundError(f"no disk mounted at {dest / MOUNT}")
    st = os.statvfs(dest / MOUNT)
    total = st.f_blocks * st.f_frsize
    return total - st.f_bfree * st.f_frsize, total


def _sparse_copy(src: Path, dst: Path) -> None:
    """Copy ``src`` to ``dst`` (new), its data extents only: the holes stay holes."""
    fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            size = os.fstat(fin).st_size
            os.ftruncate(fout, size)
            offset = 0
            while offset < size:
                try:
                    start = os.lseek(fin, offset, os.SEEK_DATA)
                except OSError as exc:
                    if exc.errno == errno.ENXIO:
                        break  # only a hole from here on
                    raise
                end = os.lseek(fin, start, os.SEEK_HOLE)
                while start < end:
                    copied = os.copy_file_range(fin, fout, end - start, start, start)
                    if copied <= 0:
                        raise OSError(errno.EIO, f"copying {src} stopped at {start}")
                    start += copied
                offset = end
        finally:
            os.close(fout)
    finally:
        os.close(fin)


def _attach(image: Path) -> tuple[str, int]:
    """Attach ``image`` to a free loop device (AUTOCLEAR); returns its path and an open fd."""
    ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
    backing = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        # struct loop_config {u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]}:
        # in loop_info64 (232 bytes) lo_flags is at 52 and lo_file_name[64] at 56.
        info = bytearray(232)
        struct.pack_into("I", info, 52, LO_FLAGS_AUTOCLEAR)
        name = str(image).encode()[:63]
        info[56 : 56 + len(name)] = name
        config = struct.pack("II", backing, 0) + bytes(info) + bytes(64)
        for _ in range(20):
            number = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
            device = f"/dev/loop{number}"
            try:
                fd = os.open(device, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # its node is not there yet (udev-less containers): ask again
            try:
                fcntl.ioctl(fd, LOOP_CONFIGURE, config)
                return device, fd
            except OSError as exc:
                os.close(fd)
                if exc.errno != errno.EBUSY:
                    raise LauncherError(
                        f"attaching the sandbox's disk to {device} failed: {exc.strerror}"
                    ) from None
                # another process took that device first: ask for another
        raise LauncherError("no free loop device for the sandbox's disk")
    except OSError as exc:
        raise LauncherError(
            f"attaching the sandbox's disk failed: {exc.strerror} (is the loop module loaded?)"
        ) from None
    finally:
        os.close(backing)
        os.close(ctl)
