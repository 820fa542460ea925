"""``hangar sandbox cp``: files and directories in and out of a sandbox, streamed a piece at a
time, with a progress bar on stderr for large transfers."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path, PurePosixPath

from .. import _api as api
from .._dirs import local_tree
from .._errors import HangarError, NotFoundError, ValidationError
from .._models import FileEntry
from ..sandbox import Sandbox
from ._common import call, connect, fail, human_bytes, say

# A transfer this large gets a bar by default (on a terminal).
BAR_FROM_BYTES = 4 * 1024 * 1024
REMOTE = re.compile(r"^(?P<id>[A-Za-z0-9][A-Za-z0-9_-]*):(?P<path>/.*)$")


class Bar:
    """``  12.0 MiB / 40.0 MiB  30%  [#####...........]  5.1 MiB/s`` on stderr, redrawn at
    most ten times a second, ended with a newline."""

    WIDTH = 24

    def __init__(self, total: int, enabled: bool) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = enabled
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and now - self.drawn >= 0.1:
            self.drawn = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        part = min(self.done / self.total, 1.0)
        filled = int(part * self.WIDTH)
        rate = self.done / max(now - self.started, 1e-6)
        sys.stderr.write(f"\r  {human_bytes(self.done)} / {human_bytes(self.total)}  {part:4.0%}  "
                         f"[{'#' * filled}{'.' * (self.WIDTH - filled)}]  {human_bytes(rate)}/s ")  # fmt: skip
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            sys.stderr.write("\n")
            sys.stderr.flush()


def _split(spec: str) -> tuple[str | None, str]:
    m = REMOTE.match(spec)
    return (m["id"], m["path"]) if m else (None, spec)


def _entry(sandbox: Sandbox, path: str) -> FileEntry | None:
    """The remote entry at ``path`` (from its parent's listing), or None if there is none."""
    pure = PurePosixPath(path)
    if str(pure) == "/":
        return FileEntry(name="/", path="/", type="dir", size=0)
    try:
        entries = sandbox.files.list(str(pure.parent))
    except (NotFoundError, ValidationError):
        return None
    return next((e for e in entries if e.name == pure.name), None)


def _remote_tree_size(sandbox: Sandbox, path: str) -> int:
    total, pending = 0, [path]
    while pending:
        for entry in sandbox.files.list(pending.pop()):
            if entry.type == "dir":
                pending.append(entry.path)
            elif entry.type == "file":
                total += entry.size
    return total


def _bar(args: argparse.Namespace, total: int) -> Bar:
    enabled = (
        args.progress if args.progress is not None else (sys.stderr.isatty() and total >= BAR_FROM_BYTES)
    )
    return Bar(total, enabled)


def copy(args: argparse.Namespace, src: str, dst: str) -> int:
    src_id, src_path = _split(src)
    dst_id, dst_path = _split(dst)
    if (src_id is None) == (dst_id is None):
        fail("one side of cp is a sandbox path ID:/path, the other a local path", 2)
    sandbox_id = src_id or dst_id
    assert sandbox_id is not None
    sandbox = Sandbox(api.parse_sandbox(call(args, api.sandbox_get(sandbox_id))), connect(args))
    try:
        if dst_id is not None:
            return _upload(args, sandbox, Path(src_path), dst_path)
        return _download(args, sandbox, src_path, Path(dst_path))
    except OSError as exc:
        fail(f"{exc.filename or ''}: {exc.strerror}" if exc.strerror else str(exc))


def _upload(args: argparse.Namespace, sandbox: Sandbox, local: Path, remote: str) -> int:
    if local.is_dir():
        files, _ = local_tree(local)
        bar = _bar(args, sum(p.stat().st_size for _, p in files))
        try:
            count = sandbox.files.upload_dir(local, remote, progress=bar)
        finally:
            bar.close()
        say(f"{count} file(s), {human_bytes(bar.done)} -> {sandbox.id}:{remote}")
        return 0
    if not local.is_file():
        fail(f"{local}: no such file or directory", 1)
    target = remote
    if remote.endswith("/") or ((e := _entry(sandbox, remote)) is not None and e.type == "dir"):
        target = api.join(remote, local.name)
    bar = _bar(args, local.stat().st_size)
    try:
        size = sandbox.files.upload(local, target, progress=bar)
    finally:
        bar.close()
    say(f"{human_bytes(size)} -> {sandbox.id}:{target}")
    return 0


def _download(args: argparse.Namespace, sandbox: Sandbox, remote: str, local: Path) -> int:
    entry = _entry(sandbox, remote)
    if entry is None:
        fail(f"{sandbox.id}:{remote}: no such file or directory")
    if entry.type == "dir":
        bar = _bar(args, _remote_tree_size(sandbox, remote))
        try:
            count = sandbox.files.download_dir(remote, local, progress=bar)
        finally:
            bar.close()
        say(f"{count} file(s), {human_bytes(bar.done)} -> {local}")
        return 0
    if entry.type != "file":
        fail(f"{sandbox.id}:{remote} is a {entry.type}, not a file or directory")
    target = local / PurePosixPath(remote).name if local.is_dir() or str(local).endswith(os.sep) else local
    bar = _bar(args, entry.size)
    try:
        size = sandbox.files.download(remote, target, progress=bar)
    except HangarError:
        target.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    say(f"{human_bytes(size)} -> {target}")
    return 0
