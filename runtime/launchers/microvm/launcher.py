"""The microVM launcher: one QEMU ``microvm`` machine per Hangar sandbox (see the package's
docstring for what it keeps where)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ...host import hostnames, volumes
from ...host.locks import file_lock
from ...host.network import TAP, Lease, Network
from ..agent.client import AgentClient
from ..agent.launcher import AgentBackedLauncher
from ..agent.networked import NetworkedMixin
from ..agent.protocol import MAX_PAYLOAD, AgentError
from ..agent.transport import UnixTransport
from ..base import (
    Capabilities,
    ExecRequest,
    Handle,
    LauncherError,
    RuntimeState,
    SandboxGone,
    SandboxNotRunning,
    SandboxSpec,
    Stats,
    phase,
)
from . import boot, cgroups, snapshots

log = logging.getLogger(__name__)

BOOT_TIMEOUT = 60.0  # under TCG on a busy node a boot takes seconds; with KVM well under one
# Under TCG one boot in thirty-odd never reached /init here until the TSC's frequency was given
# (boot.tcg_args): a boot not up by then is still killed and tried once more.
FIRST_BOOT_TIMEOUT = {"tcg": 20.0, "kvm": 10.0}
OOM_MARK = b"Out of memory"
# QEMU's memory beyond the guest's RAM (its memory cgroup's allowance): its own, and under TCG its
# translated-code buffer, whose size it is told (the default would be 1 GiB).
QEMU_OVERHEAD_MB = 96
TCG_TB_MB = 128
# Saving a VM writes about the RAM its guest has touched: seconds, even on a busy node.
CHECKPOINT_TIMEOUT = 120.0
# Volumes a VM attaches (each a virtio-mmio transport; microvm has 24, four are the VM's own).
MAX_VOLUMES = 16
# The guest kernel's console file is cut back to its last CONSOLE_KEEP bytes once it passes
# CONSOLE_MAX (at each stats call, every heartbeat): root in a guest can write to its serial
# port without end, and the node's disk must not pay for it.
CONSOLE_MAX = 1 << 20
CONSOLE_KEEP = 64 << 10


def _pid_alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` runs and its command line names ``marker`` (a reused pid does not)."""
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state != b"Z" and marker.encode() in cmdline


def _reap(pid: int, timeout: float = 0.0) -> None:
    """Collect ``pid``'s exit where this process started it (no zombie left), waiting up to
    ``timeout`` for a killed process to finish exiting; another's child returns at once."""
    if pid <= 0:
        return  # waitpid(0) would take any child of this process's group
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:
            return
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)


def _guest_cid() -> int:
    """A VM's vsock address, unique on the host while it runs: drawn at random from 2**31 (CIDs
    0-2 are reserved), so two VMs of this or another Hangar on the host meet with odds of about
    one in a billion per pair; QEMU refuses a CID in use, and the start fails saying so."""
    return secrets.randbelow(2**31 - 3) + 3


def _mac(sandbox_id: str) -> str:
    """The guest's MAC address: locally administered, unicast, from the sandbox's id."""
    digest = hashlib.sha1(sandbox_id.encode()).digest()
    return "02:" + ":".join(f"{b:02x}" for b in digest[:5])


def _kill(pid: int, marker: str, timeout: float = 5.0) -> None:
    if not _pid_alive(pid, marker):
        _reap(pid, 1.0)  # our child, exiting on its own (its cmdline empties first): collected
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while _pid_alive(pid, marker) and time.monotonic() < deadline:
        time.sleep(0.01)
    # Its command line empties while it is still exiting: wait for the exit itself.
    _reap(pid, max(0.0, deadline - time.monotonic()))


