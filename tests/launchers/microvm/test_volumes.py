"""Volumes in a microVM: each a virtio disk of the VM (the volume's ext4 image, as the node
keeps it), mounted by the guest's kernel at its path, read-only where asked; held by the VM
alone while it runs, and whole on the host once the VM has gone. Real QEMU under TCG here."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from runtime.host import volumes
from runtime.host.volumes import VolumeError, VolumeStore
from runtime.launchers.base import ExecRequest, LauncherError, Mount, SandboxSpec
from runtime.launchers.microvm import boot
from tests.support import volume_store

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (QEMU's disks, loop mounts)"),
    pytest.mark.skipif(boot.missing() is not None, reason=f"no microVM support here: {boot.missing()}"),
    pytest.mark.slow,
]

WORK, SEEDS = "volvmwork01", "volvmseed01"


@pytest.fixture
def store(tmp_path) -> Iterator[VolumeStore]:
    with volume_store(tmp_path / "volumes", **{WORK: 64, SEEDS: 32}) as s:
        (s.mount(SEEDS) / "seed.txt").write_text("from the host\n")
        yield s


def sh(launcher, handle, script: str) -> tuple[int, str]:
    r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script], timeout=60))
    return r.exit_code, (r.stdout + r.stderr).decode()


def test_volumes_are_disks_mounted_at_their_paths_held_alone_and_whole_after_the_vm(launcher, busybox, store):
    sid = "t" + uuid.uuid4().hex[:12]
    mounts = (
        Mount("", "/data/work", disk=str(store.attach_as_disk(WORK, sid))),
        Mount("", "/seeds", read_only=True, disk=str(store.attach_as_disk(SEEDS, sid))),
    )
    handle = launcher.create(SandboxSpec(id=sid, rootfs=busybox.rootfs, memory_mb=256, mounts=mounts))
    try:
        assert handle["disks"] == [m.disk for m in mounts]
        rc, out = sh(launcher, handle, "grep -E ' /data/work | /seeds ' /proc/mounts")
        assert rc == 0, out
        lines = {line.split()[1]: line.split() for line in out.splitlines()}
        assert lines["/data/work"][2] == "ext4" and lines["/data/work"][3].startswith("rw,")
        assert lines["/seeds"][2] == "ext4" and lines["/seeds"][3].startswith("ro,")
        assert sh(launcher, handle, "cat /seeds/seed.txt") == (0, "from the host\n")
        rc, out = sh(launcher, handle, "echo no > /seeds/other")
        assert rc != 0 and "Read-only file system" in out
        # Mounted with the node's options: no device nodes, no set-uid.
        assert "nodev" in lines["/data/work"][3] and "nosuid" in lines["/data/work"][3]
        assert sh(launcher, handle, "ls -a /data/work") == (0, ".\n..\n")  # mkfs's lost+found gone
        rc, out = sh(
            launcher,
            handle,
            "seq 1 100000 > /data/work/numbers && mkdir /data/work/d && echo x > /data/work/d/f",
        )
        assert rc == 0, out

        # While the VM runs it holds both: the host mounts neither, no other VM attaches them.
        assert volumes.holder(store.image(WORK)) == sid == volumes.holder(store.image(SEEDS))
        with pytest.raises(VolumeError, match=f"microVM sandbox {sid}"):
            store.mount(WORK)
        other = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=128,
                            mounts=(Mount("", "/data", disk=str(store.image(WORK))),))  # fmt: skip
        with pytest.raises(LauncherError):
            launcher.create(other)
        assert launcher.states()[other.id].status != "running"
        launcher.destroy({"id": other.id})
        assert volumes.holder(store.image(WORK)) == sid  # the refused VM took nothing from it
        assert sh(launcher, handle, "wc -l < /data/work/numbers") == (0, "100000\n")
    finally:
        launcher.destroy(handle)

    # Gone with the VM: what it wrote is on the volume (the guest unmounted it before QEMU went).
    assert volumes.holder(store.image(WORK)) is None and volumes.holder(store.image(SEEDS)) is None
    work = store.mount(WORK)
    assert (work / "numbers").read_text().count("\n") == 100000
    assert (work / "d" / "f").read_text() == "x\n"
    assert store.usage(WORK).used_bytes > 500_000


def test_a_stop_mode_pause_lets_go_of_the_volume_and_a_resume_takes_it_again(launcher, busybox, store):
    sid = "t" + uuid.uuid4().hex[:12]
    spec = SandboxSpec(id=sid, rootfs=busybox.rootfs, memory_mb=192,
                       mounts=(Mount("", "/work", disk=str(store.attach_as_disk(WORK, sid))),))  # fmt: skip
    handle = launcher.create(spec)
    try:
        assert sh(launcher, handle, "echo before > /work/f")[0] == 0
        launcher.suspend(handle)
        assert volumes.holder(store.image(WORK)) is None
        # Meanwhile the host may read it (as the usage figure does), and give it back.
        assert (store.mount(WORK) / "f").read_text() == "before\n"
        store.attach_as_disk(WORK, sid)
        handle = launcher.create(spec)
        assert sh(launcher, handle, "cat /work/f") == (0, "before\n")
        assert volumes.holder(store.image(WORK)) == sid
    finally:
        launcher.destroy(handle)
    assert volumes.holder(store.image(WORK)) is None


def test_a_volume_without_its_disk_is_refused(launcher, busybox, tmp_path):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs,
                       mounts=(Mount(str(tmp_path), "/data"),))  # fmt: skip
    with pytest.raises(LauncherError, match="attaches volumes as disks: /data has none"):
        launcher.create(spec)
