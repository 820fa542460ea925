"""The microVM launcher's own behaviour, with real QEMU and the real guest kernel (what every
launcher does is the conformance suite's: tests/launchers/test_conformance.py). Boots are
costly under TCG: most tests share one sandbox."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launchers.base import ExecRequest, LauncherError, Mount, SandboxSpec
from runtime.launchers.microvm import boot, cgroups
from runtime.launchers.microvm.launcher import TCG_TB_MB
from tests.launchers.helpers import make_launcher, remove_all

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root (QEMU's disks and sockets in a root-only state dir)"
    ),
    pytest.mark.skipif(boot.missing() is not None, reason=f"no microVM support here: {boot.missing()}"),
    pytest.mark.slow,
]


def spec(busybox, **kw) -> SandboxSpec:
    kw.setdefault("memory_mb", 256)
    return SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, **kw)


@pytest.fixture(scope="module")
def vm(launcher, busybox) -> Iterator[dict]:
    """One VM of 2 vCPUs (cpu 1.5, rounded up) and 192 MB, with a secret in its environment."""
    handle = launcher.create(
        spec(busybox, cpu=1.5, memory_mb=192, env={"TOKEN": "s3cr3t-value"}, hostname="vmbox")
    )
    yield handle
    launcher.destroy(handle)


def sh(launcher, handle, script: str, **kw) -> bytes:
    r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script], **kw))
    assert r.exit_code == 0, r
    return bytes(r.stdout)


def test_the_guest_runs_the_node_s_microvm_kernel(launcher, vm):
    release = sh(launcher, vm, "uname -r").decode().strip()
    assert release == boot.kernel().version
    assert release not in (os.uname().release, "4.4.0")  # neither the host's nor gVisor's


def test_under_tcg_the_guest_is_given_the_tsc_frequency_instead_of_calibrating_it(launcher, vm):
    """Left to calibrate its TSC against the emulated PIT, a TCG guest sometimes got nothing and
    hung at boot for good; it is told the host's frequency (boot.tcg_args)."""
    if vm["accel"] != "tcg":
        pytest.skip("KVM guests calibrate from the hypervisor's own clock")
    cmdline = sh(launcher, vm, "cat /proc/cmdline").decode()
    assert f"tsc_early_khz={boot.host_tsc_khz()}" in cmdline, cmdline


