"""The gVisor launcher's sandbox disks (runtime/launchers/disks.py): copies of a formatted
template, made ahead as spares, kept across a stop-mode pause and a reboot, removed with
nothing left. What every
launcher must do with a disk size (ENOSPC inside, the host not filled) is in the conformance
suite."""

from __future__ import annotations

import os
import stat
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.host import disks
from runtime.launchers.base import ExecRequest, LauncherError, SandboxSpec
from runtime.launchers.gvisor.launcher import GVisorLauncher
from tests.launchers.gvisor.helpers import assert_nothing_left
from tests.launchers.helpers import loop_backing_files, wait_until_true
from tests.support import requires_runsc

pytestmark = [requires_runsc]


def mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [p for p in (line.split()[4] for line in f) if p.startswith(f"{path}/")]


@pytest.fixture
def launcher(tmp_path, agent_cache_dir) -> Iterator[GVisorLauncher]:
    launcher = GVisorLauncher(state_dir=tmp_path / "gvisor", agent_cache_dir=agent_cache_dir, disk_mb=1024,
                              spare_disks=0)  # fmt: skip
    yield launcher
    for sandbox_id in launcher.states():
        launcher.destroy(launcher.handle_for(sandbox_id))
    launcher.release_spares()
    assert not mounts_under(tmp_path)  # nothing of it stays mounted
    wait_until_true(lambda: not [f for f in loop_backing_files() if f.startswith(str(tmp_path))], 10)


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()


def sh(launcher: GVisorLauncher, handle: dict, script: str) -> bytes:
    r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script], timeout=30))
    assert r.exit_code == 0, r
    return r.stdout


def allocated(path: Path) -> int:
    return path.stat().st_blocks * 512


def test_a_disk_is_a_sparse_copy_of_its_sizes_template_made_once(launcher, busybox):
    launcher.prepare()
    template = launcher.disks.root / "templates" / "1024.ext4"
    made_at = template.stat().st_mtime_ns
    assert template.stat().st_size == 1024 << 20 and allocated(template) < 32 << 20
    spec = SandboxSpec(id="d" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    disk = launcher.sandboxes_dir / spec.id / "disk"
    image = disk / disks.IMAGE
    # The copy holds the template's data only: its holes stay holes.
    assert image.stat().st_size == 1024 << 20 and allocated(image) <= allocated(template) + (4 << 20)
    assert os.path.ismount(disk / disks.MOUNT) and template.stat().st_mtime_ns == made_at
    assert stat.S_IMODE(image.stat().st_mode) == 0o600
    sh(launcher, handle, "echo kept > /root/note")
    assert (disk / disks.MOUNT / "upper" / "root" / "note").read_text() == "kept\n"
    # Its loop device is attached to its own file, and goes with it.
    assert str(image) in loop_backing_files()
    launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)
    assert template.exists()  # kept for the next ones


def test_a_create_takes_a_spare_and_another_is_made_once_it_answered(launcher, busybox):
    launcher.disks.spare = 2
    launcher.prepare()
    spares = {(p / disks.IMAGE).stat().st_ino: p for p in launcher.disks.ready_dir.iterdir()}
    assert len(spares) == 2 and all(os.path.ismount(p / disks.MOUNT) for p in spares.values())
    spec = SandboxSpec(id="d" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    disk = launcher.sandboxes_dir / spec.id / "disk"
    assert (disk / disks.IMAGE).stat().st_ino in spares  # one of those, not a new one
    assert os.path.ismount(disk / disks.MOUNT)
    sh(launcher, handle, "echo mine > /root/note")
    assert (disk / disks.MOUNT / "upper" / "root" / "note").read_text() == "mine\n"
    wait_until_true(lambda: launcher.disks.spares() == 2, 10)  # made again in the background
    # Another size is made for the sandbox that asks for it; the spares stay.
    other = launcher.create(SandboxSpec(id="d" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                                        disk_mb=128))  # fmt: skip
    assert launcher.stats(other).disk_limit_bytes < 128 << 20 and launcher.disks.spares() == 2
    launcher.destroy(handle)
    launcher.destroy(other)
    assert_nothing_left(launcher, spec.id)


def test_spares_half_made_or_of_another_size_are_removed(launcher):
    launcher.disks.spare = 2
    root = launcher.disks.root
    launcher.disks._make(root / ".making-dead", 64)  # a refill killed half-way
    launcher.disks._make(root / "ready" / "2048-old", 64)  # the default size changed since
    assert launcher.disks.refill() == 2
    assert sorted(p.name.split("-")[0] for p in (root / "ready").iterdir()) == ["1024", "1024"]
    assert not (root / ".making-dead").exists()
    assert len(mounts_under(root)) == 2
    launcher.release_spares()
    assert not mounts_under(root) and not list((root / "ready").iterdir())


def test_files_stay_on_the_disk_across_a_stop_pause_and_a_reboot(launcher, busybox):
    spec = SandboxSpec(id="d" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256, disk_mb=128)
    handle = launcher.create(spec)
    sh(launcher, handle, "mkdir -p /data && echo one > /data/f")
    launcher.suspend(launcher.handle_for(spec.id), keep_files=True)
    # A reboot of the node: its mounts are gone, the disk's file is not.
    disk = launcher.sandboxes_dir / spec.id / "disk"
    subprocess.run(["umount", str(disk / disks.MOUNT)], check=True)
    assert not os.path.ismount(disk / disks.MOUNT)
    handle = launcher.create(spec)
    assert sh(launcher, handle, "cat /data/f") == b"one\n"
    assert os.path.ismount(disk / disks.MOUNT)
    # An ephemeral sandbox's pause keeps nothing: its disk goes, and a fresh one comes next start.
    launcher.suspend(launcher.handle_for(spec.id), keep_files=False)
    assert not disk.exists()
    wait_until_true(lambda: not [f for f in loop_backing_files() if spec.id in f], 10)
    handle = launcher.create(spec)
    assert sh(launcher, handle, "ls /data 2>/dev/null; echo end") == b"end\n"
    launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)


