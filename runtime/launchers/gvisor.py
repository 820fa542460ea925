"""gVisor launcher: one ``runsc`` sandbox per Hangar sandbox, driven through OCI bundles.

Each sandbox gets, under ``<state_dir>/sandboxes/<id>/``:

- ``rootfs/``: an overlayfs whose lower dir is the cached image, so the image is shared
  copy-on-write and never written by a sandbox; its ``upper/`` and ``work/`` dirs are on:
- ``disk/``: the sandbox's own ext4 filesystem of ``disk_mb`` (see disks.py), mounted at
  ``disk/fs``, so what it writes can never fill the node's disk (a sandbox created with no
  disk of its own, ``disk_mb=0``, has them in its directory instead);
- ``run/``: bind-mounted at ``/.hangar/run``; the guest agent (PID 1, bind-mounted read-only
  at ``/.hangar/agent``) listens on ``run/agent.sock``. runsc runs with ``--host-uds=create``
  so that socket is a real host socket: exec and file calls are one unix-socket round trip
  instead of a ``runsc exec`` process each (~45 ms here);
- ``log/console.log``: runsc's and the agent's stdout and stderr (a 1 MB tmpfs, as ``run/`` is);
- ``bundle/config.json`` and ``handle.json`` (the persisted handle, for re-adoption);
- ``checkpoint/``: while paused in checkpoint mode, the saved sandbox (``runsc checkpoint``).

runsc is started in its own session, so stopping Hangar's processes never stops sandboxes.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from . import agent_client, disks
from .agent.build import agent_binary
from .base import (
    ExecRequest,
    ExecResult,
    FileEntry,
    FileOpError,
    Handle,
    Launcher,
    LauncherError,
    OutputCallback,
    Process,
    ProcessExit,
    ProcessRequest,
    RuntimeState,
    SandboxGone,
    SandboxNotRunning,
    SandboxSpec,
    Stats,
)
from .locks import file_lock
from .network import Lease, Network, Policy, unshare_wrapper, validate_policy

log = logging.getLogger(__name__)

AGENT_PATH = "/.hangar/agent"
AGENT_RUN_DIR = "/.hangar/run"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CGROUP_PARENT = "hangar"
# Docker's default capability set: enough for package managers inside the sandbox; gVisor's
# sentry, not the host kernel, is what enforces them.
CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]  # fmt: skip


def _run(argv: list[str], *, timeout: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError as exc:
        raise LauncherError(f"{argv[0]} not found: install it (apt-get install runsc)") from exc
    except subprocess.TimeoutExpired as exc:
        raise LauncherError(f"{' '.join(argv[:4])} timed out after {timeout:.0f}s") from exc
    if check and proc.returncode != 0:
        raise LauncherError(f"{' '.join(argv[:5])} failed: {proc.stderr.strip()[-500:]}")
    return proc


def _wait_blocking(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Wait for ``proc`` in the kernel; kill it after ``timeout`` (then None). Python's own
    ``wait(timeout=…)`` polls with sleeps growing to 50 ms, which added ~35 ms to every
    ``runsc run`` (it returns after ~130 ms; the poll noticed at ~165 ms)."""
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.daemon = True
    timer.start()
    try:
        returncode = proc.wait()
    finally:
        timer.cancel()
    return None if expired.is_set() else returncode


def _mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


def _is_mounted(path: Path) -> bool:
    return str(path) in _mount_points()


NEWER_RUNSC = "/usr/local/lib/hangar/runsc"
# ptrace works everywhere, and on the 2-CPU VM Hangar is developed on it ran an exec in
# ~11 ms where the newer runsc's own default, systrap, took ~42 ms (measured, both runsc
# 20240729). Nodes with KVM (bare metal) can set HANGAR_RUNSC_PLATFORM=kvm.
DEFAULT_PLATFORM = "ptrace"


def default_runsc() -> str:
    """The runsc to use when none is configured: the newer one ``scripts/install-runsc.sh``
    puts beside Debian 12's (which cannot ``statx`` and always compresses checkpoints), else
    the one on PATH."""
    return NEWER_RUNSC if os.access(NEWER_RUNSC, os.X_OK) else "runsc"


