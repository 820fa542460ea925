"""What every part of the image store shares: errors, names, image info, digests and sizes of
trees, deleting trees that may have something mounted inside them, and running a tool (skopeo,
mmdebstrap) with its output as progress."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import subprocess
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

Progress = Callable[[str], None] | None

NAME_RE = re.compile(r"[a-z0-9][a-z0-9._/:-]{0,127}")
DIGEST_RE = re.compile(r"sha256:([0-9a-f]{64})")


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


class Store(Protocol):
    """What an importer or a builder needs of the image store (``store.ImageStore``): a
    directory to build in, then the commit of what was built there. Named here so that the
    store imports its importers and they never import it back."""

    root: Path

    def ensure(self) -> None: ...

    def digest_dir(self, digest: str) -> Path: ...

    def info(self, digest: str, name: str | None) -> ImageInfo: ...

    def tag(self, name: str, digest: str) -> ImageInfo: ...

    def commit(
        self, tmp: Path, digest: str, source: str, config: dict[str, Any], name: str | None
    ) -> ImageInfo: ...

    def building(self) -> contextlib.AbstractContextManager[Path]: ...


def validate_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ImageError(
            f"invalid image name {name!r}: use 1-128 characters of a-z 0-9 . _ / : - "
            "starting with a letter or digit"
        )
    return name


def empty_config(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"env": [], "cmd": [], "entrypoint": [], "working_dir": "", "user": ""}
    config.update(overrides)
    return config


def emit(progress: Progress, message: str) -> None:
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


def mounts_under(path: str) -> list[str]:
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


def overlay_users(path: str | os.PathLike) -> list[str]:
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


def rmtree(path: str | os.PathLike) -> None:
    """Delete a tree we created; never descends into something still mounted inside it."""
    path = os.fspath(path)
    if not os.path.lexists(path):
        return
    for point in mounts_under(path):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
    if mounts_under(path):
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


def run_streaming(cmd: list[str], progress: Progress, what: str, missing_hint: str) -> None:
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
