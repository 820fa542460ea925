"""The image store: root filesystems for sandboxes, kept once per digest, with names.

A sandbox's root filesystem is an overlayfs whose lower dir is an image's ``rootfs`` from this
store; sandboxes never write to it. Layout under the store's root::

    sha256/<hex>/rootfs/      the unpacked tree (owned by root, numeric ids and modes kept,
                              device nodes skipped)
    sha256/<hex>/image.json   {"digest", "size_bytes", "created_at", "source", "config"}
    names.json                {name: "sha256:<hex>"}, replaced atomically
    .lock                     fcntl lock taken by every writer, so processes can share a store

Images are built or unpacked under ``sha256/.tmp-<random>/`` and renamed into place when
complete, so a half-built image is never visible. Image layers are untrusted input: member
paths are confined to the rootfs (absolute paths and ``..`` are refused, symlinks already in the
tree are only ever resolved *inside* it, never followed out of it).

Stdlib only, no Django: a node uses it directly.
"""

from __future__ import annotations

import bz2
import contextlib
import errno
import gzip
import hashlib
import io
import json
import lzma
import os
import platform
import posixpath
import re
import secrets
import shutil
import stat
import struct
import subprocess
import tarfile
import tempfile
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from .locks import file_lock

Progress = Callable[[str], None] | None

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._/:-]{0,127}")
DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")
_BLOB_DIGEST_RE = re.compile(r"(sha256):([0-9a-f]{64})|(sha512):([0-9a-f]{128})")

BUSYBOX_PATH = "/bin/busybox"
BASE_PACKAGES = (
    "bash",
    "coreutils",
    "git",
    "curl",
    "ca-certificates",
    "python3",
    "nodejs",
    "npm",
    "procps",
    "less",
    "openssh-client",
    "openssh-sftp-server",
    "xz-utils",
)
# A small Debian image for workspaces whose agent needs no Node.js: a shell, git, and what the
# SSH gateway's scp/sftp run inside the sandbox.
MINIMAL_PACKAGES = (
    "bash", "coreutils", "git", "ca-certificates", "openssh-client", "openssh-sftp-server", "procps"
)  # fmt: skip
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

_OCI_INDEX_TYPES = {
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
}
_MAX_JSON = 32 * 1024 * 1024
_MAX_SYMLINKS = 40


class ImageError(Exception):
    """An image operation failed; the message is meant for the user."""


class ImageNotFound(ImageError):
    """No image by that name or digest."""


@dataclass(frozen=True)
class ImageInfo:
    name: str | None
    digest: str
    rootfs: Path
    size_bytes: int
    created_at: str
    source: str
    config: dict[str, Any]


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ImageError(
            f"invalid image name {name!r}: use 1-128 characters of a-z 0-9 . _ / : - "
            "starting with a letter or digit"
        )
    return name


def _empty_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"env": [], "cmd": [], "entrypoint": [], "working_dir": "", "user": ""}
    config.update(overrides)
    return config


def _emit(progress: Progress, message: str) -> None:
    if progress is not None:
        progress(message)


# --------------------------------------------------------------------------- tree helpers


