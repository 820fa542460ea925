"""What a microVM boots from: the guest kernel (fetched by scripts/install-microvm.sh), the
initramfs (built here from source in the repo: ``guest/hangar-mux.c`` as /init, the guest
agent, the kernel's modules), the image's read-only root disk, the sandbox's own disk; which
accelerator the node's KVM allows; and QEMU's command line."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ...host.locks import file_lock
from ..base import LauncherError

DEFAULT_KERNEL_DIR = Path("/usr/local/lib/hangar/microvm")
MUX_SOURCE = Path(__file__).with_name("guest") / "hangar-mux.c"
MUX_CFLAGS: tuple[str, ...] = ("-static", "-O2", "-Wall", "-Wextra")
INSTALL_HINT = "scripts/install-microvm.sh installs QEMU and the guest kernel (make install runs it)"
QEMU = "qemu-system-x86_64"
MEMO_DIR = Path("/var/cache/hangar/microvm")  # where install-microvm.sh keeps the kernel's .deb

# Under TCG the microvm machine's kernel needs help with its clocks (tried here, QEMU 7.2 and
# Debian's 6.1): without clocksource=jiffies the agent did not come up within 25 s; with the PIT as the only tick (nolapic_timer) time stopped once the IO-APIC took
# over ("APIC: Switch to symmetric I/O mode") and /init's first sleep never ended. What boots:
# the local APIC timer as the tick, jiffies as the clocksource, a fixed loops-per-jiffy instead
# of calibrating, and no timer check.
TCG_ARGS = "clocksource=jiffies tsc=unstable lpj=1000000 no_timer_check"
# Nor can it calibrate the TSC reliably: about one boot in three (at loglevel 8; one in thirty-odd
# at 1) the emulated PIT gave it nothing ("tsc: Unable to calibrate against PIT", "No reference
# (HPET/PMTIMER) available"), the clock stood at 0 and the boot hung at "smpboot: CPU0" for good.
# Under TCG the guest's TSC is the host's (QEMU reads the host's counter), so its frequency is
# given (tsc_early_khz): no calibration, nothing to fail.
DEFAULT_TSC_KHZ = 2_000_000


def host_tsc_khz(cpuinfo: Path = Path("/proc/cpuinfo")) -> int:
    """The host's TSC frequency in kHz, as /proc/cpuinfo's first "cpu MHz" says it (a fixed-rate
    TSC runs at the nominal frequency); DEFAULT_TSC_KHZ where it says nothing usable."""
    with contextlib.suppress(OSError, ValueError):
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("cpu MHz"):
                khz = int(float(line.split(":", 1)[1]) * 1000)
                return khz if 100_000 <= khz <= 10_000_000 else DEFAULT_TSC_KHZ
    return DEFAULT_TSC_KHZ


def tcg_args() -> str:
    return f"{TCG_ARGS} tsc_early_khz={host_tsc_khz()}"


# console on the first serial port, at emergency level only (every console byte is an emulated
# I/O exit); a panic (an out-of-memory one included) ends QEMU at once (-no-reboot).
KERNEL_ARGS = (
    "console=ttyS0 loglevel=1 panic=-1 reboot=t rdinit=/init pci=off edd=off i8042.noaux i8042.nokbd"
)


@dataclass(frozen=True)
class Kernel:
    dir: Path
    vmlinuz: Path
    version: str
    modules: tuple[Path, ...]


def kernel(kernel_dir: str | os.PathLike[str] = "") -> Kernel:
    """The guest kernel and its modules, as install-microvm.sh left them."""
    d = Path(kernel_dir) if kernel_dir else DEFAULT_KERNEL_DIR
    vmlinuz = d / "vmlinuz"
    try:
        names = (d / "modules.list").read_text().split()
        version = (d / "version").read_text().strip()
    except OSError as exc:
        raise LauncherError(f"no microVM guest kernel in {d}: {INSTALL_HINT}") from exc
    if not vmlinuz.is_file():
        raise LauncherError(f"no microVM guest kernel at {vmlinuz}: {INSTALL_HINT}")
    return Kernel(d, vmlinuz, version, tuple(d / "modules" / n for n in names))


# The agent's link over vsock (a node with /dev/vhost-vsock): the guest's /init listens on this
# port (kernel argument hangar.link=vsock:PORT) and the node's mux connects to the VM's CID there.
VSOCK_PORT = 1024
VHOST_VSOCK = "/dev/vhost-vsock"


def vsock_missing(kern: Kernel) -> str | None:
    """Why this node's VMs cannot reach their agent over vsock (None: they can)."""
    try:
        os.close(os.open(VHOST_VSOCK, os.O_RDWR | os.O_CLOEXEC))
    except OSError as exc:
        return f"the node has no usable {VHOST_VSOCK} ({exc.strerror}; modprobe vhost_vsock)"
    if kern.dir == DEFAULT_KERNEL_DIR and not any("vsock" in m.name for m in kern.modules):
        return f"the guest kernel in {kern.dir} was unpacked without vsock's modules: {INSTALL_HINT}"
    return None


