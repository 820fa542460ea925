"""A paused gVisor sandbox moving to another node (what a drain does), between two launchers
of this machine with a state dir, runsc root, cgroups and address pool each, through the move's
own stream (runtime/node/moves.py): its processes, memory and files arrive; its network is the
new node's. The fleet suite (tests/reliability/test_fleet.py) moves one between real nodes."""

from __future__ import annotations

import io
import json
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.host import disks
from runtime.launchers.base import ExecRequest, LauncherError, ProcessRequest, SandboxSpec
from runtime.launchers.gvisor.launcher import GVisorLauncher
from runtime.node import moves
from tests.launchers.gvisor.helpers import assert_nothing_left
from tests.launchers.helpers import remove_all
from tests.support import WORLD_A, requires_runsc

pytestmark = [
    requires_runsc,
    pytest.mark.skipif(
        shutil.which("nft") is None, reason="needs nft (scripts/install-system-deps.sh installs it)"
    ),
]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory, agent_cache_dir) -> Iterator[tuple[GVisorLauncher, GVisorLauncher]]:
    pair = tuple(GVisorLauncher(state_dir=tmp_path_factory.mktemp(f"move-{n}"), agent_cache_dir=agent_cache_dir)
                 for n in "ab")  # fmt: skip
    yield pair  # type: ignore[misc]
    for launcher in pair:
        remove_all(launcher)


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()


def sh(launcher: GVisorLauncher, handle: dict, cmd: str) -> str:
    r = launcher.exec(handle, ExecRequest(argv=["sh", "-c", cmd], timeout=20))
    assert r.exit_code == 0, (cmd, r)
    return bytes(r.stdout).decode().strip()


def move(a: GVisorLauncher, b: GVisorLauncher, sandbox_id: str) -> list[str]:
    """What a drain does, minus the database and the TCP connection: b copies the paused
    sandbox from a, adopts it, and a forgets its own."""
    with a.paused_files(sandbox_id) as files:
        names = moves.decode(io.BytesIO(b"".join(moves.encode(files))), b.incoming_dir(sandbox_id))
    assert sandbox_id not in b.states()  # a copy in progress is no sandbox of b's yet
    b.adopt(sandbox_id)
    a.destroy(a.handle_for(sandbox_id))
    return names


def test_a_checkpointed_sandbox_moves_with_its_processes_memory_and_files_and_takes_the_new_nodes_network(
    nodes, busybox, world
):
    a, b = nodes
    assert not a.network.pool.overlaps(b.network.pool)
    spec = SandboxSpec(id="mv" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                       network={"egress": "all"})  # fmt: skip
    handle = a.create(spec)
    try:
        sh(a, handle, "echo in-memory > /dev/shm/mem; echo on-disk > /root/file")
        counter = a.open_process(handle, ProcessRequest(
            argv=["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count; sleep 0.1; done"], stdin=False,
        ))  # fmt: skip
        time.sleep(0.5)
        before = int(sh(a, handle, "cat /dev/shm/count"))
        a_address = a.network.lease_of(spec.id).sandbox_ip
        a.checkpoint(handle)
        counter.close()

        names = move(a, b, spec.id)
        assert "disk/disk.ext4" in names and "checkpoint/checkpoint.img" in names, names
        # Only the disk's data crossed: a sparse copy, as small as what it holds.
        image = b.sandboxes_dir / spec.id / "disk" / disks.IMAGE
        assert image.stat().st_blocks * 512 < image.stat().st_size // 4
        assert not (a.sandboxes_dir / spec.id).exists() and a.network.lease_of(spec.id) is None

        handle = b.restore(spec)
        assert sh(b, handle, "cat /dev/shm/mem /root/file") == "in-memory\non-disk"
        first = int(sh(b, handle, "cat /dev/shm/count"))
        time.sleep(0.5)
        assert before <= first < int(sh(b, handle, "cat /dev/shm/count"))  # the same process, going on
        lease = b.network.lease_of(spec.id)
        assert lease is not None and lease.sandbox_ip != a_address
        assert f"inet {lease.sandbox_ip}/" in sh(b, handle, "ip addr")
        body = sh(b, handle, f"timeout 3 wget -q -O- http://{WORLD_A}:8080/")
        assert body == "server-a"  # out through b's namespace and rules
        config = json.loads((b.sandboxes_dir / spec.id / "bundle" / "config.json").read_text())
        assert str(b.sandboxes_dir) in config["root"]["path"] and str(a.state_dir) not in json.dumps(config)
    finally:
        for launcher in (a, b):
            launcher.destroy(launcher.handle_for(spec.id))
    assert_nothing_left(b, spec.id)