def test_a_sandbox_without_a_disk_of_its_own_writes_to_the_nodes_filesystem(launcher, busybox):
    """disk_mb=0 (HANGAR_SANDBOX_DISK_MB=0 on a node without loop devices, or a sandbox made
    before disks existed, whose files are in its directory): no disk, no limit."""
    spec = SandboxSpec(id="d" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256, disk_mb=0)
    handle = launcher.create(spec)
    sh(launcher, handle, "echo here > /f")
    d = launcher.sandboxes_dir / spec.id
    assert not (d / "disk").exists() and (d / "upper" / "f").read_text() == "here\n"
    assert launcher.stats(handle).disk_limit_bytes == 0
    # Started again with a size (an upgraded node), it keeps the files it has where they are.
    launcher.suspend(launcher.handle_for(spec.id))
    handle = launcher.create(SandboxSpec(id=spec.id, rootfs=busybox.rootfs, memory_mb=256, disk_mb=128))
    assert sh(launcher, handle, "cat /f") == b"here\n" and not (d / "disk").exists()
    launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)


def test_a_disk_made_half_way_is_replaced_and_a_make_is_whole_or_absent(launcher, busybox):
    """A node that died while making a disk left `.disk.making` (mounted): the next start of
    that sandbox makes it again, and its destroy removes a half-made one too."""
    spec = SandboxSpec(id="d" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256, disk_mb=128)
    d = launcher.sandboxes_dir / spec.id
    d.mkdir(parents=True)
    launcher.disks.make(d / "scratch", 128)  # stands for a make that got as far as its mount
    (d / "scratch").rename(d / ".disk.making")
    handle = launcher.create(spec)
    assert not (d / ".disk.making").exists() and os.path.ismount(d / "disk" / disks.MOUNT)
    launcher.suspend(handle)
    launcher.disks.make(d / "scratch", 128)
    (d / "scratch").rename(d / ".disk.making")
    launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)


def test_templates_of_sizes_other_than_the_default_are_kept_for_the_last_eight_used(launcher, tmp_path):
    templates = launcher.disks.root / "templates"
    for size in range(64, 64 + disks.MAX_TEMPLATES + 3):
        launcher.disks.make(tmp_path / f"d{size}", size)
        disks.remove(tmp_path / f"d{size}")
        os.utime(templates / f"{size}.ext4", (1, size))  # made in this order, a second apart
    launcher.disks.template(1024)  # the default's is never pruned
    kept = sorted(int(p.stem) for p in templates.glob("*.ext4"))
    assert kept == [*range(64 + 3, 64 + disks.MAX_TEMPLATES + 3), 1024]
    # A size used again is made again, whole.
    launcher.disks.make(tmp_path / "again", 64)
    assert os.path.ismount(tmp_path / "again" / disks.MOUNT)
    disks.remove(tmp_path / "again")


def test_a_disk_smaller_than_the_minimum_is_refused(launcher, tmp_path):
    with pytest.raises(LauncherError, match="at least 64 MB"):
        launcher.disks.make(tmp_path / "d", 16)
    assert not (tmp_path / "d").exists()
