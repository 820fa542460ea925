"""Volumes on the host, as a microVM holds them: a volume attached to a VM as a disk is mounted
by the guest's kernel, so the host must not mount it meanwhile, nor a second VM attach it. Real
ext4 images and real mounts (root); the VM's QEMU is stood in for by a process of our own (the
VM itself is tests/launchers/microvm/test_volumes.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.host import volumes
from runtime.host.volumes import VolumeError, VolumeStore
from tests.support import volume_store

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop mounts)")

VOL = "volhost0001"


@pytest.fixture
def store(tmp_path) -> Iterator[VolumeStore]:
    with volume_store(tmp_path / "volumes", **{VOL: 32}) as s:
        yield s


@pytest.fixture
def process() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing in for a VM's QEMU."""
    p = subprocess.Popen(["sleep", "300"])
    yield p
    p.kill()
    p.wait()


def test_a_held_volume_is_not_mounted_on_the_host_nor_attached_to_another_vm(store, process):
    image = store.attach_as_disk(VOL, "sbone")
    assert image == store.image(VOL)
    volumes.hold(image, "sbone", process.pid)
    assert volumes.holder(image) == "sbone"
    with pytest.raises(VolumeError, match="attached as a disk to microVM sandbox sbone"):
        store.mount(VOL)
    with pytest.raises(VolumeError, match="sbone"):
        store.attach_as_disk(VOL, "sbtwo")
    # The same sandbox's start retried while its VM runs: the VM keeps holding it.
    store.attach_as_disk(VOL, "sbone")
    assert json.loads(volumes.holder_path(image).read_text())["pid"] == process.pid
    with pytest.raises(VolumeError, match="sbone"):
        volumes.hold(image, "sbtwo", os.getpid())
    with pytest.raises(VolumeError, match="sbone"):
        store.delete(VOL)
    volumes.let_go(image, "sbtwo")  # another sandbox's letting go changes nothing
    assert volumes.holder(image) == "sbone"
    volumes.let_go(image, "sbone")
    assert volumes.holder(image) is None
    assert (store.mount(VOL) / ".").is_dir()


def test_a_checkpoint_holds_its_volumes_while_it_is_kept(store, tmp_path):
    """A VM saved with the volume mounted: a filesystem changed meanwhile would not be the one
    its restored kernel knows."""
    checkpoint = tmp_path / "checkpoint.img"
    checkpoint.write_bytes(b"state")
    volumes.hold_for_checkpoint(store.image(VOL), "sbsaved", checkpoint)
    assert volumes.holder(store.image(VOL)) == "sbsaved"
    with pytest.raises(VolumeError, match="sbsaved"):
        store.mount(VOL)
    assert store.usage(VOL).total_bytes > 0  # from the superblock
    checkpoint.unlink()  # restored (or the sandbox deleted): nothing holds it
    assert volumes.holder(store.image(VOL)) is None
    assert store.mount(VOL).is_dir()


def test_a_holder_whose_process_is_gone_holds_nothing(store):
    p = subprocess.Popen(["sleep", "30"])
    volumes.hold(store.image(VOL), "sbgone", p.pid)
    assert volumes.holder(store.image(VOL)) == "sbgone"
    p.kill()
    p.wait()
    assert volumes.holder(store.image(VOL)) is None
    assert store.mount(VOL).is_dir()


def test_attaching_unmounts_from_the_host_and_refuses_while_the_host_still_uses_it(store):
    mnt = store.mount(VOL)
    (mnt / "f").write_text("on the host")
    with open(mnt / "f"):
        with pytest.raises(VolumeError, match="still in use on this node"):
            store.attach_as_disk(VOL, "sbone")
    store.attach_as_disk(VOL, "sbone")
    assert not os.path.ismount(mnt)
    volumes.let_go(store.image(VOL), "sbone")
    assert (store.mount(VOL) / "f").read_text() == "on the host"


def test_while_held_its_use_is_read_from_the_superblock_as_df_counts_it(store, process):
    mnt = store.mount(VOL)
    (mnt / "big").write_bytes(os.urandom(4 * 1024 * 1024))
    mounted = store.usage(VOL)
    store.unmount(VOL)  # the superblock's counts are written at unmount
    volumes.hold(store.image(VOL), "sbone", process.pid)
    held = store.usage(VOL)
    assert held.total_bytes == mounted.total_bytes
    # The same figure, give or take the few blocks the kernel keeps in its own counts.
    assert abs(held.used_bytes - mounted.used_bytes) <= 64 * 1024, (held, mounted)
    assert held.used_bytes >= 4 * 1024 * 1024


def test_the_superblock_of_something_else_is_refused(tmp_path):
    junk = tmp_path / "volnotext4.ext4"
    junk.write_bytes(b"\0" * 4096)
    with pytest.raises(VolumeError, match="no ext4 filesystem"):
        volumes.superblock_usage(junk)
    with pytest.raises(VolumeError, match="cannot read"):
        volumes.superblock_usage(Path(tmp_path / "missing.ext4"))
