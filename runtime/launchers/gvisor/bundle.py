"""A sandbox's directory on the host and its OCI bundle: the mounts create makes (overlay root,
its own disk, the agent's and the console's tmpfs) and the ``config.json`` runsc starts it from."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path
from typing import Any

from ...host import disks
from ...host.network import Lease
from ..agent.ca import SandboxCA
from ..base import LauncherError, Mount, SandboxSpec

AGENT_PATH = "/.hangar/agent"
AGENT_RUN_DIR = "/.hangar/run"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Docker's default capability set: enough for package managers inside the sandbox; gVisor's
# sentry, not the host kernel, is what enforces them.
LINUX_CAPABILITIES = [
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FSETID", "CAP_FOWNER", "CAP_MKNOD", "CAP_NET_RAW",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETFCAP", "CAP_SETPCAP", "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT", "CAP_KILL", "CAP_AUDIT_WRITE",
]  # fmt: skip
MOUNTED_SUBDIRS = ("rootfs", "run", "log")  # what create mounts in a sandbox's directory

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2
_libc = ctypes.CDLL(None, use_errno=True)


def oci_spec(
    spec: SandboxSpec, d: Path, *, agent_binary: Path, cgroup_parent: str, ca: SandboxCA | None = None,
    lease: Lease | None = None,
) -> dict[str, Any]:  # fmt: skip
    env = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": spec.hostname, "TERM": "xterm-256color"}
    if ca is not None:
        env.update(ca.env())
    env.update(spec.env)
    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc"},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": AGENT_PATH, "type": "bind", "source": str(agent_binary), "options": ["rbind", "ro"]},
        {"destination": AGENT_RUN_DIR, "type": "bind", "source": str(d / "run"), "options": ["rbind", "rw"]},
    ]  # fmt: skip
    for m in ([ca.mount()] if ca is not None else []) + list(spec.mounts):
        mounts.append(_bind(m))
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
                k: LINUX_CAPABILITIES for k in ("bounding", "effective", "inheritable", "permitted")
            },
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 65536, "soft": 65536}],
            "noNewPrivileges": False,
        },
        "root": {"path": str(d / "rootfs"), "readonly": False},
        "hostname": spec.hostname,
        "mounts": mounts,
        "linux": {
            "cgroupsPath": f"/{cgroup_parent}/{spec.id}",
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


def _bind(m: Mount) -> dict[str, Any]:
    return {
        "destination": m.destination,
        "type": "bind",
        "source": m.source,
        "options": ["rbind", "ro" if m.read_only else "rw"],
    }


def mount_dirs(d: Path, spec: SandboxSpec, pool: disks.Disks) -> None:
    """The sandbox's directory, mounted for a start: its disk (``pool``'s default size unless
    the spec says), the overlay root over the image, the agent's and the console's tmpfs."""
    for sub in ("rootfs", "run", "log", "bundle"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    d.chmod(0o700)  # its files and bundle (the environment, secrets included) are root's only
    disk = d / "disk"
    size = pool.default_mb if spec.disk_mb is None else spec.disk_mb
    if disk.exists():
        disks.mount(disk)  # its own, kept since it was made (a pause, a reboot)
    elif size and not (d / "upper").exists():  # (one with files of its own keeps them)
        pool.make(disk, size)
    upper = layers(d)
    for sub in ("upper", "work"):
        (upper / sub).mkdir(exist_ok=True)
    mounted = mount_points()
    # The sandbox can write into both: into run/ through its bind mount, into log/ as the
    # agent's stdout and stderr (/proc/1/fd/2 to root in it). Tiny tmpfs mounts keep it
    # from filling the host's disk through either.
    for sub in ("run", "log"):
        if str(d / sub) not in mounted:
            mount("tmpfs", d / sub, "size=1m,mode=0700", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if str(d / "rootfs") not in mounted:
        mount(
            "overlay",
            d / "rootfs",
            f"lowerdir={spec.rootfs},upperdir={upper / 'upper'},workdir={upper / 'work'}",
        )


def unmount_dirs(d: Path) -> None:
    mounted = mount_points()  # one read of the mount table, not one per mount point
    for sub in MOUNTED_SUBDIRS:
        if str(d / sub) in mounted:
            unmount(d / sub)


def layers(d: Path) -> Path:
    """Where a sandbox's overlay has its upper/ (its files) and work/ dirs."""
    return d / "disk" / disks.MOUNT if (d / "disk").exists() else d


def mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f}


def is_mounted(path: Path) -> bool:
    return str(path) in mount_points()


def mount(fstype: str, target: Path, data: str, flags: int = 0) -> None:
    # The syscall directly: a `mount` process per sandbox costs milliseconds on the create path.
    if _libc.mount(fstype.encode(), str(target).encode(), fstype.encode(), flags, data.encode()) != 0:
        err = ctypes.get_errno()
        raise LauncherError(f"mounting {fstype} on {target} failed: {os.strerror(err)}")


def unmount(path: Path) -> None:
    for _ in range(50):
        if not is_mounted(path):
            return
        # The gofer may hold the mount for a moment after the sandbox dies.
        if _libc.umount2(str(path).encode(), 0) != 0:
            time.sleep(0.05)
    if is_mounted(path):
        _libc.umount2(str(path).encode(), MNT_DETACH)


def write_private(path: Path, text: str) -> None:
    """``path`` replaced by ``text``, mode 0600 from the start."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
