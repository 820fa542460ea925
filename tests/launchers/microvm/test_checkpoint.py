"""A microVM paused in checkpoint mode and continued: what only the microVM's checkpoints have
(what every runtime's do is the conformance suite's: processes, memory and streams kept over
five cycles). QEMU's migration of the stopped VM to a file, its incoming migration back; the
guest's clock follows the restore; a volume it has mounted stays held by the checkpoint, so
the filesystem its saved kernel knows is the one it finds. Real QEMU under TCG here."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator

import pytest

from runtime.host import volumes
from runtime.host.volumes import VolumeError, VolumeStore
from runtime.launchers.base import ExecRequest, LauncherError, Mount, ProcessRequest, SandboxSpec
from runtime.launchers.microvm import boot, snapshots
from tests.launchers.helpers import assert_nothing_left
from tests.support import volume_store

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (QEMU's disks, loop mounts)"),
    pytest.mark.skipif(boot.missing() is not None, reason=f"no microVM support here: {boot.missing()}"),
    pytest.mark.slow,
]

VOL = "volckpt0001"


@pytest.fixture
def store(tmp_path) -> Iterator[VolumeStore]:
    with volume_store(tmp_path / "volumes", **{VOL: 32}) as s:
        yield s


def sh(launcher, handle, script: str) -> str:
    r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script], timeout=60))
    assert r.exit_code == 0, r
    return r.stdout.decode()


def test_a_checkpoint_keeps_memory_and_volume_and_the_clock_follows_the_restore(launcher, busybox, store):
    sid = "t" + uuid.uuid4().hex[:12]
    spec = SandboxSpec(id=sid, rootfs=busybox.rootfs, memory_mb=192,
                       mounts=(Mount("", "/data", disk=str(store.attach_as_disk(VOL, sid))),))  # fmt: skip
    handle = launcher.create(spec)
    try:
        # Written through the guest's page cache only (no sync): the saved kernel holds it.
        sh(launcher, handle, "echo in-memory > /data/unsynced; echo 41 > /tmp/n")
        sleeper = launcher.open_process(handle, ProcessRequest(argv=["sleep", "600"]))
        assert "sleep 600" in sh(launcher, handle, "ps -o args")
        launcher.checkpoint(handle)
        d = launcher.sandboxes_dir / sid
        assert (d / snapshots.IMAGE).stat().st_size > 0
        assert json.loads((d / snapshots.META).read_text())["disks"] == [str(store.image(VOL))]
        assert not launcher.states()[sid].status == "running"
        # The volume stays the checkpoint's: the host must not mount (and so change) it.
        assert volumes.holder(store.image(VOL)) == sid
        with pytest.raises(VolumeError, match=sid):
            store.mount(VOL)
        time.sleep(3)
        store.attach_as_disk(VOL, sid)  # the node's part of a resume (the same sandbox: a no-op)
        handle = launcher.restore(spec)
        assert not (d / snapshots.IMAGE).exists()  # it runs on from here
        assert volumes.holder(store.image(VOL)) == sid
        assert sh(launcher, handle, "cat /data/unsynced; cat /tmp/n") == "in-memory\n41\n"
        assert "sleep 600" in sh(launcher, handle, "ps -o args")
        sleeper.close()
        # Its clock is the host's, not the moment it was saved (3 s and more ago).
        guest = int(sh(launcher, handle, "date +%s"))
        assert abs(guest - time.time()) < 2, (guest, time.time())
    finally:
        launcher.destroy(launcher.handle_for(sid))
    assert_nothing_left(launcher, sid)
    assert volumes.holder(store.image(VOL)) is None
    assert (store.mount(VOL) / "unsynced").read_text() == "in-memory\n"


def test_a_restore_that_does_not_fit_the_checkpoint_discards_it(launcher, busybox):
    """QEMU's devices must be the saved ones: a sandbox whose memory (or network, or volumes)
    differs now is refused before QEMU starts, and the checkpoint goes (the node then starts
    the sandbox afresh over its disk)."""
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=192)
    handle = launcher.create(spec)
    try:
        sh(launcher, handle, "echo kept > /root/f && sync")
        launcher.checkpoint(handle)
        bigger = SandboxSpec(id=spec.id, rootfs=busybox.rootfs, memory_mb=256)
        with pytest.raises(LauncherError, match="memory or CPUs changed"):
            launcher.restore(bigger)
        with pytest.raises(LauncherError, match="no checkpoint"):
            launcher.restore(spec)
        handle = launcher.create(bigger)  # afresh, over its disk
        assert sh(launcher, handle, "cat /root/f") == "kept\n"
    finally:
        launcher.destroy(launcher.handle_for(spec.id))


def test_checkpoint_needs_a_running_vm(launcher, busybox):
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=128)
    handle = launcher.create(spec)
    launcher.suspend(handle)
    try:
        with pytest.raises(LauncherError, match="not running"):
            launcher.checkpoint(launcher.handle_for(spec.id))
    finally:
        launcher.destroy(launcher.handle_for(spec.id))