def tree_digest(path: str | os.PathLike) -> str:
    """``sha256:<hex>`` over a deterministic serialisation of the tree at ``path``.

    Covers, for every entry in sorted path order: the relative path, its type, permission bits
    (incl. setuid/setgid/sticky), numeric owner, and the sha256 of a file's content, a symlink's
    target or a device's numbers. Timestamps are left out, so rebuilding identical content
    gives the same digest.
    """
    root = os.fspath(path)
    outer = hashlib.sha256()
    content_cache: dict[tuple[int, int], str] = {}

    def record(rel: bytes, st: os.stat_result, full: str) -> None:
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            kind, extra = b"d", b""
        elif stat.S_ISREG(mode):
            key = (st.st_dev, st.st_ino)
            digest = content_cache.get(key)
            if digest is None:
                h = hashlib.sha256()
                with open(full, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
                digest = content_cache[key] = h.hexdigest()
            kind, extra = b"f", digest.encode()
        elif stat.S_ISLNK(mode):
            kind, extra = b"l", os.fsencode(os.readlink(full))
        elif stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
            kind = b"c" if stat.S_ISCHR(mode) else b"b"
            extra = f"{os.major(st.st_rdev)},{os.minor(st.st_rdev)}".encode()
        elif stat.S_ISFIFO(mode):
            kind, extra = b"p", b""
        else:
            kind, extra = b"s", b""
        perm = stat.S_IMODE(mode)
        outer.update(b"%s\0%s\0%o\0%d\0%d\0%s\n" % (rel, kind, perm, st.st_uid, st.st_gid, extra))

    def walk(dir_full: str, dir_rel: bytes) -> None:
        with os.scandir(dir_full) as it:
            entries = sorted(it, key=lambda e: os.fsencode(e.name))
        for entry in entries:
            rel = dir_rel + b"/" + os.fsencode(entry.name) if dir_rel else os.fsencode(entry.name)
            st = entry.stat(follow_symlinks=False)
            record(rel, st, entry.path)
            if stat.S_ISDIR(st.st_mode):
                walk(entry.path, rel)

    record(b".", os.lstat(root), root)
    walk(root, b"")
    return "sha256:" + outer.hexdigest()


def tree_size(path: str | os.PathLike) -> int:
    """Bytes of regular-file content under ``path``, hardlinked files counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [os.fspath(path)]
    while stack:
        with os.scandir(stack.pop()) as it:
            for entry in it:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def _mounts_under(path: str) -> list[str]:
    prefix = os.path.realpath(path).rstrip("/") + "/"
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split()
                if len(fields) > 4:
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                    if point.startswith(prefix):
                        found.append(point)
    except OSError:
        pass
    return sorted(found, key=len, reverse=True)


def _overlay_users(path: str | os.PathLike) -> list[str]:
    """Mount points of overlayfs mounts (in our mount namespace) using ``path`` as a lower dir."""
    target = os.path.realpath(path)
    pattern = re.compile(r"(?:lowerdir=|:)" + re.escape(target) + r"(?=[,:]|$)")
    users = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                fields, post_fields = pre.split(), post.split()
                if len(fields) > 4 and len(post_fields) >= 3 and post_fields[0] == "overlay":
                    if pattern.search(post_fields[2]):
                        users.append(fields[4])
    except OSError:
        pass
    return users


def _rmtree(path: str | os.PathLike) -> None:
    """Delete a tree we created; never descends into something still mounted inside it."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    for point in _mounts_under(path):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
    if _mounts_under(path):
        raise ImageError(f"not deleting {path}: something is still mounted inside it")

    def onerror(func: Any, p: str, exc_info: Any) -> None:
        # A read-only directory (mode 0555 from a layer) stops an unprivileged delete.
        parent = os.path.dirname(p)
        with contextlib.suppress(OSError):
            os.chmod(parent, 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
        func(p)

    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, onerror=onerror)
    else:
        os.unlink(path)


def _elf_is_dynamic(path: str) -> bool:
    """True when the ELF file has a PT_INTERP header (needs a dynamic loader)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if len(head) < 64 or head[:4] != b"\x7fELF":
            return False
        endian = "<" if head[5] == 1 else ">"
        if head[4] == 2:
            (phoff,) = struct.unpack_from(endian + "Q", head, 0x20)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 0x36)
        else:
            (phoff,) = struct.unpack_from(endian + "I", head, 0x1C)
            phentsize, phnum = struct.unpack_from(endian + "HH", head, 0x2A)
        f.seek(phoff)
        for _ in range(min(phnum, 256)):
            entry = f.read(phentsize)
            if len(entry) < 4:
                break
            if struct.unpack_from(endian + "I", entry, 0)[0] == 3:  # PT_INTERP
                return True
    return False


def _run_streaming(cmd: list[str], progress: Progress, what: str, missing_hint: str) -> None:
    """Run ``cmd``, sending each output line to ``progress``; ImageError with stderr on failure."""
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            bufsize=1,
        )
    except FileNotFoundError as exc:
        raise ImageError(f"{cmd[0]} is not installed ({missing_hint})") from exc
    out_tail: deque[str] = deque(maxlen=40)
    err_tail: deque[str] = deque(maxlen=40)
    emit_lock = threading.Lock()

    def pump(stream: IO[str], tail: deque[str]) -> None:
        for line in stream:
            line = line.rstrip("\n")
            tail.append(line)
            if progress is not None:
                with emit_lock, contextlib.suppress(Exception):
                    progress(line)

    err_thread = threading.Thread(target=pump, args=(proc.stderr, err_tail), daemon=True)
    err_thread.start()
    try:
        assert proc.stdout is not None
        pump(proc.stdout, out_tail)
        err_thread.join()
        rc = proc.wait()
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if rc != 0:
        detail = "\n".join(err_tail or out_tail).strip() or "(no output)"
        raise ImageError(f"{what} failed (exit status {rc}):\n{detail}")


# --------------------------------------------------------------------------- layer unpacking


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


def _normalize_member(name: str, what: str) -> list[str]:
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
            _rmtree(path)
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
        parts = _normalize_member(m.name, self.label)
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
            lparts = _normalize_member(m.linkname, f"{self.label}: hardlink {m.name!r}")
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


def _apply_layer(rootfs: str, blob: IO[bytes], label: str, expected_digest: str | None) -> None:
    """Unpack one (possibly compressed) layer blob onto ``rootfs``; verify its digest if given."""
    algorithm = expected_digest.split(":", 1)[0] if expected_digest else "sha256"
    raw = _HashingRaw(blob, algorithm)
    buffered = io.BufferedReader(raw, 1 << 20)
    magic = buffered.peek(6)[:6]
    stream: IO[bytes]
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


# --------------------------------------------------------------------------- archive sources


class _Source:
    """Files of an OCI layout / docker save, read from a directory or a tar file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tar: tarfile.TarFile | None = None
        self._members: dict[str, tarfile.TarInfo] = {}
        if path.is_dir():
            self.kind = "dir"
            self._real = os.path.realpath(path)
        elif path.is_file():
            self.kind = "tar"
            try:
                self._tar = tarfile.open(path, "r:*")
                for m in self._tar.getmembers():
                    norm = posixpath.normpath(m.name.lstrip("/"))
                    self._members[norm] = m
            except (tarfile.TarError, EOFError, zlib.error, lzma.LZMAError, OSError) as exc:
                self.close()
                raise ImageError(
                    f"{path} is not an OCI layout, OCI archive or docker save tarball ({exc})"
                ) from exc
        elif not path.exists():
            raise ImageError(f"{path} does not exist")
        else:
            raise ImageError(f"{path} is not a directory or a tar file")

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None

    def exists(self, rel: str) -> bool:
        if self.kind == "dir":
            return os.path.isfile(os.path.join(self.path, rel))
        return posixpath.normpath(rel) in self._members

    def open(self, rel: str) -> IO[bytes]:
        parts = _normalize_member(rel, f"{self.path}")
        rel = "/".join(parts)
        if self.kind == "dir":
            full = os.path.realpath(os.path.join(self.path, rel))
            if not full.startswith(self._real.rstrip("/") + "/"):
                raise ImageError(f"{self.path}: {rel!r} points outside the archive")
            try:
                return open(full, "rb")
            except FileNotFoundError as exc:
                raise ImageError(f"{self.path}: missing {rel}") from exc
        assert self._tar is not None
        member = self._members.get(rel)
        if member is None:
            raise ImageError(f"{self.path}: missing {rel}")
        try:
            f = self._tar.extractfile(member)
        except (tarfile.TarError, KeyError) as exc:
            raise ImageError(f"{self.path}: cannot read {rel}: {exc}") from exc
        if f is None:
            raise ImageError(f"{self.path}: {rel} is not a file")
        return f

    def read(self, rel: str) -> bytes:
        with self.open(rel) as f:
            data = f.read(_MAX_JSON + 1)
        if len(data) > _MAX_JSON:
            raise ImageError(f"{self.path}: {rel} is implausibly large")
        return data

    @staticmethod
    def blob_path(digest: str) -> str:
        match = _BLOB_DIGEST_RE.fullmatch(digest or "")
        if not match:
            raise ImageError(f"unsupported or malformed digest {digest!r}")
        algorithm, hexdigest = (match.group(1), match.group(2)) if match.group(1) else match.groups()[2:]
        return f"blobs/{algorithm}/{hexdigest}"

    def read_blob(self, digest: str) -> bytes:
        data = self.read(self.blob_path(digest))
        algorithm, _, hexdigest = digest.partition(":")
        if hashlib.new(algorithm, data).hexdigest() != hexdigest:
            raise ImageError(f"{self.path}: blob {digest} is corrupt (digest mismatch)")
        return data

    def read_json(self, data: bytes, what: str) -> Any:
        try:
            return json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ImageError(f"{self.path}: {what} is not valid JSON ({exc})") from exc


def _host_arch() -> str:
    machine = platform.machine().lower()
    return {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "i686": "386"}.get(machine, machine)


def _is_attestation(desc: dict[str, Any]) -> bool:
    annotations = desc.get("annotations") or {}
    plat = desc.get("platform") or {}
    return (
        annotations.get("vnd.docker.reference.type") == "attestation-manifest" or plat.get("os") == "unknown"
    )


def _describe(desc: dict[str, Any]) -> str:
    plat = desc.get("platform") or {}
    ref = (desc.get("annotations") or {}).get("org.opencontainers.image.ref.name")
    where = f"{plat.get('os', '?')}/{plat.get('architecture', '?')}" if plat else "no platform"
    return f"{ref} ({where})" if ref else where


def _image_config(config_json: Any) -> dict[str, Any]:
    cfg = config_json.get("config") if isinstance(config_json, dict) else None
    if not isinstance(cfg, dict):
        cfg = {}

    def strings(value: Any) -> list[str]:
        return [str(v) for v in value] if isinstance(value, list) else []

    return _empty_config(
        env=strings(cfg.get("Env")),
        cmd=strings(cfg.get("Cmd")),
        entrypoint=strings(cfg.get("Entrypoint")),
        working_dir=str(cfg.get("WorkingDir") or ""),
        user=str(cfg.get("User") or ""),
    )


@dataclass
class _Plan:
    digest: str
    config: dict[str, Any]
    layers: list[tuple[str, str | None]]  # (path in source, expected blob digest or None)
    default_name: str | None
    source: str


# --------------------------------------------------------------------------- the store


class ImageStore:
    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.blobs = self.root / "sha256"
        self._names_path = self.root / "names.json"
        self._lock_path = self.root / ".lock"

    # ---- bookkeeping

    def _ensure(self) -> None:
        self.blobs.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._ensure()
        with file_lock(self._lock_path):
            yield

    def _read_names(self) -> dict[str, str]:
        try:
            data = json.loads(self._names_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            raise ImageError(f"{self._names_path} is corrupt: {exc}") from exc
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def _write_names(self, names: dict[str, str]) -> None:
        tmp = self.root / f".names.json.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(dict(sorted(names.items())), f, indent=2)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._names_path)

    def _digest_dir(self, digest: str) -> Path:
        match = DIGEST_RE.fullmatch(digest)
        if not match:
            raise ImageError(f"malformed digest {digest!r} (expected sha256:<64 hex digits>)")
        return self.blobs / match.group(1)

    def _info(self, digest: str, name: str | None) -> ImageInfo:
        directory = self._digest_dir(digest)
        try:
            meta = json.loads((directory / "image.json").read_text(encoding="utf-8"))
        except FileNotFoundError as exc:
            what = f"image {name!r} ({digest})" if name else f"image {digest}"
            raise ImageNotFound(f"{what} is missing from the store") from exc
        except ValueError as exc:
            raise ImageError(f"{directory / 'image.json'} is corrupt: {exc}") from exc
        return ImageInfo(
            name=name,
            digest=digest,
            rootfs=directory / "rootfs",
            size_bytes=int(meta.get("size_bytes", 0)),
            created_at=str(meta.get("created_at", "")),
            source=str(meta.get("source", "")),
            config=dict(meta.get("config") or _empty_config()),
        )

    def _digests(self) -> list[str]:
        try:
            entries = sorted(os.listdir(self.blobs))
        except FileNotFoundError:
            return []
        return [
            f"sha256:{e}"
            for e in entries
            if DIGEST_RE.fullmatch(f"sha256:{e}") and (self.blobs / e / "image.json").is_file()
        ]

    # ---- queries

    def names(self) -> list[str]:
        return sorted(self._read_names())

    def list(self) -> list[ImageInfo]:
        names = self._read_names()
        result: list[ImageInfo] = []
        for name in sorted(names):
            with contextlib.suppress(ImageNotFound):
                result.append(self._info(names[name], name))
        referenced = set(names.values())
        for digest in self._digests():
            if digest not in referenced:
                with contextlib.suppress(ImageNotFound):
                    result.append(self._info(digest, None))
        return result

    def get(self, ref: str) -> ImageInfo:
        names = self._read_names()
        if DIGEST_RE.fullmatch(ref or ""):
            if not (self._digest_dir(ref) / "image.json").is_file():
                raise ImageNotFound(f"no image with digest {ref} in the store")
            named = sorted(n for n, d in names.items() if d == ref)
            return self._info(ref, named[0] if named else None)
        digest = names.get(ref)
        if digest is None:
            available = ", ".join(sorted(names)) or "none (the store is empty)"
            raise ImageNotFound(f"no image named {ref!r}; images available: {available}")
        return self._info(digest, ref)

    # ---- names

    def tag(self, name: str, digest: str) -> ImageInfo:
        """Point ``name`` at an image, given by digest (or by another name)."""
        validate_name(name)
        if not DIGEST_RE.fullmatch(digest or ""):
            digest = self.get(digest).digest
        with self._locked():
            if not (self._digest_dir(digest) / "image.json").is_file():
                raise ImageNotFound(f"no image with digest {digest} in the store")
            names = self._read_names()
            if names.get(name) != digest:
                names[name] = digest
                self._write_names(names)
        return self._info(digest, name)

    def remove(self, name: str) -> None:
        """Remove a name; the image itself goes when no name points to it any more.

        Given a digest, removes that image and every name pointing to it.
        """
        doomed: Path | None = None
        with self._locked():
            names = self._read_names()
            if DIGEST_RE.fullmatch(name or ""):
                digest = name
                if not (self._digest_dir(digest) / "image.json").is_file():
                    raise ImageNotFound(f"no image with digest {digest} in the store")
                names = {n: d for n, d in names.items() if d != digest}
            else:
                if name not in names:
                    available = ", ".join(sorted(names)) or "none (the store is empty)"
                    raise ImageNotFound(f"no image named {name!r}; images available: {available}")
                digest = names.pop(name)
            directory = self._digest_dir(digest)
            if digest not in names.values() and directory.exists():
                users = _overlay_users(directory / "rootfs")
                if users:
                    raise ImageError(
                        f"image {name} ({digest}) is in use by {len(users)} mounted sandbox root "
                        f"filesystem(s), e.g. {users[0]}; stop those sandboxes first"
                    )
            self._write_names(names)
            if digest not in names.values() and directory.exists():
                doomed = self.blobs / f".del-{secrets.token_hex(8)}"
                os.rename(directory, doomed)
        if doomed is not None:
            _rmtree(doomed)

    # ---- adding images

    def _new_tmp(self) -> Path:
        self._ensure()
        tmp = self.blobs / f".tmp-{secrets.token_hex(8)}"
        tmp.mkdir(mode=0o755)
        return tmp

    def _commit(
        self, tmp: Path, digest: str, source: str, config: dict[str, Any], name: str | None
    ) -> ImageInfo:
        """Move a finished ``tmp`` (holding ``rootfs/``) into place as ``digest``; set ``name``."""
        rootfs = tmp / "rootfs"
        meta = {
            "digest": digest,
            "size_bytes": tree_size(rootfs),
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "source": source,
            "config": config,
        }
        with open(tmp / "image.json", "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        discard = False
        tmp_stale: Path | None = None
        with self._locked():
            final = self._digest_dir(digest)
            if (final / "image.json").is_file():
                discard = True
            else:
                if final.exists():  # a leftover without image.json: not a valid image
                    tmp_stale = self.blobs / f".del-{secrets.token_hex(8)}"
                    os.rename(final, tmp_stale)
                os.rename(tmp, final)
            if name is not None:
                names = self._read_names()
                if names.get(name) != digest:
                    names[name] = digest
                    self._write_names(names)
        if discard:
            _rmtree(tmp)
        elif tmp_stale is not None:
            _rmtree(tmp_stale)
        return self._info(digest, name)

    @contextlib.contextmanager
    def _building(self) -> Iterator[Path]:
        tmp = self._new_tmp()
        try:
            yield tmp
        finally:
            if tmp.exists():
                _rmtree(tmp)

    def build_busybox(self, name: str = "busybox", progress: Progress = None) -> ImageInfo:
        """A tiny image from Debian's static busybox: /bin/busybox plus a link per applet."""
        validate_name(name)
        if not os.path.isfile(BUSYBOX_PATH):
            raise ImageError(f"{BUSYBOX_PATH} is missing: apt-get install busybox-static")
        if _elf_is_dynamic(BUSYBOX_PATH):
            raise ImageError(
                f"{BUSYBOX_PATH} is dynamically linked (the 'busybox' package); "
                "apt-get install busybox-static"
            )
        source = "busybox-static"
        try:
            version = subprocess.run(
                ["dpkg-query", "-W", "-f=${Version}", "busybox-static"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if version.returncode == 0 and version.stdout.strip():
                source = f"busybox-static {version.stdout.strip()}"
        except (OSError, subprocess.SubprocessError):
            pass
        listing = subprocess.run([BUSYBOX_PATH, "--list-full"], capture_output=True, text=True)
        if listing.returncode == 0 and listing.stdout.strip():
            applets = [line.strip() for line in listing.stdout.splitlines() if line.strip()]
        else:
            listing = subprocess.run([BUSYBOX_PATH, "--list"], capture_output=True, text=True)
            if listing.returncode != 0:
                raise ImageError(f"{BUSYBOX_PATH} --list failed: {listing.stderr.strip()}")
            applets = [f"bin/{line.strip()}" for line in listing.stdout.splitlines() if line.strip()]

        _emit(progress, f"building {name} from {source} ({len(applets)} applets)")
        with self._building() as tmp:
            root = tmp / "rootfs"
            root.mkdir(mode=0o755)
            dirs = {
                "proc": 0o555,
                "sys": 0o555,
                "dev": 0o755,
                "tmp": 0o1777,
                "etc": 0o755,
                "root": 0o700,
                "home": 0o755,
                "bin": 0o755,
                "usr": 0o755,
                "usr/bin": 0o755,
                "usr/sbin": 0o755,
                "sbin": 0o755,
                "var": 0o755,
                "var/tmp": 0o1777,
                "run": 0o755,
            }
            for rel in dirs:
                (root / rel).mkdir()
            shutil.copyfile(BUSYBOX_PATH, root / "bin/busybox")
            os.chmod(root / "bin/busybox", 0o755)
            for applet_path in applets:
                rel = applet_path.strip("/")
                applet = posixpath.basename(rel)
                if not applet or applet == "busybox" or ".." in rel.split("/"):
                    continue
                link = root / "bin" / applet
                if not os.path.lexists(link):
                    os.symlink("busybox", link)
                directory = posixpath.dirname(rel)
                if directory not in ("", "bin"):  # "" is "linuxrc", for initrds: /bin only
                    (root / directory).mkdir(parents=True, exist_ok=True)
                    link = root / rel
                    if not os.path.lexists(link):
                        os.symlink(posixpath.relpath("bin/busybox", directory), link)
            files = {
                "etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n",
                "etc/group": "root:x:0:\nnogroup:x:65534:\n",
                "etc/hostname": "hangar\n",
                "etc/hosts": "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n",
            }
            for rel, text in files.items():
                (root / rel).write_text(text, encoding="ascii")
                os.chmod(root / rel, 0o644)
            for rel, mode in dirs.items():
                os.chmod(root / rel, mode)
            if os.geteuid() == 0:
                for dirpath, dirnames, filenames in os.walk(root):
                    for entry in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
                        os.lchown(entry, 0, 0)
            digest = tree_digest(root)
            config = _empty_config(
                env=[f"PATH={DEFAULT_PATH}", "HOME=/root"], cmd=["/bin/sh"], working_dir="/"
            )
            info = self._commit(tmp, digest, source, config, name)
        _emit(progress, f"{name}: {digest}")
        return info

    def build_base(
        self,
        name: str = "base",
        progress: Progress = None,
        suite: str = "bookworm",
        mirror: str | None = None,
        packages_list: tuple[str, ...] = BASE_PACKAGES,
    ) -> ImageInfo:
        """A Debian image (minbase + a dev toolset) via mmdebstrap; needs the mirror, takes minutes."""
        validate_name(name)
        if shutil.which("mmdebstrap") is None:
            raise ImageError("mmdebstrap is not installed: apt-get install mmdebstrap")
        if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", suite):
            raise ImageError(f"invalid suite {suite!r}")
        packages = ",".join(packages_list)
        with self._building() as tmp:
            root = tmp / "rootfs"
            cmd = ["mmdebstrap", "--variant=minbase", f"--include={packages}", suite, str(root)]
            if mirror:
                cmd.append(mirror)
            _emit(progress, "$ " + " ".join(cmd))
            _run_streaming(cmd, progress, "mmdebstrap", "apt-get install mmdebstrap")
            _emit(progress, "cleaning apt lists and caches")
            for rel in ("var/lib/apt/lists", "var/cache/apt/archives", "var/cache/apt"):
                directory = root / rel
                if not directory.is_dir():
                    continue
                for entry in directory.iterdir():
                    if entry.is_file() or entry.is_symlink():
                        if entry.name != "lock":
                            entry.unlink()
                    elif entry.is_dir() and entry.name == "partial":
                        for sub in entry.iterdir():
                            _rmtree(sub)
            if _mounts_under(str(root)):
                raise ImageError(f"mmdebstrap left filesystems mounted under {root}")
            # Device nodes are not kept in the store (the sandbox runtime provides /dev).
            for dirpath, _dirnames, filenames in os.walk(root / "dev"):
                for n in filenames:
                    p = os.path.join(dirpath, n)
                    if stat.S_ISCHR(os.lstat(p).st_mode) or stat.S_ISBLK(os.lstat(p).st_mode):
                        os.unlink(p)
            os.chmod(root, 0o755)
            _emit(progress, "computing digest")
            digest = tree_digest(root)
            source = f"mmdebstrap {suite} minbase +{packages}" + (f" from {mirror}" if mirror else "")
            config = _empty_config(
                env=[f"PATH={DEFAULT_PATH}", "HOME=/root", "LANG=C.UTF-8"],
                cmd=["/bin/bash"],
                working_dir="/",
            )
            info = self._commit(tmp, digest, source, config, name)
        _emit(progress, f"{name}: {digest} ({info.size_bytes / 1e6:.0f} MB)")
        return info

    def import_archive(
        self, path: str | os.PathLike, name: str | None = None, progress: Progress = None
    ) -> ImageInfo:
        """Import an OCI layout directory, an OCI archive (tar of one) or a ``docker save`` tar.

        Without ``name`` the image is named after the reference recorded in the archive
        (``io.containerd.image.name`` or docker's ``RepoTags``) when there is a valid one, and
        otherwise stays unnamed (reachable by digest).
        """
        if name is not None:
            validate_name(name)
        path = Path(path).absolute()
        src = _Source(path)
        try:
            return self._import(src, name, progress, None)
        finally:
            src.close()

    def _plan_checked(self, src: _Source, source_label: str | None) -> _Plan:
        try:
            return self._plan(src, source_label)
        except ImageError:
            raise
        except (KeyError, TypeError, AttributeError, ValueError, OSError, tarfile.TarError) as exc:
            raise ImageError(f"{src.path}: malformed image archive ({type(exc).__name__}: {exc})") from exc

    def _plan(self, src: _Source, source_label: str | None) -> _Plan:
        path = src.path
        if src.exists("index.json"):
            index = src.read_json(src.read("index.json"), "index.json")
            desc = self._pick_manifest(src, index, 0)
            manifest_bytes = src.read_blob(desc["digest"])
            manifest = src.read_json(manifest_bytes, f"manifest {desc['digest']}")
            if not isinstance(manifest, dict) or not isinstance(manifest.get("layers"), list):
                raise ImageError(f"{path}: manifest {desc['digest']} is not an image manifest")
            config_desc = manifest.get("config") or {}
            config_json = src.read_json(src.read_blob(config_desc.get("digest", "")), "image config")
            layers: list[tuple[str, str | None]] = []
            for layer in manifest["layers"]:
                media = str(layer.get("mediaType", ""))
                if "zstd" in media:
                    raise ImageError(
                        f"{path}: zstd layers are not supported ({layer.get('digest')}); re-export the "
                        "image with gzip layers (e.g. skopeo copy --dest-compress-format=gzip ...)"
                    )
                layers.append((src.blob_path(layer.get("digest", "")), layer["digest"]))
            annotations = desc.get("annotations") or {}
            default = annotations.get("io.containerd.image.name")
            kind = "oci-archive" if src.kind == "tar" else "oci-layout"
            return _Plan(
                digest="sha256:" + hashlib.sha256(manifest_bytes).hexdigest(),
                config=_image_config(config_json),
                layers=layers,
                default_name=default,
                source=source_label or f"{kind}:{path}",
            )
        if src.exists("manifest.json"):
            entries = src.read_json(src.read("manifest.json"), "manifest.json")
            if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
                raise ImageError(f"{path}: manifest.json lists no images")
            if len(entries) > 1:
                tags = ", ".join(",".join(e.get("RepoTags") or ["<untagged>"]) for e in entries)
                raise ImageError(
                    f"{path}: the archive holds {len(entries)} images ({tags}); save one at a time"
                )
            entry = entries[0]
            if not isinstance(entry.get("Config"), str) or not isinstance(entry.get("Layers"), list):
                raise ImageError(f"{path}: manifest.json has no Config/Layers")
            config_bytes = src.read(entry["Config"])
            tags = entry.get("RepoTags") or []
            return _Plan(
                digest="sha256:" + hashlib.sha256(config_bytes).hexdigest(),
                config=_image_config(src.read_json(config_bytes, "image config")),
                layers=[(str(layer), None) for layer in entry["Layers"]],
                default_name=tags[0] if tags and isinstance(tags[0], str) else None,
                source=source_label or f"docker-archive:{path}",
            )
        raise ImageError(
            f"{path} is not an OCI layout, OCI archive or docker save tarball "
            "(no index.json or manifest.json)"
        )

    def _pick_manifest(self, src: _Source, index: Any, depth: int) -> dict[str, Any]:
        if depth > 4:
            raise ImageError(f"{src.path}: image indexes nested too deeply")
        manifests = index.get("manifests") if isinstance(index, dict) else None
        candidates = [m for m in manifests or [] if isinstance(m, dict) and not _is_attestation(m)]
        if not candidates:
            raise ImageError(f"{src.path}: the index lists no image manifests")
        if len({m.get("digest") for m in candidates}) > 1:
            arch = _host_arch()
            matching = [
                m
                for m in candidates
                if (m.get("platform") or {}).get("os", "linux") == "linux"
                and (m.get("platform") or {}).get("architecture") == arch
            ]
            if len({m.get("digest") for m in matching}) != 1:
                listed = ", ".join(_describe(m) for m in candidates)
                if any(m.get("platform") for m in candidates) and not matching:
                    raise ImageError(f"{src.path}: none of its images is for linux/{arch}: {listed}")
                raise ImageError(
                    f"{src.path} holds {len(candidates)} different images ({listed}); "
                    "cannot tell which one to import"
                )
            candidates = matching
        desc = candidates[0]
        if desc.get("mediaType") in _OCI_INDEX_TYPES:
            nested = src.read_json(src.read_blob(desc.get("digest", "")), "image index")
            inner = self._pick_manifest(src, nested, depth + 1)
            annotations = {**(desc.get("annotations") or {}), **(inner.get("annotations") or {})}
            return {**inner, "annotations": annotations}
        return desc

    def _import(
        self, src: _Source, name: str | None, progress: Progress, source_label: str | None
    ) -> ImageInfo:
        plan = self._plan_checked(src, source_label)
        if name is None and plan.default_name and NAME_RE.fullmatch(plan.default_name):
            name = plan.default_name
        if (self._digest_dir(plan.digest) / "image.json").is_file():
            _emit(progress, f"{plan.digest} is already in the store")
            try:
                return self.tag(name, plan.digest) if name else self._info(plan.digest, None)
            except ImageNotFound:
                pass  # removed meanwhile: unpack it again
        with self._building() as tmp:
            rootfs = tmp / "rootfs"
            rootfs.mkdir(mode=0o755)
            total = len(plan.layers)
            for i, (rel, expected) in enumerate(plan.layers, 1):
                label = f"layer {i}/{total} ({expected or rel})"
                _emit(progress, f"applying {label}")
                with src.open(rel) as blob:
                    _apply_layer(str(rootfs), blob, label, expected)
            os.chmod(rootfs, 0o755)
            info = self._commit(tmp, plan.digest, plan.source, plan.config, name)
        _emit(progress, f"imported {plan.digest} ({info.size_bytes / 1e6:.1f} MB)")
        return info

    def pull(
        self,
        ref: str,
        name: str | None = None,
        *,
        tls_verify: bool = True,
        progress: Progress = None,
    ) -> ImageInfo:
        """Pull ``ref`` from a registry with skopeo and import it; named ``ref`` unless ``name``."""
        ref = ref.removeprefix("docker://")
        if not ref or ref.startswith("-") or any(c.isspace() for c in ref):
            raise ImageError(f"invalid image reference {ref!r}")
        if name is None:
            if not NAME_RE.fullmatch(ref):
                raise ImageError(f"{ref!r} is not usable as an image name; pass a name")
            name = ref
        validate_name(name)
        if shutil.which("skopeo") is None:
            raise ImageError("skopeo is not installed: apt-get install skopeo")
        self._ensure()
        workdir = Path(tempfile.mkdtemp(prefix=".pull-", dir=self.root))
        try:
            layout = workdir / "layout"
            cmd = ["skopeo", "copy"]
            if not tls_verify:
                cmd.append("--src-tls-verify=false")
            cmd += [f"docker://{ref}", f"oci:{layout}:img"]
            _emit(progress, "$ " + " ".join(cmd))
            _run_streaming(cmd, progress, f"skopeo copy of {ref}", "apt-get install skopeo")
            src = _Source(layout)
            try:
                return self._import(src, name, progress, f"registry:{ref}")
            finally:
                src.close()
        finally:
            _rmtree(workdir)