class GVisorLauncher(Launcher):
    name = "gvisor"
    can_checkpoint = True
    can_network = True

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        runsc: str = "",
        platform: str = DEFAULT_PLATFORM,
        agent_cache_dir: str | os.PathLike[str] | None = None,
        extra_flags: tuple[str, ...] = (),
        network_pool: str = "10.88.0.0/16",
        network_exceptions: tuple[str, ...] = (),
        network_nameservers: tuple[str, ...] = (),
        gateway_port: int = 0,
        disk_mb: int = 10240,
        spare_disks: int = 2,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.disks = disks.Disks(self.state_dir / "disks", default_mb=disk_mb, spare=spare_disks)
        self.network = Network(self.state_dir, pool=network_pool, exceptions=network_exceptions,
                               nameservers=network_nameservers, gateway_port=gateway_port)  # fmt: skip
        self.root = self.state_dir / "runsc-root"
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.runsc = runsc or default_runsc()
        self.platform = platform
        self.extra_flags = tuple(extra_flags)
        self.agent_cache_dir = Path(agent_cache_dir) if agent_cache_dir else self.state_dir / "bin"
        self._agent: Path | None = None
        self._help: dict[str, str] = {}

    # -- plumbing -------------------------------------------------------------------------

    @property
    def agent(self) -> Path:
        if self._agent is None:
            self._agent = agent_binary(self.agent_cache_dir)
        return self._agent

    def _runsc(self, *args: str, network: bool = False) -> list[str]:
        flags = [
            self.runsc,
            "--root",
            str(self.root),
            "--network=sandbox" if network else "--network=none",
            "--host-uds=create",
            "--overlay2=none",
        ]
        if self.platform:
            flags.append(f"--platform={self.platform}")
        if network and self._knows("flags", "-net-disconnect-ok"):
            # gVisor cannot save a TCP connection to outside the sandbox (the peer's side is not
            # saved with it), and without this refuses the whole checkpoint while one is open,
            # even one in its last ACK. With it, such connections are reset on the checkpoint,
            # as a peer would see after any pause; connections inside the sandbox are saved.
            flags.append("--net-disconnect-ok")
        return [*flags, *self.extra_flags, *args]

    def _knows(self, command: str, flag: str) -> bool:
        """Whether this runsc's ``command`` (``flags`` for global ones) lists ``flag``."""
        if command not in self._help:
            argv = [self.runsc, "flags"] if command == "flags" else [self.runsc, command, "--help"]
            proc = _run(argv, check=False)
            self._help[command] = proc.stdout + proc.stderr
        return flag in self._help[command]

    def _dir(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise LauncherError(f"invalid sandbox id {sandbox_id!r}")
        return self.sandboxes_dir / sandbox_id

    def _client(self, handle: Handle) -> agent_client.AgentClient:
        return agent_client.AgentClient(handle["socket"])

    def _handle_for(self, sandbox_id: str) -> Handle:
        d = self._dir(sandbox_id)
        try:
            return json.loads((d / "handle.json").read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return {
                "id": sandbox_id,
                "runtime": self.name,
                "dir": str(d),
                "socket": str(d / "run" / "agent.sock"),
            }

    def _oci_spec(self, spec: SandboxSpec, d: Path, lease: Lease | None = None) -> dict[str, Any]:
        env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": spec.hostname, "TERM": "xterm-256color"}
        env.update(spec.env)
        mounts: list[dict[str, Any]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": AGENT_PATH, "type": "bind", "source": str(self.agent), "options": ["rbind", "ro"]},
            {"destination": AGENT_RUN_DIR, "type": "bind", "source": str(d / "run"), "options": ["rbind", "rw"]},
        ]  # fmt: skip
        for m in spec.mounts:
            mounts.append(
                {
                    "destination": m.destination,
                    "type": "bind",
                    "source": m.source,
                    "options": ["rbind", "ro" if m.read_only else "rw"],
                }
            )
        memory = spec.memory_mb * 1024 * 1024
        period = 100_000
        return {
            "ociVersion": "1.0.2",
            "process": {
                "terminal": False,
                "user": {"uid": 0, "gid": 0},
                "args": [AGENT_PATH, "--socket", f"{AGENT_RUN_DIR}/agent.sock"],
                "env": [f"{k}={v}" for k, v in env.items()],
                "cwd": "/",
                "capabilities": {
                    k: CAPABILITIES for k in ("bounding", "effective", "inheritable", "permitted")
                },
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}],
                "noNewPrivileges": False,
            },
            "root": {"path": str(d / "rootfs"), "readonly": False},
            "hostname": spec.hostname,
            "mounts": mounts,
            "linux": {
                "cgroupsPath": f"/{CGROUP_PARENT}/{spec.id}",
                "resources": {
                    "memory": {"limit": memory},
                    "cpu": {"quota": max(1000, int(spec.cpu * period)), "period": period},
                },
                "namespaces": [{"type": t} for t in ("pid", "ipc", "uts", "mount")]
                + [{"type": "network", "path": lease.netns_path} if lease else {"type": "network"}],
                "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"],
                "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            },
        }

    # -- lifecycle ------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        if not (spec.rootfs / "bin").exists() and not (spec.rootfs / "usr").exists():
            raise LauncherError(f"image root filesystem {spec.rootfs} is missing or empty")
        with file_lock(self.sandboxes_dir / f".{spec.id}.lock"):
            handle = self._new_handle(spec)
            if (d / "handle.json").exists() and self._agent_answers(handle):
                # A duplicated or retried task: the sandbox is already up.
                return handle
            self._mount_dirs(d, spec)
            # A checkpoint this sandbox was paused with is of no use once it starts afresh.
            for saved in ("checkpoint", "checkpoint.partial"):
                shutil.rmtree(d / saved, ignore_errors=True)
            policy = validate_policy(spec.network)
            lease, names = None, {}
            # A network of its own when its policy lets anything out, or when it is asked for
            # with egress none (a warm pool's member, whose claim sets the policy).
            if policy.enabled or spec.network:
                try:
                    lease, names = self.network.setup(spec.id, policy)
                except LauncherError:
                    self._destroy_locked(spec.id)
                    raise
            # The bundle holds the environment, secrets included: readable by root only.
            _write_private(d / "bundle" / "config.json", json.dumps(self._oci_spec(spec, d, lease)))
            (d / "handle.json").write_text(json.dumps(handle))
            if self._has_runtime_state(spec.id):
                # A leftover container from a crashed earlier attempt would make `run` fail.
                _run(self._runsc("delete", "--force", spec.id), check=False)
            # Its path appearing is what says the new agent listens (see below): not an old one's.
            _unlink_socket(handle["socket"])
            try:
                self._start(d, spec.id, "run", "--detach", "--bundle", str(d / "bundle"), spec.id,
                            network=lease is not None)  # fmt: skip
            except LauncherError as exc:
                self._destroy_locked(spec.id)
                raise LauncherError(f"runsc could not start the sandbox: {exc}") from exc
            try:
                # Listening is enough: the agent forks its first handlers while the caller
                # records the sandbox as running, instead of before (a ping waited ~4 ms for it).
                self._client(handle).wait_listening(15.0)
            except agent_client.AgentError as exc:
                tail = self._console_tail(d)
                self._destroy_locked(spec.id)
                raise LauncherError(f"sandbox agent did not come up: {exc}; console: {tail}") from exc
            if lease is not None:
                self._write_resolution(spec.id, policy, names)
            self.disks.refill_soon()  # the spare disk it may have taken
            return handle

    def _mount_dirs(self, d: Path, spec: SandboxSpec) -> None:
        for sub in ("rootfs", "run", "log", "bundle"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        d.chmod(0o700)  # its files and bundle (the environment, secrets included) are root's only
        disk = d / "disk"
        size = self.disks.default_mb if spec.disk_mb is None else spec.disk_mb
        if disk.exists():
            disks.mount(disk)  # its own, kept since it was made (a pause, a reboot)
        elif size and not (d / "upper").exists():  # (one with files of its own keeps them)
            self.disks.make(disk, size)
        layers = _layers(d)
        for sub in ("upper", "work"):
            (layers / sub).mkdir(exist_ok=True)
        mounted = _mount_points()
        # The sandbox can write into both: into run/ through its bind mount, into log/ as the
        # agent's stdout and stderr (/proc/1/fd/2 to root in it). Tiny tmpfs mounts keep it
        # from filling the host's disk through either.
        for sub in ("run", "log"):
            if str(d / sub) not in mounted:
                _mount("tmpfs", d / sub, "size=1m,mode=0700", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        if str(d / "rootfs") not in mounted:
            _mount(
                "overlay",
                d / "rootfs",
                f"lowerdir={spec.rootfs},upperdir={layers / 'upper'},workdir={layers / 'work'}",
            )

    def _new_handle(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        return {
            "id": spec.id,
            "runtime": self.name,
            "dir": str(d),
            "socket": str(d / "run" / "agent.sock"),
            "lower": str(spec.rootfs),
            "memory_mb": spec.memory_mb,
            "cpu": spec.cpu,
        }

    def prepare(self) -> None:
        self.disks.prepare()  # the default size's template and spares: the first create need not wait

    def _release(
        self, sandbox_id: str, delete: bool = True, keep_lease: bool = False, unmount: bool = True
    ) -> None:
        """Free what create() (or restore()) makes again: the runsc container, the mounts, the
        cgroup, the handle, the network's namespace and rules. Files (its disk) and a checkpoint
        stay. Lock held. Without ``delete``, runsc's record of a sandbox that has exited is
        left for later; without ``unmount`` its root filesystem and agent directory stay mounted
        (for a restore); with ``keep_lease``, its network addresses stay its own (a checkpoint
        holds a network stack configured with them)."""
        d = self._dir(sandbox_id)
        if delete and self._has_runtime_state(sandbox_id):
            _run(self._runsc("delete", "--force", sandbox_id), check=False)
        if unmount:
            mounted = _mount_points()  # one read of the mount table, not one per mount point
            for mountpoint in (d / "rootfs", d / "run", d / "log"):
                if str(mountpoint) in mounted:
                    _unmount(mountpoint)
        for controller_dir in _cgroup_dirs(sandbox_id):
            with contextlib.suppress(OSError):  # still busy until runsc's processes are gone
                controller_dir.rmdir()
        (d / "handle.json").unlink(missing_ok=True)
        (d / "quiesced").unlink(missing_ok=True)
        if self.network.lease_of(sandbox_id) is not None:
            self.network.teardown(sandbox_id, release=not keep_lease)

    # -- checkpoint and restore -------------------------------------------------------------
    #
    # gVisor saves a whole sandbox (memory, processes, open files, its own network stack) with
    # `runsc checkpoint` and continues it with `runsc restore`. What it cannot save is a host
    # socket, and the agent's exec and file connections are host sockets (--host-uds=create),
    # as is its listening socket. So the agent is first quiesced: it stops listening and lets
    # go of every connection; commands streamed to a live client (background processes and
    # terminals, opened detachable) keep running, detached, and the client re-attaches after
    # the restore. Debian 12's runsc stops the sandbox when a checkpoint fails, and its
    # --leave-running hangs: a failed checkpoint therefore falls back to a pause in stop mode.

    def checkpoint(self, sandbox_id: str) -> None:
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            d = self._dir(sandbox_id)
            image = d / "checkpoint"
            if not (image / "checkpoint.img").exists():
                started = time.monotonic()
                status, pid = self._runtime_state(sandbox_id)
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
                lifted = _lift_memory_limit(sandbox_id)
                quiesced = time.monotonic()
                proc = _run(self._runsc("checkpoint", *self._checkpoint_flags(), "--image-path", str(partial),
                                        sandbox_id), check=False, timeout=600)  # fmt: skip
                if proc.returncode != 0:
                    shutil.rmtree(partial, ignore_errors=True)
                    marker.unlink(missing_ok=True)
                    if self._runtime_status(sandbox_id) == "running":
                        _restore_limits(lifted)
                        self._relisten(sandbox_id)
                    first = (proc.stderr.strip().splitlines() or ["(no message)"])[0]
                    raise LauncherError(f"runsc checkpoint failed: {first[:300]}")
                checkpointed = time.monotonic()
                # Newer runsc (2024) may return before the sandbox's process has exited, and says
                # "running" until it has: a restore that came that soon would skip `runsc restore`
                # and wait for an agent that is not there. The pause ends once it has exited.
                if pid > 0 and not _wait_exited(pid, 30.0):
                    _run(self._runsc("kill", sandbox_id, "KILL"), check=False)  # it is saved
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
                if self._runtime_status(spec.id) != "running":
                    if not (image / "checkpoint.img").exists():
                        raise LauncherError(f"sandbox {spec.id} has no checkpoint to restore")
                    self._release(spec.id, keep_lease=True, unmount=False)  # mounts stay for it
                    self._mount_dirs(d, spec)
                    if self.network.lease_of(spec.id) is not None:
                        # It was saved with a network: gVisor's stack comes back configured with
                        # the addresses it had, so its namespace is made again with the same
                        # ones (the lease was kept), under the policy in force now.
                        policy = validate_policy(spec.network)
                        lease, names = self.network.setup(spec.id, policy)
                    released = time.monotonic()
                    self._start(d, spec.id, "restore", "--detach", "--bundle", str(d / "bundle"),
                                "--image-path", str(image), spec.id, network=lease is not None)  # fmt: skip
                # The bundle is the one it was checkpointed with: restore needs the same spec.
                restored = time.monotonic()
                self._relisten_and_wait(spec.id, handle, 15.0)
                if lease is not None:
                    self._write_resolution(spec.id, policy, names)
            except (LauncherError, agent_client.AgentError) as exc:
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
        handle = self._handle_for(sandbox_id)
        for attempt in range(3):
            marker.touch()
            try:
                self._quiesce_agent(handle)
                return
            except agent_client.AgentError as exc:
                marker.unlink(missing_ok=True)
                log.warning("quiesce of %s failed (try %d): %s; agent: %s", sandbox_id, attempt + 1, exc,
                            self._console_tail(self._dir(sandbox_id)).splitlines()[-1:])  # fmt: skip
                try:
                    self._relisten_and_wait(sandbox_id, handle, 5.0)
                except agent_client.AgentError:
                    pass
                if attempt == 2:
                    raise LauncherError(f"the sandbox's agent could not be quiesced: {exc}") from exc

    def _checkpoint_flags(self) -> tuple[str, ...]:
        # Newer runsc (2024) can skip compressing the saved memory: writing it plainly is several
        # times faster (flate runs at ~150 MB/s on one core) at the cost of disk. Older ones
        # always compress.
        return ("--compression=none",) if self._knows("checkpoint", "-compression") else ()

    def _release_checkpointed(self, sandbox_id: str) -> None:
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            # Only while it is still checkpointed: a restore may have been quicker.
            saved = self._dir(sandbox_id) / "checkpoint" / "checkpoint.img"
            if saved.exists() and self._runtime_status(sandbox_id) != "running":
                self._release(sandbox_id, keep_lease=True, unmount=False)

    def _relisten_and_wait(self, sandbox_id: str, handle: Handle, timeout: float) -> None:
        # Right after `runsc restore --detach` returns, `runsc kill` may not reach the agent
        # yet: signal again until it answers (listening twice is harmless).
        deadline = time.monotonic() + timeout
        while True:
            self._relisten(sandbox_id)
            try:
                self._client(handle).wait_ready(min(0.5, max(0.05, deadline - time.monotonic())))
                return
            except agent_client.AgentUnavailable:
                if time.monotonic() >= deadline:
                    raise

    def _relisten(self, sandbox_id: str) -> None:
        # SIGUSR2 to PID 1, the agent: listen again (see the agent's op_quiesce).
        _run(self._runsc("kill", sandbox_id, "USR2"), check=False)

    def _quiesce_agent(self, handle: Handle) -> None:
        """Ask the agent to stop listening (op_quiesce). Whether it then quiesced or not (a
        connection stayed open: EBUSY), it closed its listening socket and unlinked it inside
        the sandbox; but gVisor leaves the host's file of a socket bound through the gofer in
        place, and while that file is there the agent cannot bind a new socket at the path
        (EPERM) and connecting to it is refused: the sandbox would be unreachable for good
        once a checkpoint did not happen. So the host's file goes as soon as the agent has
        answered; its next try to listen (on SIGUSR2, or at once after a failed quiesce) binds
        a fresh one."""
        try:
            self._client(handle).quiesce()
        except agent_client.AgentFileError:  # it answered: not listening any more
            _unlink_socket(handle["socket"])
            raise
        _unlink_socket(handle["socket"])

    def _start(self, d: Path, sandbox_id: str, *args: str, network: bool = False) -> None:
        """``runsc run|restore --detach``; raises LauncherError with runsc's words. With a
        ``network``, runsc runs with its own network stack, wrapped (see network.py)."""
        argv = unshare_wrapper(self._runsc(*args, network=True)) if network else self._runsc(*args)
        # The sandbox inherits runsc's stdio and keeps it open for its whole life: give it a
        # log file, never a pipe we would wait on.
        log_path = d / "log" / "console.log"
        with open(log_path, "ab") as log:
            start = log.tell()
            returncode = _wait_blocking(
                subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
                ),
                timeout=120,
            )
        if returncode is None:
            raise LauncherError(f"runsc {args[0]} did not finish within 120 s")
        if returncode != 0:
            with open(log_path, "rb") as log:
                log.seek(max(start, log.seek(0, os.SEEK_END) - 800))
                err = log.read(800).decode(errors="replace").strip()
            raise LauncherError(f"runsc {args[0]} failed: {err}")

    def stop(self, handle: Handle, timeout: float = 5.0) -> None:
        sandbox_id = handle["id"]
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            if self._runtime_status(sandbox_id) in ("running", "paused", "created"):
                # The agent is PID 1: SIGTERM makes it forward TERM to everything, then exit.
                _run(self._runsc("kill", sandbox_id, "TERM"), check=False)
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline and self._runtime_status(sandbox_id) == "running":
                    time.sleep(0.05)
                if self._runtime_status(sandbox_id) in ("running", "paused", "created"):
                    _run(self._runsc("kill", "--all", sandbox_id, "KILL"), check=False)

    def suspend(self, sandbox_id: str, keep_files: bool = True) -> None:
        # What create() makes again from the spec goes (the runsc container, the mounts, the
        # cgroup); its disk, which holds every file the sandbox wrote, stays, and stays
        # mounted: unmounting would wait for the writeback of everything it wrote (seconds,
        # for a sandbox that wrote gigabytes), and a mounted disk costs the node next to nothing.
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            d = self._dir(sandbox_id)
            if self._has_runtime_state(sandbox_id):
                _run(self._runsc("kill", sandbox_id, "TERM"), check=False)  # the agent's clean exit
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and self._runtime_status(sandbox_id) == "running":
                    time.sleep(0.05)
            self._release(sandbox_id)
            for saved in ("checkpoint", "checkpoint.partial"):  # a checkpoint that did not hold
                shutil.rmtree(d / saved, ignore_errors=True)
            if not keep_files:
                disks.remove(d / "disk")
                for sub in ("upper", "work"):  # a sandbox with no disk of its own
                    shutil.rmtree(d / sub, ignore_errors=True)

    def destroy(self, handle: Handle) -> None:
        self.destroy_id(handle["id"])

    def destroy_id(self, sandbox_id: str) -> None:
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            self._destroy_locked(sandbox_id)
        with contextlib.suppress(OSError):
            (self.sandboxes_dir / f".{sandbox_id}.lock").unlink()

    # -- networks -------------------------------------------------------------------------

    def set_network(self, sandbox_id: str, policy: dict[str, Any]) -> None:
        parsed = validate_policy(policy)
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            if self.network.lease_of(sandbox_id) is None:
                if parsed.enabled:
                    raise LauncherError(
                        "this sandbox was started without a network: its egress can change only from "
                        "its next start (pause and resume it), or create it with a network"
                    )
                return
            names = self.network.apply(sandbox_id, parsed)
            self._write_resolution(sandbox_id, parsed, names)

    def _write_resolution(self, sandbox_id: str, policy: Policy, names: dict[str, list[str]]) -> None:
        # Through the agent, inside the sandbox: a write from the host into its root would
        # follow a symlinked /etc out of it, and gVisor caches the root filesystem anyway.
        client = self._client(self._handle_for(sandbox_id))
        lease = self.network.lease_of(sandbox_id)
        gateway = lease.host_ip if lease is not None else None
        for path, text in self.network.resolution_files(policy, names, gateway).items():
            with contextlib.suppress(agent_client.AgentError):
                client.write_file(path, text.encode())

    def network_reconcile(self, live: dict[str, dict[str, Any]]) -> list[str]:
        if not self.network.dir.exists():
            return []  # no sandbox of this node ever had a network
        cleaned = []
        for sandbox_id in self.network.leftovers(set(live)):
            with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
                if self._runtime_status(sandbox_id) == "running":
                    continue  # not in the snapshot of live ones, but running: leave it
                self.network.cleanup(sandbox_id)
                cleaned.append(sandbox_id)
        for sandbox_id in live:
            lease = self.network.lease_of(sandbox_id)
            if lease is None or not os.path.exists(lease.netns_path):
                continue  # no network, or paused: its rules are made again when it starts
            # Under the sandbox's lock, with the policy in force on the node (not the database's
            # snapshot): a change applied meanwhile is never undone here.
            with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"), contextlib.suppress(LauncherError):
                names = self.network.refresh(sandbox_id)
                policy = self.network.applied(sandbox_id)
                if names is not None and policy is not None:
                    self._write_resolution(sandbox_id, policy, names)
        return cleaned

    def _destroy_locked(self, sandbox_id: str) -> None:
        self._release(sandbox_id)  # delete --force kills whatever still runs first
        for disk in ("disk", ".disk.making"):  # mounted: rmtree would empty it, then fail
            disks.remove(self._dir(sandbox_id) / disk)
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)

    # -- inspection -----------------------------------------------------------------------

    def _has_runtime_state(self, sandbox_id: str) -> bool:
        # runsc keeps `<id>_sandbox:<id>.state` (and a lock) per container under its root; a
        # glob is much cheaper than spawning `runsc state` on the hot path.
        return self.root.exists() and any(self.root.glob(f"*{sandbox_id}*"))

    def _agent_answers(self, handle: Handle) -> bool:
        try:
            self._client(handle).ping()
            return True
        except agent_client.AgentError:
            return False

    def _runtime_status(self, sandbox_id: str) -> str:
        return self._runtime_state(sandbox_id)[0]

    def _runtime_state(self, sandbox_id: str) -> tuple[str, int]:
        """runsc's status of the sandbox, and the host PID of its process (0 if none)."""
        proc = _run(self._runsc("state", sandbox_id), check=False, timeout=15)
        if proc.returncode != 0:
            return "missing", 0
        try:
            state = json.loads(proc.stdout)
        except ValueError:
            return "missing", 0
        status = str(state.get("status", "missing"))
        pid = state.get("pid")
        pid = pid if isinstance(pid, int) else 0
        # Newer runsc (2024) says "running" for as long as the sandbox's process exists, and one
        # that exited (after a checkpoint, say) is a zombie until the host's init reaps it (a
        # second or more): a restore took it for running. Older runsc says "stopped" at once.
        if status == "running" and _exited(pid):
            return "stopped", pid
        return status, pid

    def state(self, handle: Handle) -> RuntimeState:
        status = self._runtime_status(handle["id"])
        if status == "missing":
            return RuntimeState("missing", "the runtime has no such sandbox")
        if status == "running":
            return RuntimeState("running")
        if status == "paused":
            return RuntimeState("paused")
        return RuntimeState("stopped", self._exit_reason(handle))

    def _exit_reason(self, handle: Handle) -> str:
        if _oom_killed(handle["id"]):
            return f"out of memory: the sandbox exceeded its memory limit of {handle.get('memory_mb', '?')} MB and was killed"
        return "the sandbox's processes exited"

    def list(self) -> list[str]:
        ids: set[str] = set()
        if self.sandboxes_dir.exists():
            ids.update(
                p.name for p in self.sandboxes_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        proc = _run(self._runsc("list", "--format=json"), check=False)
        if proc.returncode == 0 and proc.stdout.strip() not in ("", "null"):
            with contextlib.suppress(ValueError):
                ids.update(c["id"] for c in json.loads(proc.stdout))
        return sorted(ids)

    def stats(self, handle: Handle) -> Stats:
        proc = _run(self._runsc("events", "--stats", handle["id"]), check=False, timeout=15)
        if proc.returncode != 0:
            raise self._not_running(handle)
        try:
            data = json.loads(proc.stdout).get("data", {})
        except ValueError as exc:
            raise LauncherError("runsc events returned no stats") from exc
        cpu = data.get("cpu", {}).get("usage", {}).get("total", 0)
        memory = data.get("memory", {}).get("usage", {})
        disk_used = disk_total = 0
        with contextlib.suppress(OSError):
            disk_used, disk_total = disks.usage(self._dir(handle["id"]) / "disk")
        return Stats(
            cpu_seconds=cpu / 1e9,
            memory_bytes=int(memory.get("usage", 0)),
            memory_limit_bytes=int(handle.get("memory_mb", 0)) * 1024 * 1024,
            pids=int(data.get("pids", {}).get("current", 0)),
            disk_bytes=disk_used,
            disk_limit_bytes=disk_total,
        )

    def _console_tail(self, d: Path) -> str:
        try:
            with open(d / "log" / "console.log", "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 500))
                return log.read(500).decode(errors="replace").strip()
        except OSError:
            return ""

    def _lost(self, handle: Handle) -> LauncherError:
        """Why a live process's connection to the agent ended without an exit report."""
        if self.state(handle).status == "running":
            return LauncherError("the connection to the sandbox's agent was lost")
        return self._not_running(handle)

    def _not_running(self, handle: Handle) -> LauncherError:
        st = self.state(handle)
        if st.status == "missing":
            return SandboxGone(f"sandbox {handle['id']} is not on this node")
        return SandboxNotRunning(f"sandbox {handle['id']} is {st.status}: {st.reason}", reason=st.reason)

    # -- exec and files -------------------------------------------------------------------

    @contextlib.contextmanager
    def _agent_call(self, handle: Handle) -> Iterator[agent_client.AgentClient]:
        try:
            yield self._client(handle)
        except agent_client.AgentFileError as exc:
            raise FileOpError(exc.errno_name, exc.message) from exc
        except agent_client.AgentError as exc:
            raise self._not_running(handle) from exc

    def exec(
        self, handle: Handle, request: ExecRequest, on_output: OutputCallback | None = None
    ) -> ExecResult:
        with self._agent_call(handle) as client:
            r = client.exec(
                request.argv,
                env=request.env or None,
                cwd=request.cwd,
                stdin=request.stdin,
                timeout=request.timeout,
                on_output=on_output,
                max_output=request.max_output,
            )
        return ExecResult(
            exit_code=r.exit_code,
            stdout=r.stdout,
            stderr=r.stderr,
            duration_ms=r.duration_ms,
            timed_out=r.timed_out,
            signal=r.signal,
            truncated=r.truncated,
        )

    def open_process(self, handle: Handle, request: ProcessRequest) -> Process:
        with self._agent_call(handle) as client:
            proc = client.open_process(
                request.argv, env=request.env or None, cwd=request.cwd, tty=request.tty,
                rows=request.rows, cols=request.cols, stdin=request.stdin, timeout=request.timeout,
                detachable=True,
            )  # fmt: skip
        return AgentBackedProcess(proc, lambda: self._lost(handle), Path(handle["dir"]))

    def read_file(self, handle: Handle, path: str) -> tuple[FileEntry, Iterator[bytes]]:
        with self._agent_call(handle) as client:
            st, chunks = client.iter_file(path)
        entry = FileEntry(os.path.basename(path), path, st.type, st.size, st.mode, st.mtime)
        return entry, self._guard_iter(handle, chunks)

    def _guard_iter(self, handle: Handle, chunks: Iterator[bytes]) -> Iterator[bytes]:
        with self._agent_call(handle):
            yield from chunks

    def write_file(self, handle: Handle, path: str, data: bytes | Iterable[bytes], mode: int = 0o644) -> int:
        with self._agent_call(handle) as client:
            return client.write_file(path, data, mode=mode, mkdirs=True)

    def list_files(self, handle: Handle, path: str) -> list[FileEntry]:
        with self._agent_call(handle) as client:
            entries = client.list_dir(path)
        return [FileEntry(e.name, e.path, e.type, e.size, e.mode, e.mtime) for e in entries]


class AgentBackedProcess(Process):
    """A :class:`Process` over one open exec connection to the sandbox's agent."""

    def __init__(
        self, proc: agent_client.AgentProcess, not_running: Callable[[], LauncherError], sandbox_dir: Path
    ) -> None:
        self._proc = proc
        self._not_running = not_running
        self._sandbox_dir = sandbox_dir
        self._closed = False
        self.pid = proc.pid

    def events(self) -> Iterator[tuple[str, bytes | ProcessExit]]:
        while True:
            try:
                for kind, data in self._proc.events():
                    if isinstance(data, agent_client.ExitInfo):
                        yield "exit", ProcessExit(data.code, data.signal, data.timed_out)
                        return
                    yield kind, data
            except agent_client.AgentDetached:
                self._await_restore()  # paused in checkpoint mode: the command lives on
                continue
            except agent_client.AgentError as exc:
                raise self._not_running() from exc
            raise self._not_running()

    def _await_restore(self) -> None:
        """Wait, however long the sandbox stays paused, until its agent listens again, then
        pick the stream up where it was. Ends when the sandbox is deleted or this is closed."""
        waited = 0.0
        while not self._closed:
            if not self._sandbox_dir.exists():
                raise SandboxGone(f"the sandbox was deleted while process {self.pid} was detached")
            try:
                self._proc.reattach()
                return
            except agent_client.AgentFileError as exc:
                raise LauncherError(f"process {self.pid} did not survive the pause: {exc.message}") from exc
            except agent_client.AgentError:
                pass  # not listening yet: still paused, or being restored
            delay = 0.02 if waited < 30 else 0.5
            time.sleep(delay)
            waited += delay
        raise LauncherError(f"process {self.pid} was closed while detached")

    def send_stdin(self, data: bytes) -> None:
        self._proc.send_stdin(data)

    def close_stdin(self) -> None:
        self._proc.close_stdin()

    def resize(self, rows: int, cols: int) -> None:
        self._proc.resize(rows, cols)

    def send_signal(self, sig: int) -> None:
        self._proc.signal(sig)

    def close(self) -> None:
        self._closed = True
        self._proc._shutdown()  # wakes a reader blocked in recv() in another thread
        self._proc.close()


MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def _mount(fstype: str, target: Path, data: str, flags: int = 0) -> None:
    # The syscall directly: a `mount` process per sandbox costs milliseconds on the create path.
    if _libc.mount(fstype.encode(), str(target).encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise LauncherError(f"mounting {fstype} on {target} failed: {os.strerror(err)}")


def _unmount(path: Path) -> None:
    for _ in range(50):
        if not _is_mounted(path):
            return
        # The gofer may hold the mount for a moment after the sandbox dies.
        if _libc.umount2(str(path).encode(), 0) != 0:
            time.sleep(0.05)
    if _is_mounted(path):
        _libc.umount2(str(path).encode(), MNT_DETACH)


def _layers(d: Path) -> Path:
    """Where a sandbox's overlay has its upper/ (its files) and work/ dirs."""
    return d / "disk" / disks.MOUNT if (d / "disk").exists() else d


def _cgroup_roots() -> list[Path]:
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").exists():
        return [base]  # cgroup v2, unified
    return [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()] if base.exists() else []


def _cgroup_dirs(sandbox_id: str) -> list[Path]:
    return [
        r / CGROUP_PARENT / sandbox_id for r in _cgroup_roots() if (r / CGROUP_PARENT / sandbox_id).is_dir()
    ]


def _write_private(path: Path, text: str) -> None:
    """``path`` replaced by ``text``, mode 0600 from the start."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _unlink_socket(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _tree_mb(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) >> 20


def _lift_memory_limit(sandbox_id: str) -> list[tuple[Path, str]]:
    """Remove the memory limit of the sandbox's cgroup; returns what to write back."""
    lifted = []
    for d in _cgroup_dirs(sandbox_id):
        for name, unlimited in (("memory.limit_in_bytes", "-1"), ("memory.max", "max")):
            path = d / name
            with contextlib.suppress(OSError):
                old = path.read_text().strip()
                path.write_text(unlimited)
                lifted.append((path, old))
    return lifted


def _restore_limits(lifted: list[tuple[Path, str]]) -> None:
    for path, old in lifted:
        with contextlib.suppress(OSError):
            path.write_text(old)


def _exited(pid: int) -> bool:
    """Whether host process ``pid`` is gone or a zombie."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        return False


def _discard(path: Path) -> None:
    """Remove the tree at ``path`` in the background: renamed out of the way at once (a hidden
    name beside it, which goes with its directory should this process die first)."""
    trash = path.with_name(f".discard-{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        path.rename(trash)
    except FileNotFoundError:
        return
    threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True}, daemon=True).start()


def _wait_exited(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _exited(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _oom_killed(sandbox_id: str) -> bool:
    for d in _cgroup_dirs(sandbox_id):
        for name in ("memory.oom_control", "memory.events"):
            with contextlib.suppress(OSError):
                for line in (d / name).read_text().splitlines():
                    key, _, value = line.partition(" ")
                    if key == "oom_kill" and int(value or 0) > 0:
                        return True
    return False
