"""The gVisor launcher: one ``runsc`` sandbox per Hangar sandbox, driven through OCI bundles
(see the package's docstring for what it keeps where)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ...host import disks, hostnames
from ...host.hostnames import HostNames
from ...host.locks import file_lock
from ...host.network import Lease, Network
from ..agent.client import AgentClient
from ..agent.launcher import AgentBackedLauncher
from ..agent.networked import NetworkedMixin
from ..agent.protocol import MAX_PAYLOAD, AgentError
from ..agent.transport import UnixTransport
from ..base import (
    Capabilities,
    Handle,
    LauncherError,
    RuntimeState,
    SandboxGone,
    SandboxNotRunning,
    SandboxSpec,
    Stats,
    phase,
)
from . import bundle, cgroups
from .checkpoint import CheckpointMixin, unlink_socket
from .moves import MoveMixin
from .runsc import DEFAULT_PLATFORM, Runsc, default_runsc


class GVisorLauncher(CheckpointMixin, MoveMixin, NetworkedMixin, AgentBackedLauncher):
    name = "gvisor"
    CAPABILITIES = Capabilities(network=True, checkpoint=True, move=True)

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        runsc: str = "",
        platform: str = DEFAULT_PLATFORM,
        agent_cache_dir: str | os.PathLike[str] | None = None,
        extra_flags: tuple[str, ...] = (),
        network_pool: str = "",
        network_exceptions: tuple[str, ...] = (),
        network_nameservers: tuple[str, ...] = (),
        gateway_port: int = 0,
        disk_mb: int = 10240,
        spare_disks: int = 2,
        node_id: str = "",
        ca_certs: str = "",
    ) -> None:
        super().__init__(state_dir=state_dir, agent_cache_dir=agent_cache_dir, ca_certs=ca_certs)
        # Host-global names carry the node's id (the node's own, else one kept in this state dir).
        self.names = HostNames(node_id or hostnames.node_id(self.state_dir))
        self.cgroup_parents = (self.names.cgroup_parent, cgroups.LEGACY_CGROUP_PARENT)
        self.disks = disks.Disks(self.state_dir / "disks", default_mb=disk_mb, spare=spare_disks)
        self.network = Network(self.state_dir, self.names, pool=network_pool, exceptions=network_exceptions,
                               nameservers=network_nameservers, gateway_port=gateway_port)  # fmt: skip
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.runsc = Runsc(runsc or default_runsc(), self.state_dir / "runsc-root", platform, extra_flags)

    @classmethod
    def probe(cls, config: Mapping[str, Any]) -> str | None:
        binary = config.get("runsc") or default_runsc()
        if shutil.which(binary) is None:
            return f"runsc ({binary}) is not installed: scripts/install-runsc.sh installs it"
        return None

    def capabilities(self) -> Capabilities:
        # A command reaches the sandbox's agent as one frame.
        return replace(self.CAPABILITIES, kvm=self.runsc.platform == "kvm", max_command_bytes=MAX_PAYLOAD)

    def _network_available(self) -> bool:
        return self.capabilities().network

    def _may_be_running(self, sandbox_id: str) -> bool:
        return self.runsc.status(sandbox_id) in ("running", "unknown")

    # -- plumbing -------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise LauncherError(f"invalid sandbox id {sandbox_id!r}")
        return self.sandboxes_dir / sandbox_id

    def _socket(self, handle: Handle) -> str:
        return str(handle.get("socket") or self._dir(handle["id"]) / "run" / "agent.sock")

    def agent(self, handle: Handle) -> AgentClient:
        return AgentClient(UnixTransport(self._socket(handle)))

    def handle_for(self, sandbox_id: str) -> Handle:
        d = self._dir(sandbox_id)
        try:
            return json.loads((d / "handle.json").read_text())
        except (OSError, ValueError):
            return {
                "id": sandbox_id,
                "runtime": self.name,
                "dir": str(d),
                "socket": str(d / "run" / "agent.sock"),
            }

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

    # -- lifecycle ------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        if not (spec.rootfs / "bin").exists() and not (spec.rootfs / "usr").exists():
            raise LauncherError(f"image root filesystem {spec.rootfs} is missing or empty")
        policy = self._policy(spec.network)
        with file_lock(self.sandboxes_dir / f".{spec.id}.lock"):
            handle = self._new_handle(spec)
            if (d / "handle.json").exists() and self._agent_answers(handle):
                # A duplicated or retried task: the sandbox is already up.
                return handle
            self._adopt_locked(spec.id)  # moved here (paused), and its worker died before adopting it
            with phase("disk"):
                bundle.mount_dirs(d, spec, self.disks)
            # A checkpoint this sandbox was paused with is of no use once it starts afresh.
            for saved in ("checkpoint", "checkpoint.partial"):
                shutil.rmtree(d / saved, ignore_errors=True)
            lease: Lease | None = None
            names: dict[str, list[str]] = {}
            if policy.enabled or spec.network:
                try:
                    with phase("network"):
                        lease, names = self.network.setup(spec.id, policy)
                except LauncherError:
                    self._destroy_locked(spec.id)
                    raise
            # The bundle holds the environment, secrets included: readable by root only.
            config = bundle.oci_spec(spec, d, agent_binary=self.agent_binary, cgroup_parent=self.names.cgroup_parent,
                                     ca=self.sandbox_ca, lease=lease)  # fmt: skip
            bundle.write_private(d / "bundle" / "config.json", json.dumps(config))
            (d / "handle.json").write_text(json.dumps(handle))
            if self.runsc.has_state(spec.id):
                # A leftover container from a crashed earlier attempt would make `run` fail.
                self.runsc.delete(spec.id)
            # Its path appearing is what says the new agent listens (see below): not an old one's.
            unlink_socket(handle["socket"])
            with phase("runtime"):
                try:
                    self.runsc.start(d / "log" / "console.log", "run", "--detach", "--bundle", str(d / "bundle"),
                                     spec.id, network=lease is not None)  # fmt: skip
                except LauncherError as exc:
                    self._destroy_locked(spec.id)
                    raise LauncherError(f"runsc could not start the sandbox: {exc}") from exc
                try:
                    # Listening is enough: the agent forks its first handlers while the caller
                    # records the sandbox as running, instead of before (a ping waited ~4 ms for it).
                    self.agent(handle).wait_listening(15.0)
                except AgentError as exc:
                    tail = self._console_tail(d)
                    self._destroy_locked(spec.id)
                    raise LauncherError(f"sandbox agent did not come up: {exc}; console: {tail}") from exc
            self.install_ca(handle)
            if lease is not None:
                self._write_resolution(spec.id, policy, names)
            self.disks.refill_soon()  # the spare disk it may have taken
            return handle

    def prepare(self) -> None:
        self.disks.prepare()  # the default size's template and spares: the first create need not wait

    def release_spares(self) -> None:
        self.disks.drain()  # the spare disks' loop mounts

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
        if delete and self.runsc.has_state(sandbox_id):
            self.runsc.delete(sandbox_id)
        if unmount:
            bundle.unmount_dirs(d)
        cgroups.remove(self.cgroup_parents, sandbox_id)
        (d / "handle.json").unlink(missing_ok=True)
        (d / "quiesced").unlink(missing_ok=True)
        if self.network.lease_of(sandbox_id) is not None:
            self.network.teardown(sandbox_id, release=not keep_lease)

    def suspend(self, handle: Handle, keep_files: bool = True) -> None:
        # What create() makes again from the spec goes (the runsc container, the mounts, the
        # cgroup); its disk, which holds every file the sandbox wrote, stays, and stays
        # mounted: unmounting would wait for the writeback of everything it wrote (seconds,
        # for a sandbox that wrote gigabytes), and a mounted disk costs the node next to nothing.
        sandbox_id = handle["id"]
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            d = self._dir(sandbox_id)
            if self.runsc.has_state(sandbox_id):
                self.runsc.kill(sandbox_id, "TERM")  # the agent's clean exit
                deadline = time.monotonic() + 2.0
                while time.monotonic() < deadline and self.runsc.status(sandbox_id) == "running":
                    time.sleep(0.05)
            self._release(sandbox_id)
            for saved in ("checkpoint", "checkpoint.partial"):  # a checkpoint that did not hold
                shutil.rmtree(d / saved, ignore_errors=True)
            if not keep_files:
                disks.remove(d / "disk")
                for sub in ("upper", "work"):  # a sandbox with no disk of its own
                    shutil.rmtree(d / sub, ignore_errors=True)

    def destroy(self, handle: Handle) -> None:
        sandbox_id = handle["id"]
        with file_lock(self.sandboxes_dir / f".{sandbox_id}.lock"):
            self._destroy_locked(sandbox_id)
        with contextlib.suppress(OSError):
            (self.sandboxes_dir / f".{sandbox_id}.lock").unlink()

    def _destroy_locked(self, sandbox_id: str) -> None:
        self._release(sandbox_id)  # delete --force kills whatever still runs first
        for disk in ("disk", ".disk.making"):  # mounted: rmtree would empty it, then fail
            disks.remove(self._dir(sandbox_id) / disk)
        shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)

    # -- inspection -----------------------------------------------------------------------

    def _agent_answers(self, handle: Handle) -> bool:
        try:
            self.agent(handle).ping()
            return True
        except AgentError:
            return False

    def state(self, handle: Handle) -> RuntimeState:
        """What runsc reports for this sandbox right now."""
        status = self.runsc.status(handle["id"])
        if status == "missing":
            return RuntimeState("missing", "the runtime has no such sandbox")
        if status == "running":
            return RuntimeState("running")
        if status == "paused":
            return RuntimeState("paused")
        if status == "unknown":
            return RuntimeState("unknown", "runsc could not tell this sandbox's state (see the node's log)")
        return RuntimeState("stopped", self._exit_reason(handle))

    def _exit_reason(self, handle: Handle) -> str:
        if cgroups.oom_killed(self.cgroup_parents, handle["id"]):
            return f"out of memory: the sandbox exceeded its memory limit of {handle.get('memory_mb', '?')} MB and was killed"
        return "the sandbox's processes exited"

    def states(self) -> dict[str, RuntimeState]:
        ids: set[str] = set()
        if self.sandboxes_dir.exists():
            ids.update(
                p.name for p in self.sandboxes_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
            )
        ids.update(self.runsc.ids())
        return {sandbox_id: self.state(self.handle_for(sandbox_id)) for sandbox_id in sorted(ids)}

    def stats(self, handle: Handle) -> Stats:
        proc = self.runsc("events", "--stats", handle["id"], timeout=15)
        if proc.returncode != 0:
            raise self._unreachable(handle)
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

    def console_tail(self, handle: Handle) -> str:
        """The last of what runsc and the agent wrote to the sandbox's console (at most 500 bytes)."""
        return self._console_tail(self._dir(handle["id"]))

    def _console_tail(self, d: Path) -> str:
        try:
            with open(d / "log" / "console.log", "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 500))
                return log.read(500).decode(errors="replace").strip()
        except OSError:
            return ""

    def _exists(self, handle: Handle) -> bool:
        return self._dir(handle["id"]).exists()

    def _lost(self, handle: Handle) -> LauncherError:
        if self.state(handle).status == "running":
            return LauncherError("the connection to the sandbox's agent was lost")
        return self._unreachable(handle)

    def _unreachable(self, handle: Handle, exc: Exception | None = None) -> LauncherError:
        st = self.state(handle)
        if st.status == "missing":
            return SandboxGone(f"sandbox {handle['id']} is not on this node")
        if st.status == "unknown":
            return LauncherError(f"sandbox {handle['id']}: {st.reason}")
        if st.status != "running":
            return SandboxNotRunning(f"sandbox {handle['id']} is {st.status}: {st.reason}", reason=st.reason)
        broken = _socket_tampered(self._socket(handle))
        if broken:
            # The sandbox did it from inside (its socket's directory is writable there): without
            # its agent it can be neither used nor trusted, so it fails, saying why.
            return SandboxNotRunning(f"sandbox {handle['id']}: {broken}", reason=broken)
        return LauncherError(f"the sandbox's agent did not answer: {exc or 'no reason given'}")


def _socket_tampered(path: str) -> str:
    """What the sandbox did to its agent's socket, if anything ("" when it is a socket)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "the sandbox removed its agent's socket (/.hangar/run/agent.sock), so Hangar cannot reach it"
    except OSError as exc:
        return f"the sandbox's agent socket cannot be examined: {exc.strerror}"
    if stat.S_ISLNK(mode):
        return "the sandbox replaced its agent's socket with a symlink; Hangar does not follow it"
    if not stat.S_ISSOCK(mode):
        return "the sandbox replaced its agent's socket with something that is not a socket"
    return ""
