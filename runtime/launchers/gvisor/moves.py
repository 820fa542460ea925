"""A paused gVisor sandbox moving to another node (a drain): what of it is copied, and how the
copy becomes a sandbox of the node it arrives on.

A paused sandbox is its checkpoint (``checkpoint/``: memory, processes, open files), when it
was paused with one, and its disk (``disk/disk.ext4``: every file it wrote). Nothing else of
it is needed elsewhere: the OCI bundle, the mounts and the network are the node's and are made
again there (gVisor restores into a bundle of other paths, and its network stack takes the
addresses of the namespace it is restored into). A sandbox whose files are not on a disk of
its own (``disk_mb: 0``) cannot move: its files are a directory tree of the node's filesystem.

The copy arrives in a hidden directory beside the sandboxes' (:meth:`incoming_dir`), which
reconciliation does not see, and becomes the sandbox once the database says it is this node's
(:meth:`adopt`): a rename. A restore or a create that finds it not yet adopted (its node's
worker died in between) adopts it first.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from ...host import disks
from ...host.locks import file_lock
from ..base import LauncherError

if TYPE_CHECKING:
    from ..agent.launcher import AgentBackedLauncher as _Launcher
    from .runsc import Runsc
else:
    _Launcher = object

MOVED_IN = "moved-in"  # in a sandbox's directory: it came from another node, its bundle is to make


class MoveMixin(_Launcher):
    """:meth:`paused_files`, :meth:`incoming_dir` and :meth:`adopt` of
    :class:`~.launcher.GVisorLauncher`."""

    if TYPE_CHECKING:
        sandboxes_dir: Path
        runsc: Runsc

        def _dir(self, sandbox_id: str) -> Path: ...
        def _destroy_locked(self, sandbox_id: str) -> None: ...
        def _release(
            self, sandbox_id: str, delete: bool = True, keep_lease: bool = False, unmount: bool = True
        ) -> None: ...

    @contextlib.contextmanager
    def paused_files(self, sandbox_id: str) -> Iterator[list[tuple[str, Path]]]:
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            d = self._dir(sandbox_id)
            if not d.is_dir():
                raise LauncherError(f"sandbox {sandbox_id} is not on this node")
            if self.runsc.status(sandbox_id) in ("running", "unknown"):
                raise LauncherError(f"sandbox {sandbox_id} runs: only a paused sandbox can move")
            if (d / "upper").exists():
                raise LauncherError(
                    f"sandbox {sandbox_id} keeps its files on the node's filesystem (disk_mb 0): it cannot move"
                )
            # Nothing of the runtime is left (a checkpoint's release may not have finished):
            # the root filesystem unmounted, then the disk, so its file holds every write.
            self._release(sandbox_id, keep_lease=True)
            files: list[tuple[str, Path]] = []
            image = d / "checkpoint"
            if (image / "checkpoint.img").is_file():
                files += [(f"checkpoint/{p.name}", p) for p in sorted(image.iterdir()) if p.is_file()]
            if (d / "disk").exists():
                disks.unmount(d / "disk")
                files.append((f"disk/{disks.IMAGE}", d / "disk" / disks.IMAGE))
            yield files

    def incoming_dir(self, sandbox_id: str) -> Path:
        return self.sandboxes_dir / f".incoming-{self._dir(sandbox_id).name}"

    def adopt(self, sandbox_id: str) -> None:
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            self._adopt_locked(sandbox_id)

    def _adopt_locked(self, sandbox_id: str) -> None:
        incoming, d = self.incoming_dir(sandbox_id), self._dir(sandbox_id)
        if not incoming.is_dir():
            return
        if d.exists():  # an earlier stay of this sandbox here, which the database has left
            self._destroy_locked(sandbox_id)
        if (incoming / "disk").is_dir():
            (incoming / "disk" / disks.MOUNT).mkdir(exist_ok=True)
        (incoming / MOVED_IN).touch()
        incoming.chmod(0o700)
        incoming.rename(d)

    def sweep_incoming(self, idle_s: float) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return sweep(self.sandboxes_dir, idle_s)
        return []


def sweep(sandboxes_dir: Path, idle_s: float) -> list[str]:
    """Remove the copies in ``sandboxes_dir`` that nothing has written to for ``idle_s`` (their
    move died with its worker: a later move of the same sandbox starts over); their ids."""
    now, swept = time.time(), []
    for incoming in sandboxes_dir.glob(".incoming-*"):
        newest = max((p.stat().st_mtime for p in incoming.rglob("*")), default=incoming.stat().st_mtime)
        if now - max(newest, incoming.stat().st_mtime) > idle_s:
            shutil.rmtree(incoming, ignore_errors=True)
            swept.append(incoming.name.removeprefix(".incoming-"))
    return swept


def needs_bundle(d: Path) -> bool:
    """Whether the sandbox in ``d`` came from another node and has no bundle of this node's yet."""
    return (d / MOVED_IN).exists() and not (d / "bundle" / "config.json").exists()