def missing(kernel_dir: str = "", qemu: str = "") -> str | None:
    """What this node lacks to run microVMs (None: nothing)."""
    for tool in (qemu or QEMU, "mkfs.ext4"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed: {INSTALL_HINT}"
    try:
        kernel(kernel_dir)
    except LauncherError as exc:
        return str(exc)
    return None


# -- building -------------------------------------------------------------------------------------


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(hashlib.sha256(part).digest())
    return h.hexdigest()[:16]


def mux_binary(cache_dir: Path) -> Path:
    """hangar-mux compiled for this node (static, so the same file is the guest's /init)."""
    source = MUX_SOURCE.read_bytes()
    target = cache_dir / f"hangar-mux-{_digest(source, ' '.join(MUX_CFLAGS).encode())}"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / ".hangar-mux.lock"):
        if target.is_file():
            return target
        gcc = shutil.which("gcc")
        if gcc is None:
            raise LauncherError("cannot build hangar-mux: gcc not found (apt-get install gcc libc6-dev)")
        tmp = target.with_name(f".{target.name}.tmp")
        proc = subprocess.run([gcc, *MUX_CFLAGS, "-o", str(tmp), str(MUX_SOURCE)], capture_output=True,
                              text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise LauncherError(f"building hangar-mux failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, target)
    return target


def _cpio_entry(out: io.BufferedIOBase, name: str, mode: int, data: bytes = b"") -> None:
    """One entry of a newc cpio archive (what the kernel unpacks an initramfs from)."""
    fields = [0, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name) + 1, 0]
    header = b"070701" + b"".join(b"%08X" % f for f in fields)
    out.write(header + name.encode() + b"\0")
    out.write(b"\0" * (-(len(header) + len(name) + 1) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))


def initramfs(cache_dir: Path, kern: Kernel, agent: Path) -> Path:
    """The initramfs: hangar-mux as /init, the agent, the modules the guest loads (cached by
    what goes in)."""
    mux = mux_binary(cache_dir)
    key = _digest(mux.name.encode(), agent.name.encode(), kern.version.encode(),
                  "\n".join(m.name for m in kern.modules).encode())  # fmt: skip
    target = cache_dir / f"initramfs-{key}.cpio"
    if target.is_file():
        return target
    with file_lock(cache_dir / ".initramfs.lock"):
        if target.is_file():
            return target
        fd, tmp = tempfile.mkstemp(prefix=".initramfs.", dir=cache_dir)
        with os.fdopen(fd, "wb") as out:
            for d in ("dev", "proc", "sys", "lower", "disk", "newroot", "modules"):
                _cpio_entry(out, d, 0o040755)
            _cpio_entry(out, "init", 0o100755, mux.read_bytes())
            _cpio_entry(out, "hangar-agent", 0o100755, agent.read_bytes())
            _cpio_entry(out, "modules.list", 0o100644, "".join(f"{m.name}\n" for m in kern.modules).encode())
            for m in kern.modules:
                _cpio_entry(out, f"modules/{m.name}", 0o100644, m.read_bytes())
            _cpio_entry(out, "TRAILER!!!", 0)
        os.replace(tmp, target)
    return target


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames + dirnames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size + 4096
    return total


def root_disk(cache_dir: Path, rootfs: Path) -> Path:
    """The image's root filesystem as one read-only ext4 file, built once (``mkfs.ext4 -d``) and
    shared by every VM of that image. The image store's rootfs path names its digest."""
    key = hashlib.sha256(str(rootfs.resolve()).encode()).hexdigest()[:16]
    target = cache_dir / f"root-{key}.ext4"
    if target.is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with file_lock(cache_dir / f".root-{key}.lock"):
        if target.is_file():
            return target
        size_mb = _tree_bytes(rootfs) * 5 // 4 // (1 << 20) + 32
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.unlink(missing_ok=True)
        proc = subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(rootfs), "-L", "hangar-root", str(tmp), f"{size_mb}M"],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise LauncherError(f"building the image's root disk failed: {proc.stderr.strip()[-2000:]}")
        os.chmod(tmp, 0o444)
        target.with_suffix(".source").write_text(str(rootfs.resolve()))  # what pruning checks
        os.replace(tmp, target)
    return target