def test_a_sandbox_paused_without_a_checkpoint_moves_its_files_and_starts_over_them(nodes, busybox):
    a, b = nodes
    spec = SandboxSpec(id="mv" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = a.create(spec)
    try:
        sh(
            a,
            handle,
            "mkdir -p /work && echo kept > /work/a && dd if=/dev/urandom of=/work/blob bs=1M count=3",
        )
        digest = sh(a, handle, "md5sum /work/blob")
        a.suspend(handle)
        assert move(a, b, spec.id) == ["disk/disk.ext4"]
        with pytest.raises(LauncherError, match="no checkpoint"):
            b.restore(spec)  # (a resume then starts it afresh, as here)
        handle = b.create(spec)
        assert sh(b, handle, "cat /work/a") == "kept"
        assert sh(b, handle, "md5sum /work/blob") == digest
    finally:
        for launcher in (a, b):
            launcher.destroy(launcher.handle_for(spec.id))


def test_a_running_sandbox_does_not_move(nodes, busybox):
    a, _ = nodes
    spec = SandboxSpec(id="mv" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = a.create(spec)
    try:
        with pytest.raises(LauncherError, match="runs"), a.paused_files(spec.id):
            pass
        assert sh(a, handle, "echo still") == "still"
    finally:
        a.destroy(handle)


def test_the_stream_holds_only_a_launchers_own_names_and_keeps_holes(tmp_path: Path):
    src = tmp_path / "sparse"
    with open(src, "wb") as f:
        f.seek(64 << 20)
        f.write(b"end")
        f.seek(1 << 20)
        f.write(b"middle")
    stream = b"".join(moves.encode([("disk/disk.ext4", src)]))
    assert len(stream) < 1 << 20  # the holes did not travel
    moves.decode(io.BytesIO(stream), tmp_path / "in")
    out = tmp_path / "in" / "disk" / "disk.ext4"
    assert out.read_bytes() == src.read_bytes() and out.stat().st_blocks * 512 < 1 << 20
    for name in ("../escape", "checkpoint/../../x", "disk/other.img", "/etc/passwd"):
        bad = (
            json.dumps({"path": name, "size": 1}).encode()
            + b"\n"
            + moves.EXTENT.pack(0, 0)
            + b'{"end": true}\n'
        )
        with pytest.raises(moves.MoveError, match="may not hold"):
            moves.decode(io.BytesIO(bad), tmp_path / f"bad-{uuid.uuid4().hex[:6]}")
    truncated = stream[: len(stream) // 2]
    with pytest.raises(moves.MoveError, match="ended"):
        moves.decode(io.BytesIO(truncated), tmp_path / "short")


def test_a_move_request_is_signed_and_expires(settings):
    line = moves.request_line("sb1")
    assert moves.check_request(json.loads(line)) == "sb1"
    body = json.loads(line)
    with pytest.raises(ValueError, match="signature"):
        moves.check_request({**body, "move": "sb2"})
    with pytest.raises(ValueError, match="signature"):
        moves.check_request({**body, "expires": body["expires"] - 100})
    settings.SECRET_KEY = "another hangar's key"
    with pytest.raises(ValueError, match="signature"):
        moves.check_request(body)


def test_a_copy_nothing_has_written_to_for_long_is_swept_and_one_in_progress_is_not(tmp_path: Path):
    import os

    from runtime.launchers.gvisor.moves import sweep

    stale, live = tmp_path / ".incoming-sbold", tmp_path / ".incoming-sbnew"
    for d in (stale, live):
        (d / "disk").mkdir(parents=True)
        (d / "disk" / "disk.ext4").write_bytes(b"x")
    (tmp_path / "sbkept").mkdir()  # a sandbox of the node: never a copy
    hour_ago = time.time() - 3700
    for p in (stale, stale / "disk", stale / "disk" / "disk.ext4", live):
        os.utime(p, (hour_ago, hour_ago))
    # The live copy's directory is old, but its disk is being written to: it stays.
    assert sweep(tmp_path, 3600) == ["sbold"]
    assert not stale.exists() and live.exists() and (tmp_path / "sbkept").exists()
