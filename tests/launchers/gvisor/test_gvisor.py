"""What is gVisor's own in the gVisor launcher: runsc, the sandbox's directory on the host
(console, agent socket directory, agent binary), its cgroups, and how a checkpoint quiesces
the agent and frees what the sandbox held. The runtime-neutral behaviour is the conformance
suite's (tests/launchers/test_conformance.py)."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launchers.agent.protocol import AgentUnavailable
from runtime.launchers.base import ExecRequest, LauncherError, ProcessRequest, SandboxSpec
from runtime.launchers.gvisor.launcher import GVisorLauncher
from runtime.launchers.gvisor.runsc import default_runsc
from tests.launchers.gvisor.helpers import assert_nothing_left, cgroup_dirs, runsc_lists, upper_dir
from tests.launchers.helpers import make_launcher, remove_all, wait_until_true
from tests.support import requires_runsc

pytestmark = [requires_runsc]


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, agent_cache_dir) -> Iterator[GVisorLauncher]:
    launcher = make_launcher("gvisor", tmp_path_factory.mktemp("gvisor"), agent_cache_dir)
    assert isinstance(launcher, GVisorLauncher)
    yield launcher
    remove_all(launcher)


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()


@pytest.fixture
def sandbox(launcher, busybox) -> Iterator[dict]:
    handle = launcher.create(
        SandboxSpec(id="g" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    )
    yield handle
    launcher.destroy(handle)


def run(launcher: GVisorLauncher, handle: dict, script: str):
    return launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script]))


def _drain(process) -> None:
    with contextlib.suppress(LauncherError):  # the end of its stream, when it is closed
        for _ in process.events():
            pass


def test_runsc_is_present():
    assert shutil.which(default_runsc()), "runsc must be installed by .ci/run"


def test_the_probe_says_why_without_runsc():
    assert GVisorLauncher.probe({}) is None
    reason = GVisorLauncher.probe({"runsc": "/nonexistent/runsc"})
    assert reason and "/nonexistent/runsc" in reason and "install" in reason


def test_what_the_sandbox_writes_to_its_console_stays_off_the_hosts_disk(launcher, sandbox):
    # runsc keeps PID 1's stdout and stderr in a host file (log/console.log, a 1 MB tmpfs).
    assert run(launcher, sandbox, "head -c 8388608 /dev/zero > /proc/1/fd/2; echo done").stdout == b"done\n"
    # Outside its root filesystem and its disk (whose size is the limit of what it writes there).
    d = launcher.sandboxes_dir / sandbox["id"]
    total = sum(p.stat().st_blocks * 512 for p in d.rglob("*") if p.is_file()
                and not p.is_relative_to(d / "rootfs") and not p.is_relative_to(d / "disk"))  # fmt: skip
    assert total < 2 << 20, total
    assert len(launcher.console_tail(sandbox)) <= 500


def test_the_sandbox_cannot_fill_the_host_disk_through_the_agent_dir(launcher, sandbox):
    r = run(launcher, sandbox, "dd if=/dev/zero of=/.hangar/run/fill bs=1M count=50; echo rc=$?")
    assert b"rc=0" not in r.stdout
    run(launcher, sandbox, "rm -f /.hangar/run/fill")
    assert run(launcher, sandbox, "echo still answering").stdout == b"still answering\n"


def test_the_agent_binary_is_read_only(launcher, sandbox):
    assert b"rc=0" not in run(launcher, sandbox, "echo x > /.hangar/agent; echo rc=$?").stdout


def test_destroy_leaves_no_directory_runsc_record_or_cgroup(launcher, busybox):
    spec = SandboxSpec(id="g" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    assert runsc_lists(launcher, spec.id) and cgroup_dirs(launcher, spec.id)
    launcher.destroy(launcher.handle_for(spec.id))
    assert_nothing_left(launcher, spec.id)
    launcher.destroy(handle)  # twice is harmless


def test_a_sandbox_whose_checkpoint_did_not_happen_after_its_quiesce_is_reachable_again(launcher, sandbox):
    """What a checkpoint does when the quiesce times out or runsc checkpoint fails: the agent
    stopped listening, and must listen again (regression: gVisor left the host's socket file,
    the agent's bind there failed with EPERM, and the sandbox was unreachable for good)."""
    launcher.quiesce_agent(sandbox)
    with pytest.raises(AgentUnavailable):
        launcher.agent(sandbox).ping()
    for _ in range(2):  # and a second time, as the checkpoint's retries do
        launcher.relisten(sandbox)
        assert run(launcher, sandbox, "echo back").stdout == b"back\n"
        launcher.quiesce_agent(sandbox)
    launcher.relisten(sandbox)
    assert run(launcher, sandbox, "echo again").stdout == b"again\n"


def test_a_checkpoint_freezes_the_files_frees_runsc_and_the_cgroup_and_its_image_goes_after_restore(
    launcher, busybox
):
    spec = SandboxSpec(id="g" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256)
    handle = launcher.create(spec)
    d = launcher.sandboxes_dir / spec.id
    try:
        counter = launcher.open_process(handle, ProcessRequest(
            argv=["sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /c.new; mv /c.new /count; sleep 0.05; done"]))  # fmt: skip
        threading.Thread(target=_drain, args=(counter,), daemon=True).start()
        for cycle in range(2):
            time.sleep(0.3)
            launcher.checkpoint(handle)
            assert (d / "checkpoint").is_dir()
            # Nothing runs: the file it kept writing stays as it was.
            frozen = int((upper_dir(launcher, spec.id) / "count").read_text())
            time.sleep(0.3)
            assert int((upper_dir(launcher, spec.id) / "count").read_text()) == frozen
            if cycle:
                # What the sandbox held is freed in the background after the pause answered:
                # runsc's record of it and its cgroup go (the first cycle restores before that).
                wait_until_true(
                    lambda: not runsc_lists(launcher, spec.id) and not cgroup_dirs(launcher, spec.id), 30
                )
            handle = launcher.restore(spec)
            assert frozen <= int(run(launcher, handle, "cat /count").stdout) < frozen + 40
        # Each restored image is removed (in the background).
        wait_until_true(lambda: not [p.name for p in d.iterdir() if "checkpoint" in p.name], 30)
        counter.close()
    finally:
        launcher.destroy(handle)
    assert_nothing_left(launcher, spec.id)


def test_the_kvm_capability_follows_the_platform(tmp_path: Path):
    assert not GVisorLauncher(state_dir=tmp_path / "a", node_id="aaaaaa").capabilities().kvm
    kvm = GVisorLauncher(state_dir=tmp_path / "b", platform="kvm", node_id="aaaaaa").capabilities()
    assert kvm.kvm and kvm.network and kvm.checkpoint