def trim_console(path: Path, most: int, keep: int) -> bool:
    """Cut the console file back to its last ``keep`` bytes once it is over ``most``; whether it
    was. QEMU appends (``append=on``): what it writes meanwhile lands after the kept tail (a
    line may be cut in two at the seam)."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if size <= most:
                return False
            f.seek(size - keep)
            tail = f.read(keep)
            f.truncate(0)
        with open(path, "ab") as f:
            f.write(b"[hangar: the console's first %d bytes were dropped]\n" % (size - keep) + tail)
        return True
    except OSError:
        return False


class MicroVMLauncher(NetworkedMixin, AgentBackedLauncher):
    name = "microvm"

    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        agent_cache_dir: str | os.PathLike[str] | None = None,
        kernel_dir: str = "",
        accel: str = "auto",
        qemu: str = "",
        disk_mb: int = 10240,
        ca_certs: str = "",
        node_id: str = "",
        network_pool: str = "",
        network_exceptions: tuple[str, ...] = (),
        network_nameservers: tuple[str, ...] = (),
        gateway_port: int = 0,
        spare_disks: int = 0,
        memory_overhead_mb: int = 0,
        transport: str = "auto",
    ) -> None:
        super().__init__(state_dir=state_dir, agent_cache_dir=agent_cache_dir, ca_certs=ca_certs)
        if accel not in ("auto", "kvm", "tcg"):
            raise LauncherError(f"microvm accel must be auto, kvm or tcg, not {accel!r}")
        if transport not in ("auto", "serial", "vsock"):
            raise LauncherError(f"microvm transport must be auto, serial or vsock, not {transport!r}")
        self.transport_setting = transport
        self._link: str | None = None
        self.kernel_dir = kernel_dir
        self.accel_setting = accel
        self.qemu = qemu or boot.QEMU
        self.default_disk_mb = disk_mb or 10240
        if memory_overhead_mb < 0:
            raise LauncherError(
                f"microvm memory_overhead_mb must be 0 (the default) or more, not {memory_overhead_mb}"
            )
        self.memory_overhead_mb = memory_overhead_mb
        self.sandboxes_dir = self.state_dir / "sandboxes"
        self.boot_dir = self.state_dir / "boot"
        # Host-global names carry the node's id (the node's own, else one kept in this state dir).
        self.names = hostnames.HostNames(node_id or hostnames.node_id(self.state_dir))
        self.cgroup_parent = self.names.cgroup_parent
        # The gVisor launcher's host side (namespace, veth, rules), with names of its own: see
        # runtime/host/network.py. Its pool is its own too (this launcher's state dir claims it).
        self.network = Network(self.state_dir, self.names, pool=network_pool, exceptions=network_exceptions,
                               nameservers=network_nameservers, gateway_port=gateway_port, kind="vm")  # fmt: skip
        self._accel: str | None = None
        self._network_ok: bool | None = None

    @classmethod
    def probe(cls, config: Mapping[str, Any]) -> str | None:
        return boot.missing(str(config.get("kernel_dir") or ""), str(config.get("qemu") or ""))

    def accel(self) -> str:
        """``kvm`` where the node's KVM runs the guest kernel (a short boot tells, once), else ``tcg``."""
        if self._accel is None:
            if self.accel_setting != "auto":
                self._accel = self.accel_setting
            else:
                kern = boot.kernel(self.kernel_dir)
                initrd = boot.initramfs(self.boot_dir, kern, self.agent_binary)
                self._accel = "kvm" if boot.kvm_works(self.boot_dir, kern, initrd) else "tcg"
        return self._accel

    def link(self) -> str:
        """How the node reaches a VM's agent: ``vsock`` where the node has a usable
        /dev/vhost-vsock (``transport: auto``, the default, or ``vsock``), else the
        ``serial`` port (virtio-serial, which every QEMU has). Asked once."""
        if self._link is None:
            why = "the node's config says serial" if self.transport_setting == "serial" else (
                boot.vsock_missing(boot.kernel(self.kernel_dir)))  # fmt: skip
            if why is not None and self.transport_setting == "vsock":
                raise LauncherError(f"microvm transport vsock: {why}")
            self._link = "serial" if why is not None else "vsock"
        return self._link

    def capabilities(self) -> Capabilities:
        return Capabilities(network=self._network_available(), checkpoint=True, kvm=self.accel() == "kvm",
                            max_command_bytes=MAX_PAYLOAD, vm=True)  # fmt: skip

    def _network_available(self) -> bool:
        """nftables, ``ip`` and a tun device on the node, and an address pool of its own (asked
        once: a pool another node holds leaves this launcher's sandboxes without networks)."""
        if self._network_ok is None:
            reason = next((f"{tool} is not installed" for tool in ("nft", "ip", "nsenter") if not shutil.which(tool)),
                          None if os.path.exists("/dev/net/tun") else "the node has no /dev/net/tun")  # fmt: skip
            if reason is None:
                try:
                    self.network.pool  # noqa: B018  (chosen and claimed here)
                except LauncherError as exc:
                    reason = str(exc)
            if reason:
                log.warning("microVM sandboxes get no network on this node: %s", reason)
            self._network_ok = reason is None
        return self._network_ok

    def _may_be_running(self, sandbox_id: str) -> bool:
        return self._running(self.handle_for(sandbox_id))

    # -- plumbing -------------------------------------------------------------------------

    def _dir(self, sandbox_id: str) -> Path:
        if not sandbox_id or "/" in sandbox_id or sandbox_id.startswith("."):
            raise LauncherError(f"invalid sandbox id {sandbox_id!r}")
        return self.sandboxes_dir / sandbox_id

    def agent(self, handle: Handle) -> AgentClient:
        return AgentClient(UnixTransport(self._dir(handle["id"]) / "agent.sock"))

    def handle_for(self, sandbox_id: str) -> Handle:
        d = self._dir(sandbox_id)
        try:
            return json.loads((d / "handle.json").read_text())
        except (OSError, ValueError):
            return {"id": sandbox_id, "runtime": self.name, "dir": str(d)}

    def _lock(self, sandbox_id: str) -> Any:
        return file_lock(self.sandboxes_dir / f".{sandbox_id}.lock")

    # -- lifecycle ------------------------------------------------------------------------

    def create(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        if not (spec.rootfs / "bin").exists() and not (spec.rootfs / "usr").exists():
            raise LauncherError(f"image root filesystem {spec.rootfs} is missing or empty")
        policy = self._policy(spec.network)
        self._check_mounts(spec)
        with self._lock(spec.id):
            old = self.handle_for(spec.id)
            if "qemu_pid" in old and self._running(old) and self._agent_answers(old):
                return old  # a duplicated or retried task: the VM is up
            self._stop_processes(old)
            with phase("disk"):  # the kernel, initramfs and image's root disk are built once each
                kern = boot.kernel(self.kernel_dir)
                initrd = boot.initramfs(self.boot_dir, kern, self.agent_binary)
                root = boot.root_disk(self.boot_dir, spec.rootfs)
                d.mkdir(parents=True, exist_ok=True)
                os.chmod(d, 0o700)
                snapshots.discard(d)  # a checkpoint it was paused with is of no use once it starts afresh
                disk = d / "disk.img"
                size_mb = spec.disk_mb if spec.disk_mb else self.default_disk_mb
                if not disk.exists():  # kept from a suspend: the sandbox's files
                    boot.sandbox_disk(disk, size_mb)
            lease: Lease | None = None
            names: dict[str, list[str]] = {}
            try:
                if policy.enabled or spec.network:
                    with phase("network"):
                        lease, names = self.network.setup(spec.id, policy, tap=True)
                self._write_config(d, spec, lease)
                accel = self.accel()
                handle: Handle = {"id": spec.id, "runtime": self.name, "dir": str(d), "memory_mb": spec.memory_mb,
                                  "cpu": spec.cpu, "vcpus": max(1, math.ceil(spec.cpu)), "accel": accel,
                                  "disks": [m.disk for m in spec.mounts], "link": self.link()}  # fmt: skip
                if handle["link"] == "vsock":
                    handle["cid"] = _guest_cid()
                argv = self._qemu_argv(spec, handle, kern, initrd, root, disk, lease)
                with phase("runtime"):
                    for attempt, limit in enumerate((FIRST_BOOT_TIMEOUT[accel], BOOT_TIMEOUT)):
                        if attempt:  # the guest takes its clock from the configuration: this moment's
                            self._write_config(d, spec, lease)
                        qemu = self._start(d, handle, argv)
                        try:
                            self._hold_volumes(handle, qemu.pid)
                        except LauncherError:
                            self._stop_processes(handle)
                            raise
                        try:
                            self._wait_up(handle, qemu, limit)
                            break
                        except LauncherError as exc:
                            self._stop_processes(handle)
                            if attempt or "exited while booting" in str(exc):
                                raise
                            log.warning(
                                "microVM %s did not boot within %.0fs; trying once more", spec.id, limit
                            )
            except BaseException:
                self._release_network(spec.id)
                self._let_go_of_volumes(spec.id, [m.disk for m in spec.mounts])
                raise
            self.install_ca(handle)
            if lease is not None:
                self._write_resolution(spec.id, policy, names)
            return handle

    def _check_mounts(self, spec: SandboxSpec) -> None:
        if len(spec.mounts) > MAX_VOLUMES:
            raise LauncherError(f"a {self.name} sandbox attaches at most {MAX_VOLUMES} volumes")
        for m in spec.mounts:
            if not m.disk:
                raise LauncherError(
                    f"the {self.name} runtime attaches volumes as disks: {m.destination} has none"
                )
            if not m.destination.startswith("/") or "\0" in m.destination:
                raise LauncherError(f"invalid volume path {m.destination!r}")

    def _hold_volumes(self, handle: Handle, pid: int) -> None:
        """QEMU (``pid``) holds its volumes' images: the host mounts them not, no other VM attaches them."""
        for image in handle.get("disks") or []:
            try:
                volumes.hold(Path(image), handle["id"], pid)
            except volumes.VolumeError as exc:
                raise LauncherError(str(exc)) from None

    @staticmethod
    def _let_go_of_volumes(sandbox_id: str, disks: list[str]) -> None:
        for image in disks:
            volumes.let_go(Path(image), sandbox_id)

    def _start(
        self, d: Path, handle: Handle, argv: list[str], extra: tuple[str, ...] = ()
    ) -> subprocess.Popen[bytes]:
        """QEMU (``argv``, and ``extra`` arguments for this start only) and the node's end of the
        mux, each in a session of its own; the handle persisted, with ``argv`` (a checkpoint's
        restore starts QEMU the same way)."""
        for name in ("vm.sock", "agent.sock", "qmp.sock", "console.log"):
            (d / name).unlink(missing_ok=True)
        handle["argv"] = argv
        try:
            with open(d / "qemu.log", "wb") as qemu_log:
                qemu = subprocess.Popen([*argv, *extra], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=qemu_log, start_new_session=True, cwd=d)  # fmt: skip
        except OSError as exc:
            raise LauncherError(f"cannot start QEMU ({self.qemu}): {exc}") from exc
        handle["qemu_pid"] = qemu.pid
        # The fraction of a CPU: its vCPUs (rounded up) together get no more than it asked for.
        cgroups.limit_cpu(self.cgroup_parent, handle["id"], qemu.pid, float(handle["cpu"]))
        # The guest is bounded by its RAM; QEMU's own memory beyond it by its allowance.
        overhead = self.overhead_mb(handle["accel"])
        limit = (int(handle["memory_mb"]) + overhead) * 1024 * 1024
        if cgroups.limit_memory(self.cgroup_parent, handle["id"], qemu.pid, limit) is not None:
            handle["qemu_memory_limit_mb"] = int(handle["memory_mb"]) + overhead
        link = ["--vsock", f"{handle['cid']}:{boot.VSOCK_PORT}"] if handle.get("link") == "vsock" else [
            "--vm", str(d / "vm.sock")]  # fmt: skip
        mux_argv = [str(boot.mux_binary(self.boot_dir)), "host", *link,
                    "--listen", str(d / "agent.sock"), "--config", str(d / "config")]  # fmt: skip
        with open(d / "mux.log", "wb") as mux_log:
            mux = subprocess.Popen(mux_argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=mux_log, start_new_session=True)  # fmt: skip
        handle["mux_pid"] = mux.pid
        (d / "handle.json").write_text(json.dumps(handle))
        return qemu

    def overhead_mb(self, accel: str) -> int:
        """What QEMU may use beyond the guest's RAM: its own code and device buffers, and under
        TCG the translated guest code (its buffer bounded by ``tb-size``, :data:`TCG_TB_MB`)."""
        if self.memory_overhead_mb:
            return self.memory_overhead_mb
        return QEMU_OVERHEAD_MB + (TCG_TB_MB if accel == "tcg" else 0)

    def _write_config(self, d: Path, spec: SandboxSpec, lease: Lease | None = None) -> None:
        now = time.time_ns()  # the guest's clock (a restored VM's would be the moment it was saved)
        fields = [
            f"hostname={spec.hostname}",
            f"cwd={spec.working_dir or '/'}",
            f"time={now // 10**9}.{now % 10**9:09d}",
        ]
        if lease is not None:  # the guest's eth0: its address and prefix, and its gateway
            fields.append(f"net={lease.sandbox_ip}/{lease.prefix},{lease.host_ip}")
        env = dict(spec.env)
        ca = self.sandbox_ca
        if ca is not None:  # its bundle in the VM, read-only, and the variables naming it
            fields.append("ca=" + ca.path.read_text())
            env = {**ca.env(), **env}
        fields += [f"env={k}={v}" for k, v in env.items() if "\0" not in k + v]
        # Each volume: the disk's serial (_qemu_argv), how, and where it goes.
        fields += [f"vol=hangar-vol{i},{'ro' if m.read_only else 'rw'},{m.destination}"
                   for i, m in enumerate(spec.mounts)]  # fmt: skip
        path = d / "config"
        # The environment holds the sandbox's secrets: root's alone, never in QEMU's command line.
        fd = os.open(path.with_name(".config.tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(b"".join(x.encode("utf-8", "surrogatepass") + b"\0" for x in fields))
        os.replace(path.with_name(".config.tmp"), path)

    def _qemu_argv(self, spec: SandboxSpec, handle: Handle, kern: boot.Kernel, initrd: Path, root: Path,
                   disk: Path, lease: Lease | None = None) -> list[str]:  # fmt: skip
        accel = handle["accel"]
        append = boot.KERNEL_ARGS + ("" if accel == "kvm" else " " + boot.tcg_args())
        d = Path(handle["dir"])
        if handle.get("link") == "vsock":  # the agent's link: vsock, or a virtio-serial port
            append += f" hangar.link=vsock:{boot.VSOCK_PORT}"
            link = ["-device", f"vhost-vsock-device,guest-cid={handle['cid']}"]
        else:
            link = ["-device", "virtio-serial-device",
                    "-chardev", f"socket,id=agent,path={d / 'vm.sock'},server=on,wait=off",
                    "-device", "virtserialport,chardev=agent,name=hangar"]  # fmt: skip
        net: list[str] = []
        if lease is not None:
            # QEMU in the sandbox's namespace (nsenter execs it: the pid stays QEMU's), on the tap
            # bridged there to the veth; no vhost (plain tap works wherever /dev/net/tun does).
            net = ["-netdev", f"tap,id=net0,ifname={TAP},script=no,downscript=no",
                   "-device", f"virtio-net-device,netdev=net0,mac={_mac(spec.id)}"]  # fmt: skip
        prefix = ["nsenter", f"--net={lease.netns_path}"] if lease is not None else []
        # Volumes: each image a disk of its own, named by a serial the guest's /init looks for.
        volumes_argv: list[str] = []
        for i, m in enumerate(spec.mounts):
            how = ",readonly=on" if m.read_only else ""
            volumes_argv += ["-drive", f"id=vol{i},file={m.disk},format=raw,if=none,discard=unmap{how}",
                             "-device", f"virtio-blk-device,drive=vol{i},serial=hangar-vol{i}"]  # fmt: skip
        return prefix + [
            self.qemu, "-name", f"hangar-{spec.id}", "-M", "microvm,x-option-roms=off",
            "-accel", accel if accel == "kvm" else f"tcg,tb-size={TCG_TB_MB}", "-cpu", "host" if accel == "kvm" else "max",
            "-m", str(spec.memory_mb), "-smp", str(handle["vcpus"]),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            # Appended to (so a cut-back file is written at its new end, not at QEMU's old offset).
            "-chardev", f"file,id=console,path={d / 'console.log'},append=on", "-serial", "chardev:console",
            "-kernel", str(kern.vmlinuz), "-initrd", str(initrd), "-append", append,
            "-drive", f"id=root,file={root},format=raw,if=none,readonly=on",
            "-device", "virtio-blk-device,drive=root,serial=hangar-root",
            "-drive", f"id=disk,file={disk},format=raw,if=none,discard=unmap",
            "-device", "virtio-blk-device,drive=disk,serial=hangar-disk",
            *volumes_argv,
            *link,
            "-qmp", f"unix:{d / 'qmp.sock'},server=on,wait=off",
            *net,
        ]  # fmt: skip

    def _wait_up(self, handle: Handle, qemu: subprocess.Popen[bytes], limit: float) -> None:
        client = self.agent(handle)
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if qemu.poll() is not None:
                raise LauncherError(f"the microVM exited while booting (QEMU status {qemu.returncode}): "
                                    f"{self._qemu_oom(handle) or self._console_tail(handle)}")  # fmt: skip
            try:
                client.wait_listening(0.2)
                return
            except AgentError:
                continue
        raise LauncherError(f"the microVM's agent did not come up within {limit:.0f}s: "
                            f"{self._console_tail(handle)}")  # fmt: skip

    def _running(self, handle: Handle) -> bool:
        return _pid_alive(int(handle.get("qemu_pid", 0)), f"hangar-{handle['id']}")

    def _stop_processes(self, handle: Handle, graceful: bool = False) -> None:
        """QEMU and the mux gone (with ``graceful``, the guest first ends its processes and
        writes what it holds to its disk)."""
        sandbox_id = handle["id"]
        mux_pid = int(handle.get("mux_pid", 0))
        if graceful and self._running(handle) and _pid_alive(mux_pid, sandbox_id):
            with contextlib.suppress(ProcessLookupError):
                os.kill(mux_pid, signal.SIGUSR1)  # the guest syncs, says bye, and the mux exits
            deadline = time.monotonic() + 5.0
            while _pid_alive(mux_pid, sandbox_id) and time.monotonic() < deadline:
                time.sleep(0.02)
        _kill(int(handle.get("qemu_pid", 0)), f"hangar-{sandbox_id}")
        _kill(mux_pid, sandbox_id)
        cgroups.remove(self.cgroup_parent, sandbox_id)
        d = self._dir(sandbox_id)
        for name in ("handle.json", "agent.sock", "vm.sock"):
            (d / name).unlink(missing_ok=True)

    def _release_network(self, sandbox_id: str) -> None:
        """Its namespace (the tap and bridge with it), veth, rules and addresses: a paused
        sandbox holds none, and its next start makes them afresh."""
        if self.network.lease_of(sandbox_id) is not None:
            self.network.teardown(sandbox_id)

    def prune_images(self, kept: set[Path]) -> list[str]:
        """Root disks (one per image, in ``<state_dir>/boot``) of images this node no longer has,
        that no VM here uses, running or saved; one built before its source was recorded goes
        once unused for a day (a later VM of its image builds it again)."""
        in_use: set[str] = set()
        if self.sandboxes_dir.exists():
            for d in self.sandboxes_dir.iterdir():
                for name in ("handle.json", snapshots.META):
                    with contextlib.suppress(OSError, ValueError, TypeError):
                        in_use.update(
                            a for a in json.loads((d / name).read_text()).get("argv", []) if "file=" in a
                        )
        kept_sources = {str(p.resolve()) for p in kept}
        removed = []
        for disk, source in boot.root_disks(self.boot_dir).items():
            if any(f"file={disk}," in a for a in in_use):
                continue
            if source in kept_sources or (source is None and time.time() - disk.stat().st_mtime < 86400):
                continue
            with file_lock(self.boot_dir / f".{disk.stem}.lock"):  # boot.root_disk's while it builds
                disk.unlink(missing_ok=True)
                disk.with_suffix(".source").unlink(missing_ok=True)
            removed.append(disk.name)
        return removed

    # -- checkpoint and restore (see snapshots.py) ---------------------------------------------

    def checkpoint(self, handle: Handle) -> None:
        sandbox_id = handle["id"]
        with self._lock(sandbox_id):
            handle = self.handle_for(sandbox_id) | handle
            d = self._dir(sandbox_id)
            saved = d / snapshots.IMAGE
            if not self._running(handle):
                if saved.exists() and (d / snapshots.META).exists():  # a repeated call: finish releasing
                    self._stop_processes(handle)
                    self._release_network(sandbox_id)
                    return
                raise SandboxNotRunning(f"sandbox {sandbox_id} is not running: there is nothing to checkpoint",
                                        reason=self.state(handle).reason)  # fmt: skip
            disks = handle.get("disks") or []
            try:
                # The agent lets go of its connections (the mux's streams, which a restore starts
                # afresh): detachable commands run on, detached, and are picked up after it.
                self.agent(handle).quiesce()
                started = time.monotonic()
                snapshots.save(d / "qmp.sock", saved, timeout=CHECKPOINT_TIMEOUT)
                (d / snapshots.META).write_text(json.dumps({
                    "argv": handle["argv"], "network": self.network.lease_of(sandbox_id) is not None,
                    "disks": disks, "memory_mb": handle["memory_mb"], "cpu": handle["cpu"],
                    "vcpus": handle["vcpus"], "accel": handle["accel"]}))  # fmt: skip
                for image in disks:  # held by the checkpoint now, not by QEMU
                    volumes.hold_for_checkpoint(Path(image), sandbox_id, saved)
            except (LauncherError, AgentError, volumes.VolumeError, OSError) as exc:
                # As runsc does: a checkpoint that failed leaves the sandbox stopped, its files kept.
                self._stop_processes(handle, graceful=True)
                self._let_go_of_volumes(sandbox_id, disks)
                self._release_network(sandbox_id)
                snapshots.discard(d)
                raise LauncherError(f"the microVM could not be saved: {exc}") from None
            self._stop_processes(handle)  # QEMU (stopped, its state saved) and the mux
            self._release_network(sandbox_id)
            log.info("microVM %s saved in %.2f s (%.0f MB)", sandbox_id, time.monotonic() - started,
                     saved.stat().st_size / 1e6)  # fmt: skip

    def restore(self, spec: SandboxSpec) -> Handle:
        d = self._dir(spec.id)
        policy = self._policy(spec.network)
        self._check_mounts(spec)
        with self._lock(spec.id):
            saved = d / snapshots.IMAGE
            try:
                record = json.loads((d / snapshots.META).read_text())
            except (OSError, ValueError):
                record = None
            if record is None or not saved.exists():
                raise LauncherError(f"sandbox {spec.id} has no checkpoint to restore")
            disks = [m.disk for m in spec.mounts]
            networked = bool(policy.enabled or spec.network)
            why = ("its network changed while it was paused" if networked != record.get("network") else
                   "its volumes changed while it was paused" if disks != record.get("disks") else
                   "its memory or CPUs changed while it was paused"
                   if (spec.memory_mb, max(1, math.ceil(spec.cpu))) != (record.get("memory_mb"), record.get("vcpus"))
                   else "")  # fmt: skip
            if why:
                snapshots.discard(d)
                raise LauncherError(f"the checkpoint of {spec.id} cannot be restored: {why}")
            handle: Handle = {"id": spec.id, "runtime": self.name, "dir": str(d), "memory_mb": spec.memory_mb,
                              "cpu": spec.cpu, "vcpus": record["vcpus"], "accel": record["accel"], "disks": disks}  # fmt: skip
            argv = list(record["argv"])
            if any(a.startswith("vhost-vsock-device,") for a in argv):
                # A CID of its own now (the one it was saved with may be another VM's by now): the
                # guest's kernel takes it from the device as it resumes, and its /init the next host.
                handle["link"], handle["cid"] = "vsock", _guest_cid()
                argv = [re.sub(r"guest-cid=\d+", f"guest-cid={handle['cid']}", a) for a in argv]
            lease: Lease | None = None
            names: dict[str, list[str]] = {}
            try:
                if networked:
                    lease, names = self.network.setup(spec.id, policy, tap=True)
                # The guest takes the clock and this network's addresses from it (hangar-mux).
                self._write_config(d, spec, lease)
                qemu = self._start(d, handle, argv, tuple(snapshots.incoming(saved)))
                self._hold_volumes(handle, qemu.pid)
                snapshots.resume(d / "qmp.sock", lambda: qemu.poll() is None, BOOT_TIMEOUT)
                self._wait_up(handle, qemu, BOOT_TIMEOUT)
            except BaseException as exc:
                self._stop_processes(handle)
                self._release_network(spec.id)
                self._let_go_of_volumes(spec.id, disks)
                snapshots.discard(d)  # (the base's contract: a restore that fails discards it)
                if isinstance(exc, LauncherError):
                    raise LauncherError(f"the microVM could not be restored: {exc}") from None
                raise
            snapshots.discard(d)  # it runs on from here: the saved state is past
            if lease is not None:
                self._write_resolution(spec.id, policy, names)
            return handle

    def suspend(self, handle: Handle, keep_files: bool = True) -> None:
        sandbox_id = handle["id"]
        with self._lock(sandbox_id):
            handle = self.handle_for(sandbox_id) | handle
            # Its volumes outlive it: what the guest holds for them is written out first.
            self._stop_processes(handle, graceful=keep_files or bool(handle.get("disks")))
            self._let_go_of_volumes(sandbox_id, handle.get("disks") or [])
            self._release_network(sandbox_id)
            if not keep_files:
                (self._dir(sandbox_id) / "disk.img").unlink(missing_ok=True)

    def destroy(self, handle: Handle) -> None:
        sandbox_id = handle["id"]
        with self._lock(sandbox_id):
            handle = self.handle_for(sandbox_id) | handle
            self._stop_processes(handle, graceful=bool(handle.get("disks")))
            self._let_go_of_volumes(sandbox_id, handle.get("disks") or [])
            self._release_network(sandbox_id)
            shutil.rmtree(self._dir(sandbox_id), ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.sandboxes_dir / f".{sandbox_id}.lock").unlink()

    # -- inspection -----------------------------------------------------------------------

    def _agent_answers(self, handle: Handle) -> bool:
        try:
            self.agent(handle).ping()
            return True
        except AgentError:
            return False

    def state(self, handle: Handle) -> RuntimeState:
        d = self._dir(handle["id"])
        if not d.exists():
            return RuntimeState("missing", "the runtime has no such sandbox")
        if "qemu_pid" not in handle:
            handle = self.handle_for(handle["id"]) | handle
        if self._running(handle):
            return RuntimeState("running")
        return RuntimeState("stopped", self._exit_reason(handle))

    def _exit_reason(self, handle: Handle) -> str:
        try:
            console = (self._dir(handle["id"]) / "console.log").read_bytes()[-65536:]
        except OSError:
            console = b""
        if OOM_MARK in console:
            return (f"out of memory: the sandbox exceeded its memory limit of {handle.get('memory_mb', '?')} MB "
                    "and was killed")  # fmt: skip
        return self._qemu_oom(handle) or "the sandbox's virtual machine stopped"

    def _qemu_oom(self, handle: Handle) -> str | None:
        """Why QEMU went, where its memory cgroup's limit killed it."""
        if not cgroups.oom_killed(self.cgroup_parent, handle["id"]):
            return None
        return (f"out of memory: the sandbox's virtual machine (QEMU) went over its limit of "
                f"{handle.get('qemu_memory_limit_mb', '?')} MB (the sandbox's {handle.get('memory_mb', '?')} MB "
                "and QEMU's own allowance) and was killed")  # fmt: skip

    def states(self) -> dict[str, RuntimeState]:
        if not self.sandboxes_dir.exists():
            return {}
        ids = sorted(
            p.name for p in self.sandboxes_dir.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
        return {sandbox_id: self.state(self.handle_for(sandbox_id)) for sandbox_id in ids}

    def stats(self, handle: Handle) -> Stats:
        handle = self.handle_for(handle["id"]) | handle
        if not self._running(handle):
            raise self._unreachable(handle)
        trim_console(self._dir(handle["id"]) / "console.log", CONSOLE_MAX, CONSOLE_KEEP)
        cpu = 0.0
        with contextlib.suppress(OSError, IndexError, ValueError):
            with open(f"/proc/{handle['qemu_pid']}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        # Memory and disk as the guest sees them (QEMU's own RSS counts pages the guest freed).
        info: dict[str, int] = {}
        with contextlib.suppress(LauncherError):
            meminfo = self.agent(handle).read_file("/proc/meminfo").decode()
            for line in meminfo.splitlines():
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024 if rest.split() else 0
        disk_used = disk_total = 0
        with contextlib.suppress(LauncherError, ValueError, IndexError):
            r = self.exec(handle, ExecRequest(argv=["df", "-k", "/"], timeout=10))
            cols = r.stdout.decode().splitlines()[1].split()
            disk_total, disk_used = int(cols[1]) * 1024, int(cols[2]) * 1024
        return Stats(
            cpu_seconds=cpu,
            memory_bytes=info.get("MemTotal", 0) - info.get("MemAvailable", 0),
            memory_limit_bytes=int(handle.get("memory_mb", 0)) * 1024 * 1024,
            disk_bytes=disk_used,
            disk_limit_bytes=disk_total,
        )

    def console_tail(self, handle: Handle) -> str:
        """The last of what the guest kernel wrote to its console (at most 500 bytes)."""
        return self._console_tail(handle)

    def _console_tail(self, handle: Handle) -> str:
        try:
            with open(self._dir(handle["id"]) / "console.log", "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 500))
                return log.read(500).decode(errors="replace").strip()
        except OSError:
            return ""

    def _exists(self, handle: Handle) -> bool:
        return self._dir(handle["id"]).exists()

    def _lost(self, handle: Handle) -> LauncherError:
        return self._unreachable(handle)

    def _unreachable(self, handle: Handle, exc: Exception | None = None) -> LauncherError:
        handle = self.handle_for(handle["id"]) | handle
        # The mux sees the port close a moment before QEMU's exit is visible: give it that moment.
        deadline = time.monotonic() + 2.0
        while self._running(handle) and time.monotonic() < deadline and not self._agent_answers(handle):
            time.sleep(0.05)
        st = self.state(handle)
        if st.status == "missing":
            return SandboxGone(f"sandbox {handle['id']} is not on this node")
        if st.status != "running":
            return SandboxNotRunning(f"sandbox {handle['id']} is {st.status}: {st.reason}", reason=st.reason)
        return LauncherError(f"the sandbox's agent did not answer: {exc or 'no reason given'}")
