"""Checkpoint and restore of gVisor sandboxes (a pause that keeps processes and memory).

gVisor saves a whole sandbox (memory, processes, open files, its own network stack) with
``runsc checkpoint`` and continues it with ``runsc restore``. What it cannot save is a host
socket, and the agent's exec and file connections are host sockets (``--host-uds=create``), as
is its listening socket. So the agent is first quiesced: it stops listening and lets go of
every connection; commands streamed to a live client (background processes and terminals,
opened detachable) keep running, detached, and the client re-attaches after the restore.
Debian 12's runsc stops the sandbox when a checkpoint fails, and its ``--leave-running`` hangs:
a failed checkpoint therefore falls back to a pause in stop mode.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...host.locks import file_lock
from ...host.network import Lease
from ..agent.protocol import AgentError, AgentFileError, AgentUnavailable
from ..base import Handle, LauncherError, SandboxNotRunning, SandboxSpec
from . import bundle, cgroups
from .moves import needs_bundle
from .runsc import wait_exited

if TYPE_CHECKING:
    from ...host.disks import Disks
    from ...host.hostnames import HostNames
    from ...host.network import Network, Policy
    from ..agent.launcher import AgentBackedLauncher as _Launcher
    from .runsc import Runsc
else:
    _Launcher = object

log = logging.getLogger(__name__)


class CheckpointMixin(_Launcher):
    """:meth:`checkpoint` and :meth:`restore` of :class:`~.launcher.GVisorLauncher`, whose
    sandbox directories, runsc, network and agent they use."""

    if TYPE_CHECKING:  # what they use of GVisorLauncher, for mypy (the class itself mixes them in)
        sandboxes_dir: Path
        runsc: Runsc
        cgroup_parents: tuple[str, str]
        disks: Disks
        network: Network
        names: HostNames

        def _dir(self, sandbox_id: str) -> Path: ...
        def _adopt_locked(self, sandbox_id: str) -> None: ...
        def _socket(self, handle: Handle) -> str: ...
        def _new_handle(self, spec: SandboxSpec) -> Handle: ...
        def _policy(self, spec_network: dict[str, Any] | None) -> Policy: ...
        def _agent_answers(self, handle: Handle) -> bool: ...
        def _console_tail(self, d: Path) -> str: ...
        def _write_resolution(self, sandbox_id: str, policy: Policy, names: dict[str, list[str]]) -> None: ...
        def _release(
            self, sandbox_id: str, delete: bool = True, keep_lease: bool = False, unmount: bool = True
        ) -> None: ...

    def checkpoint(self, handle: Handle) -> None:
        sandbox_id = handle["id"]
        if not self.capabilities().checkpoint:
            raise LauncherError(f"the {self.name} runtime cannot checkpoint a sandbox")
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            d = self._dir(sandbox_id)
            image = d / "checkpoint"
            if not (image / "checkpoint.img").exists():
                started = time.monotonic()
                status, pid = self.runsc.state(sandbox_id)
                if status == "unknown":
                    raise LauncherError(f"runsc could not tell the state of sandbox {sandbox_id}: try again")
                if status != "running":
                    raise SandboxNotRunning(
                        f"sandbox {sandbox_id} is {status}: there is nothing to checkpoint"
                    )
                marker = d / "quiesced"
                if not marker.exists():  # else an earlier try of this pause quiesced it already
                    self._quiesce(sandbox_id, marker)
                partial = d / "checkpoint.partial"
                shutil.rmtree(partial, ignore_errors=True)
                # The sandbox's own process writes the image, and on cgroup v1 the dirty page cache
                # it makes counts against the sandbox's memory limit with nothing to throttle it:
                # a sandbox near its limit would be OOM-killed mid-checkpoint. The limit is lifted
                # for the checkpoint (its processes are frozen by it within milliseconds) and put
                # back should the sandbox live on.
                lifted = cgroups.lift_memory_limit(self.cgroup_parents, sandbox_id)
                quiesced = time.monotonic()
                proc = self.runsc("checkpoint", *self.runsc.checkpoint_flags(), "--image-path", str(partial),
                                  sandbox_id, timeout=600)  # fmt: skip
                if proc.returncode != 0:
                    shutil.rmtree(partial, ignore_errors=True)
                    marker.unlink(missing_ok=True)
                    if self.runsc.status(sandbox_id) == "running":
                        cgroups.restore_limits(lifted)
                        self._relisten(sandbox_id)
                    first = (proc.stderr.strip().splitlines() or ["(no message)"])[0]
                    raise LauncherError(f"runsc checkpoint failed: {first[:300]}")
                checkpointed = time.monotonic()
                # Newer runsc (2024) may return before the sandbox's process has exited, and says
                # "running" until it has: a restore that came that soon would skip `runsc restore`
                # and wait for an agent that is not there. The pause ends once it has exited.
                if pid > 0 and not wait_exited(pid, 30.0):
                    self.runsc.kill(sandbox_id, "KILL")  # it is saved
                partial.rename(image)
                log.info("checkpoint of %s: quiesce %.3f s, runsc checkpoint %.3f s, exit %.3f s, %d MB saved",
                         sandbox_id, quiesced - started, checkpointed - quiesced, time.monotonic() - checkpointed,
                         _tree_mb(image))  # fmt: skip
            # The sandbox has exited and its image is saved. Its root filesystem stays mounted
            # for the restore: unmounting an overlay syncs the filesystem under it, which holds
            # the image just written (~0.5 s for 512 MB here). runsc's record of it is deleted in
            # the background (`runsc delete` kills the gofer and waits for both processes in
            # steps of 100 ms); a restore that comes sooner waits for it, or deletes it itself.
            # The image reaches the disk through the kernel's own writeback.
            self._release(sandbox_id, delete=False, keep_lease=True, unmount=False)
            threading.Thread(target=self._release_checkpointed, args=(sandbox_id,), daemon=True).start()

    def restore(self, spec: SandboxSpec) -> Handle:
        if not self.capabilities().checkpoint:
            raise LauncherError(f"the {self.name} runtime cannot restore a sandbox")
        d = self._dir(spec.id)
        image = d / "checkpoint"
        with file_lock(self.sandboxes_dir / f".{spec.id}.lock"):
            handle = self._new_handle(spec)
            if (d / "handle.json").exists() and self._agent_answers(handle):
                return handle  # a duplicated or retried task: restored already
            started = released = restored = time.monotonic()
            lease: Lease | None = None
            names: dict[str, list[str]] = {}
            try:
                if self.runsc.status(spec.id) != "running":
                    self._adopt_locked(spec.id)  # moved here, and its worker died before adopting it
                    if not (image / "checkpoint.img").exists():
                        raise LauncherError(f"sandbox {spec.id} has no checkpoint to restore")
                    self._release(spec.id, keep_lease=True, unmount=False)  # mounts stay for it
                    bundle.mount_dirs(d, spec, self.disks)
                    moved = needs_bundle(d)
                    policy = self._policy(spec.network)
                    if self.network.lease_of(spec.id) is not None or (
                        moved and (policy.enabled or spec.network)
                    ):
                        # It was saved with a network: its namespace is made again, with the
                        # addresses it had here (the lease was kept) or, moved from another
                        # node, with new ones of this node's pool, which gVisor's stack takes
                        # on restore; under the policy in force now.
                        lease, names = self.network.setup(spec.id, policy)
                    if moved:  # its bundle is made here, with this node's paths and network
                        config = bundle.oci_spec(spec, d, agent_binary=self.agent_binary, ca=self.sandbox_ca,
                                                 cgroup_parent=self.names.cgroup_parent, lease=lease)  # fmt: skip
                        bundle.write_private(d / "bundle" / "config.json", json.dumps(config))
                    released = time.monotonic()
                    self.runsc.start(d / "log" / "console.log", "restore", "--detach", "--bundle", str(d / "bundle"),
                                     "--image-path", str(image), spec.id, network=lease is not None)  # fmt: skip
                # The bundle is the one it was checkpointed with: restore needs the same spec.
                restored = time.monotonic()
                self._relisten_and_wait(spec.id, handle, 15.0)
                if lease is not None:
                    self._write_resolution(spec.id, policy, names)
            except (LauncherError, AgentError) as exc:
                tail = self._console_tail(d)
                self._release(spec.id)
                shutil.rmtree(image, ignore_errors=True)
                raise LauncherError(f"the sandbox could not be restored: {exc}; console: {tail}") from exc
            (d / "handle.json").write_text(json.dumps(handle))
            _discard(image)  # removing 512 MB of image takes ~0.25 s: not the caller's wait
            log.info("restore of %s: cleanup %.3f s, runsc restore %.3f s, agent back %.3f s", spec.id,
                     released - started, restored - released, time.monotonic() - restored)  # fmt: skip
            return handle

    def _quiesce(self, sandbox_id: str, marker: Path) -> None:
        """Quiesce the agent (see checkpoint); a connection that will not close in time (one
        being opened right then, say) is worth another try or two before giving up."""
        handle = self.handle_for(sandbox_id)
        for attempt in range(3):
            marker.touch()
            try:
                self.quiesce_agent(handle)
                return
            except AgentError as exc:
                marker.unlink(missing_ok=True)
                log.warning("quiesce of %s failed (try %d): %s; agent: %s", sandbox_id, attempt + 1, exc,
                            self._console_tail(self._dir(sandbox_id)).splitlines()[-1:])  # fmt: skip
                with contextlib.suppress(AgentError):
                    self._relisten_and_wait(sandbox_id, handle, 5.0)
                if attempt == 2:
                    raise LauncherError(f"the sandbox's agent could not be quiesced: {exc}") from exc

    def _release_checkpointed(self, sandbox_id: str) -> None:
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            # Only while it is still checkpointed: a restore may have been quicker.
            saved = self._dir(sandbox_id) / "checkpoint" / "checkpoint.img"
            if saved.exists() and self.runsc.status(sandbox_id) != "running":
                self._release(sandbox_id, keep_lease=True, unmount=False)

    def _relisten_and_wait(self, sandbox_id: str, handle: Handle, timeout: float) -> None:
        # Right after `runsc restore --detach` returns, `runsc kill` may not reach the agent
        # yet: signal again until it answers (listening twice is harmless).
        deadline = time.monotonic() + timeout
        while True:
            self._relisten(sandbox_id)
            try:
                self.agent(handle).wait_ready(min(0.5, max(0.05, deadline - time.monotonic())))
                return
            except AgentUnavailable:
                if time.monotonic() >= deadline:
                    raise

    def _relisten(self, sandbox_id: str) -> None:
        # SIGUSR2 to PID 1, the agent: listen again (see the agent's op_quiesce).
        self.runsc.kill(sandbox_id, "USR2")

    def quiesce_agent(self, handle: Handle) -> None:
        """Ask the agent to stop listening (op_quiesce). Whether it then quiesced or not (a
        connection stayed open: EBUSY), it closed its listening socket and unlinked it inside
        the sandbox; but gVisor leaves the host's file of a socket bound through the gofer in
        place, and while that file is there the agent cannot bind a new socket at the path
        (EPERM) and connecting to it is refused: the sandbox would be unreachable for good
        once a checkpoint did not happen. So the host's file goes as soon as the agent has
        answered; its next try to listen (on SIGUSR2, or at once after a failed quiesce) binds
        a fresh one."""
        try:
            self.agent(handle).quiesce()
        except AgentFileError:  # it answered: not listening any more
            unlink_socket(self._socket(handle))
            raise
        unlink_socket(self._socket(handle))

    def relisten(self, handle: Handle, timeout: float = 10.0) -> None:
        """Make a quiesced agent listen again, and wait until it answers."""
        self._relisten_and_wait(handle["id"], handle, timeout)


def unlink_socket(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _tree_mb(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) >> 20


def _discard(path: Path) -> None:
    """Remove the tree at ``path`` in the background: renamed out of the way at once (a hidden
    name beside it, which goes with its directory should this process die first)."""
    trash = path.with_name(f".discard-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()