def root_disks(cache_dir: Path) -> dict[Path, str | None]:
    """Every image's root disk here, with the rootfs it was built from (None: not recorded)."""
    out: dict[Path, str | None] = {}
    for disk in sorted(cache_dir.glob("root-*.ext4")):
        try:
            out[disk] = disk.with_suffix(".source").read_text()
        except OSError:
            out[disk] = None
    return out


def sandbox_disk(path: Path, size_mb: int) -> None:
    """The sandbox's own disk (the overlay's upper layer): a sparse ext4 file of ``size_mb``."""
    tmp = path.with_name(f".{path.name}.making")
    tmp.unlink(missing_ok=True)
    with open(tmp, "wb") as f:
        f.truncate(size_mb << 20)
    proc = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-L", "hangar-disk", str(tmp)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise LauncherError(f"making the sandbox's disk failed: {proc.stderr.strip()[-2000:]}")
    os.replace(tmp, path)


# -- the accelerator ------------------------------------------------------------------------------


def kvm_works(
    cache_dir: Path, kern: Kernel, initrd: Path, timeout: float = 10.0, memo_dir: Path | None = None
) -> bool:
    """Whether a guest kernel runs under this node's KVM: boots the guest kernel with
    ``-accel kvm`` and waits, at most ``timeout``, for its /init to speak on the console. A KVM
    that creates VMs but cannot run this kernel (a paravirtual KVM spins in it forever) is
    killed when the time is up. Remembered per kernel and QEMU, node-wide where root can
    write /var/cache/hangar (every data directory's node would otherwise pay the probe once)."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return False
    qemu = shutil.which(QEMU) or QEMU
    key = _digest(kern.version.encode(), str(os.stat(qemu).st_mtime_ns).encode(), initrd.name.encode())
    if memo_dir is None:
        memo_dir = MEMO_DIR if os.access(MEMO_DIR.parent, os.W_OK) else cache_dir
    memo = memo_dir / f"kvm-{key}"
    with contextlib.suppress(OSError):
        return memo.read_text().strip() == "yes"
    memo.parent.mkdir(parents=True, exist_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    console = cache_dir / f".kvm-probe-{os.getpid()}.log"
    argv = [qemu, "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128", "-smp", "1",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", f"file:{console}",
            "-kernel", str(kern.vmlinuz), "-initrd", str(initrd), "-append", KERNEL_ARGS.replace("loglevel=1", "loglevel=4")]  # fmt: skip
    works = False
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(OSError):
                if b"hangar-mux" in console.read_bytes():  # /init ran: the kernel booted
                    works = True
                    break
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
        console.unlink(missing_ok=True)
    memo.write_text("yes\n" if works else "no\n")
    return works
