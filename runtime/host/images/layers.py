"""Applying an image layer onto a rootfs.

Image layers are untrusted input: member paths are confined to the rootfs (absolute paths and
``..`` are refused, symlinks already in the tree are only ever resolved *inside* it, never
followed out of it).
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import hashlib
import io
import lzma
import os
import posixpath
import shutil
import stat
import tarfile
import zlib
from collections import deque
from typing import IO, Any

from .base import ImageError, rmtree

_MAX_SYMLINKS = 40


class _HashingRaw(io.RawIOBase):
    """Reads ``f`` while hashing everything read."""

    def __init__(self, f: IO[bytes], algorithm: str) -> None:
        self._f = f
        self.hash = hashlib.new(algorithm)

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        if n:
            self.hash.update(data)
        return n


def normalize_member(name: str, what: str) -> list[str]:
    """Path components of a layer member name, or ImageError if it could leave the rootfs."""
    if name.startswith("/"):
        raise ImageError(f"{what}: refusing absolute path {name!r}")
    norm = posixpath.normpath(name) if name else "."
    parts = [p for p in norm.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ImageError(f"{what}: refusing path {name!r} (leaves the image root)")
    return parts


def _open_dir_beneath(root: str, rel: str) -> int | None:
    """An ``O_PATH`` fd of directory ``rel`` under ``root``, reached one component at a time
    without following a symlink; None if any component is not a real directory (any more)."""
    fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    for part in [] if rel in ("", ".") else rel.split("/"):
        try:
            child = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = child
    return fd


class _LayerApplier:
    """Applies one layer tar onto ``root`` with OCI whiteout semantics, confined to ``root``."""

    def __init__(self, root: str, label: str) -> None:
        self.root = root
        self.label = label
        self.privileged = os.geteuid() == 0
        self.unpacked: set[str] = set()
        self.dir_cache: dict[tuple[str, ...], str] = {}
        self.dir_attrs: list[tuple[str, int, float]] = []
        self.skipped_devices = 0

    # Resolve a directory path inside the root. Symlinks met on the way are followed, but an
    # absolute target restarts from the rootfs and ".." stops at the rootfs, the way a chroot
    # would see them, so nothing ever resolves outside the tree. Every component of the result
    # was lstat'ed as a real directory, and nothing else writes to the tree while we unpack.
    def resolve_dir(self, parts: list[str], create: bool) -> str | None:
        key = tuple(parts)
        cached = self.dir_cache.get(key) if create else None
        if cached is not None:
            return cached
        resolved: list[str] = []
        pending: deque[str] = deque(parts)
        links = 0
        while pending:
            part = pending.popleft()
            if part in ("", "."):
                continue
            if part == "..":
                if resolved:
                    resolved.pop()
                continue
            path = os.path.join(self.root, *resolved, part)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(path, 0o755)
                resolved.append(part)
                continue
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > _MAX_SYMLINKS:
                    raise ImageError(
                        f"{self.label}: too many levels of symbolic links in {'/'.join(parts)!r}"
                    )
                target = os.readlink(path)
                if target.startswith("/"):
                    resolved = []
                pending.extendleft(reversed(target.split("/")))
                continue
            if not stat.S_ISDIR(st.st_mode):
                rel = "/".join([*resolved, part])
                raise ImageError(
                    f"{self.label}: cannot unpack {'/'.join(parts)!r}: {rel!r} is not a directory"
                )
            resolved.append(part)
        result = os.path.join(self.root, *resolved) if resolved else self.root
        if create:  # only then: a cached entry means its parents are marked as this layer's
            for i in range(1, len(resolved) + 1):
                self.unpacked.add(os.path.join(self.root, *resolved[:i]))
            self.dir_cache[key] = result
        return result

    def remove(self, path: str) -> None:
        self.dir_cache.clear()
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode):
            rmtree(path)
        else:
            os.unlink(path)

    def clear_opaque(self, directory: str) -> None:
        """Hide what lower layers put in ``directory``; keep what this layer added."""
        with os.scandir(directory) as it:
            entries = list(it)
        for entry in entries:
            if entry.path in self.unpacked:
                if entry.is_dir(follow_symlinks=False):
                    self.clear_opaque(entry.path)
                continue
            self.remove(entry.path)

    def apply(self, tar: tarfile.TarFile) -> None:
        for member in tar:
            self.apply_member(tar, member)
        # Directory modes and times last (deepest first), so a read-only directory
        # does not stop its own children being written. A later member may have replaced the
        # directory, or one above it, with a symlink (aimed anywhere, the host's /etc say):
        # each is reached again from the root without following any symlink, or skipped.
        for path, mode, mtime in sorted(self.dir_attrs, key=lambda a: a[0], reverse=True):
            fd = _open_dir_beneath(self.root, os.path.relpath(path, self.root))
            if fd is None:
                continue
            try:
                os.chmod(f"/proc/self/fd/{fd}", mode)  # the directory the fd holds, never a link
                with contextlib.suppress(OSError):
                    os.utime(f"/proc/self/fd/{fd}", (mtime, mtime))
            finally:
                os.close(fd)

    def apply_member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        parts = normalize_member(m.name, self.label)
        if not parts:
            return  # the layer's root directory entry
        base = parts[-1]
        if base.startswith(".wh."):
            parent = self.resolve_dir(parts[:-1], create=False)
            if parent is None:
                return
            if base == ".wh..wh..opq":
                self.clear_opaque(parent)
            elif not base.startswith(".wh..wh."):
                hidden = base[len(".wh.") :]
                if hidden in ("", ".", ".."):
                    raise ImageError(f"{self.label}: invalid whiteout {m.name!r} (names no file)")
                victim = os.path.join(parent, hidden)
                if victim not in self.unpacked and os.path.lexists(victim):
                    self.remove(victim)
            return
        if m.ischr() or m.isblk():
            self.skipped_devices += 1
            return
        if not (m.isreg() or m.isdir() or m.issym() or m.islnk() or m.isfifo()):
            return
        link_source = None
        if m.islnk():
            lparts = normalize_member(m.linkname, f"{self.label}: hardlink {m.name!r}")
            lparent = self.resolve_dir(lparts[:-1], create=False) if lparts else None
            link_source = os.path.join(lparent, lparts[-1]) if lparent and lparts else None
            try:
                lst = os.lstat(link_source) if link_source else None
            except FileNotFoundError:
                lst = None
            if lst is None or stat.S_ISDIR(lst.st_mode):
                raise ImageError(f"{self.label}: hardlink {m.name!r} points at missing {m.linkname!r}")
        parent = self.resolve_dir(parts[:-1], create=True)
        assert parent is not None
        target = os.path.join(parent, base)
        if link_source == target:
            return
        try:
            existing = os.lstat(target)
        except FileNotFoundError:
            existing = None
        if existing is not None and not (m.isdir() and stat.S_ISDIR(existing.st_mode)):
            self.remove(target)
        self.unpacked.add(target)
        mode = m.mode & 0o7777

        if m.isdir():
            if existing is None or not stat.S_ISDIR(existing.st_mode):
                os.mkdir(target, 0o700)
            self.chown(target, m)
            self.dir_attrs.append((target, mode, m.mtime))
        elif m.isreg():
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                src = tar.extractfile(m)
                if src is not None:
                    shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                if self.privileged:
                    os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, mode)  # after chown, which clears setuid/setgid
            self.set_mtime(target, m)
        elif m.issym():
            os.symlink(m.linkname, target)
            self.dir_cache.clear()
            self.chown(target, m)
            self.set_mtime(target, m)
        elif m.islnk():
            assert link_source is not None
            # follow_symlinks=False: link the entry itself, even if it is a symlink.
            os.link(link_source, target, follow_symlinks=False)
        elif m.isfifo():
            os.mkfifo(target, 0o600)
            self.chown(target, m)
            os.chmod(target, mode)
            self.set_mtime(target, m)

    def chown(self, path: str, m: tarfile.TarInfo) -> None:
        if self.privileged:
            os.lchown(path, m.uid, m.gid)

    @staticmethod
    def set_mtime(path: str, m: tarfile.TarInfo) -> None:
        with contextlib.suppress(OSError, OverflowError, ValueError):
            os.utime(path, (m.mtime, m.mtime), follow_symlinks=False)


def apply_layer(rootfs: str, blob: IO[bytes], label: str, expected_digest: str | None) -> None:
    """Unpack one (possibly compressed) layer blob onto ``rootfs``; verify its digest if given."""
    algorithm = expected_digest.split(":", 1)[0] if expected_digest else "sha256"
    raw = _HashingRaw(blob, algorithm)
    buffered = io.BufferedReader(raw, 1 << 20)
    magic = buffered.peek(6)[:6]
    stream: io.BufferedIOBase
    if magic.startswith(b"\x28\xb5\x2f\xfd"):
        raise ImageError(
            f"{label}: zstd layers are not supported; re-export the image with gzip layers "
            "(e.g. skopeo copy --dest-compress-format=gzip ...)"
        )
    if magic.startswith(b"\x1f\x8b"):
        stream = gzip.GzipFile(fileobj=buffered, mode="rb")
    elif magic.startswith(b"\xfd7zXZ\x00"):
        stream = lzma.LZMAFile(buffered)
    elif magic.startswith(b"BZh"):
        stream = bz2.BZ2File(buffered)
    else:
        stream = buffered
    applier = _LayerApplier(rootfs, label)
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            applier.apply(tar)
    except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ImageError(f"{label}: out of disk space while unpacking") from exc
        raise ImageError(f"{label}: cannot unpack layer: {exc}") from exc
    while buffered.read(1 << 20):
        pass
    if expected_digest:
        actual = f"{algorithm}:{raw.hash.hexdigest()}"
        if actual != expected_digest:
            raise ImageError(f"{label}: content digest {actual} does not match {expected_digest}")