def test_the_host_tsc_frequency_is_read_from_cpuinfo_with_a_default(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: X\ncpu MHz\t\t: 2399.998\n")
    assert boot.host_tsc_khz(cpuinfo) == 2_399_998
    cpuinfo.write_text("processor\t: 0\n")  # an architecture or kernel that says nothing
    assert boot.host_tsc_khz(cpuinfo) == boot.DEFAULT_TSC_KHZ
    cpuinfo.write_text("cpu MHz\t\t: nonsense\n")
    assert boot.host_tsc_khz(cpuinfo) == boot.DEFAULT_TSC_KHZ
    assert boot.host_tsc_khz(tmp_path / "absent") == boot.DEFAULT_TSC_KHZ


def test_vcpus_and_memory_are_what_was_asked(launcher, vm):
    assert sh(launcher, vm, "grep -c ^processor /proc/cpuinfo").strip() == b"2"
    mem_kb = int(sh(launcher, vm, "grep MemTotal /proc/meminfo").split()[1])
    # The guest's RAM is the request, less what the kernel keeps for itself.
    assert 140 * 1024 < mem_kb <= 192 * 1024, mem_kb


def test_a_fractional_cpu_is_a_quota_on_qemu_s_vcpus(launcher, vm):
    assert cgroups.quota(launcher.cgroup_parent, vm["id"]) == 1.5
    assert vm["qemu_pid"] in cgroups.pids(launcher.cgroup_parent, vm["id"])


def test_qemu_is_in_a_memory_cgroup_of_the_guest_s_ram_and_its_own_allowance(launcher, vm):
    overhead = launcher.overhead_mb(vm["accel"])
    assert cgroups.memory_limit(launcher.cgroup_parent, vm["id"]) == (192 + overhead) * 1024 * 1024
    assert vm["qemu_pid"] in cgroups.pids(launcher.cgroup_parent, vm["id"], "memory")
    assert vm["qemu_memory_limit_mb"] == 192 + overhead
    if vm["accel"] == "tcg":  # its translated code's buffer, bounded (QEMU's default is 1 GiB)
        assert f"tcg,tb-size={TCG_TB_MB}" in Path(f"/proc/{vm['qemu_pid']}/cmdline").read_text().replace(
            "\0", " "
        )


def test_qemu_over_its_allowance_is_killed_and_says_so(tmp_path_factory, agent_cache_dir, busybox):
    """A 128 MB guest's QEMU uses ~200 MB under TCG as it boots (the guest's RAM it touches, its
    own code, translated code): with an allowance of 16 MB the cgroup's limit kills it."""
    tight = make_launcher(
        "microvm", tmp_path_factory.mktemp("microvm-tight"), agent_cache_dir, memory_overhead_mb=16
    )
    try:
        with pytest.raises(LauncherError, match=r"QEMU\) went over its limit of 144 MB"):
            tight.create(spec(busybox, memory_mb=128))
    finally:
        remove_all(tight)


def test_root_disks_of_images_the_node_no_longer_has_are_pruned_unless_a_vm_uses_them(
    launcher, vm, busybox, tmp_path
):
    gone = tmp_path / "rootfs"
    (gone / "bin").mkdir(parents=True)
    (gone / "bin" / "x").write_text("an image deleted since")
    stale = boot.root_disk(launcher.boot_dir, gone)
    used = boot.root_disk(launcher.boot_dir, busybox.rootfs)  # the running VM's
    assert launcher.prune_images({busybox.rootfs}) == [stale.name]
    assert not stale.exists() and used.exists()
    # Even with its image gone from the node, a disk a VM runs on stays.
    assert launcher.prune_images(set()) == [] and used.exists()


def test_the_sandbox_sees_only_its_own_processes(launcher, vm):
    ps = sh(launcher, vm, "ps -o pid,args").decode()
    assert "kthreadd" not in ps and "hangar-mux" not in ps and "/init" not in ps
    assert len(ps.strip().splitlines()) < 10
    assert sh(launcher, vm, "hostname").strip() == b"vmbox"


def test_env_reaches_commands_but_never_qemu_s_command_line(launcher, vm):
    assert sh(launcher, vm, "echo $TOKEN").strip() == b"s3cr3t-value"
    with open(f"/proc/{vm['qemu_pid']}/cmdline", "rb") as f:
        assert b"s3cr3t" not in f.read()
    config = Path(vm["dir"]) / "config"
    assert config.stat().st_mode & 0o077 == 0


def test_files_round_trip_through_the_port(launcher, vm):
    data = os.urandom(3_000_000)
    assert launcher.write_file(vm, "/root/blob", data) == len(data)
    entry, chunks = launcher.read_file(vm, "/root/blob")
    assert entry.size == len(data) and b"".join(chunks) == data
    assert {e.name for e in launcher.list_files(vm, "/root")} >= {"blob"}


def test_stats_count_qemu_s_cpu_and_the_guest_s_memory(launcher, vm):
    stats = launcher.stats(vm)
    assert stats.cpu_seconds > 0
    assert 0 < stats.memory_bytes < 192 << 20
    assert stats.memory_limit_bytes == 192 << 20


def test_the_console_file_is_appended_to_and_cut_back_past_its_bound(launcher, vm, monkeypatch):
    """The guest's console reaches the node as a file QEMU appends to (so one cut back is
    written at its new end, not at QEMU's old offset); past its bound, the next stats call cuts
    it back to its tail. A sandbox's own processes cannot write to it at all: their /dev has no
    serial port and they may not make one."""
    from runtime.launchers.microvm import launcher as module

    r = launcher.exec(
        vm, ExecRequest(argv=["/bin/sh", "-c", "ls /dev/ttyS0 /dev/console; mknod /tmp/s c 4 64"])
    )
    assert r.exit_code != 0 and b"Operation not permitted" in bytes(r.stderr), r
    console = launcher.sandboxes_dir / vm["id"] / "console.log"
    qemu = vm["qemu_pid"]
    fds = [fd for fd in Path(f"/proc/{qemu}/fd").iterdir() if os.readlink(fd) == str(console)]
    assert fds, "QEMU does not hold the console file"
    flags = int(Path(f"/proc/{qemu}/fdinfo/{fds[0].name}").read_text().split("flags:")[1].split()[0], 8)
    assert flags & os.O_APPEND
    monkeypatch.setattr(module, "CONSOLE_MAX", 64 << 10)
    monkeypatch.setattr(module, "CONSOLE_KEEP", 4 << 10)
    with open(console, "ab") as f:  # as a guest kernel flooding its console would grow it
        f.write(b"x" * 200_000 + b"the-end\n")
    launcher.stats(vm)
    kept = console.read_bytes()
    assert len(kept) < (4 << 10) + 100 and kept.startswith(b"[hangar: the console's first ")
    assert kept.endswith(b"the-end\n"), kept[-100:]


def test_the_console_is_cut_back_only_past_its_bound(tmp_path):
    from runtime.launchers.microvm.launcher import trim_console

    path = tmp_path / "console.log"
    path.write_bytes(b"a" * 100)
    assert trim_console(path, 100, 10) is False and path.read_bytes() == b"a" * 100
    path.write_bytes(b"a" * 90 + b"0123456789" + b"z")
    assert trim_console(path, 100, 10) is True
    assert path.read_bytes() == b"[hangar: the console's first 91 bytes were dropped]\n123456789z"
    assert trim_console(tmp_path / "absent.log", 1, 1) is False


def test_a_fresh_launcher_re_adopts_the_running_vm(launcher, vm, agent_cache_dir):
    fresh = make_launcher("microvm", launcher.state_dir, agent_cache_dir)
    assert fresh.states()[vm["id"]].status == "running"
    assert sh(fresh, fresh.handle_for(vm["id"]), "echo by id") == b"by id\n"


def test_what_a_spec_asks_beyond_the_runtime_is_refused(launcher, busybox, tmp_path):
    with pytest.raises(LauncherError, match="volumes as disks"):  # a bind mount: gVisor's kind
        launcher.create(spec(busybox, mounts=(Mount(str(tmp_path), "/data"),)))
    with pytest.raises(LauncherError, match="is not running: there is nothing to checkpoint"):
        launcher.checkpoint({"id": "x"})


def test_suspend_keeps_the_disk_and_destroy_leaves_nothing(launcher, busybox):
    s = spec(busybox, disk_mb=128)
    handle = launcher.create(s)
    sh(launcher, handle, "echo kept > /root/f; sleep 600 &")
    qemu_pid = handle["qemu_pid"]
    launcher.suspend(handle)
    assert not Path(f"/proc/{qemu_pid}").exists()
    assert launcher.states()[s.id].status == "stopped"
    handle = launcher.create(s)
    assert sh(launcher, handle, "cat /root/f") == b"kept\n"
    assert b"sleep 600" not in sh(launcher, handle, "ps -o args")
    qemu_pid, mux_pid = handle["qemu_pid"], handle["mux_pid"]
    launcher.destroy(handle)
    launcher.destroy(handle)  # twice is harmless
    assert not Path(f"/proc/{qemu_pid}").exists() and not Path(f"/proc/{mux_pid}").exists()
    assert not cgroups.cgroup_dir(launcher.cgroup_parent, s.id).exists()
    assert not (launcher.sandboxes_dir / s.id).exists()
    assert s.id not in launcher.states()


def test_the_kvm_probe_answers_in_bounded_time(launcher):
    """Where /dev/kvm cannot run the guest kernel (this host's paravirtual KVM spins in it), the
    probe gives up within its timeout instead of hanging; where it can, it says kvm."""
    kern = boot.kernel()
    initrd = boot.initramfs(launcher.boot_dir, kern, launcher.agent_binary)
    start = time.monotonic()
    works = boot.kvm_works(
        launcher.boot_dir, kern, initrd, timeout=8.0, memo_dir=launcher.state_dir / "probe"
    )
    assert time.monotonic() - start < 15
    assert launcher.capabilities().kvm is (launcher.accel() == "kvm")
    if not os.path.exists("/dev/kvm"):
        assert works is False
