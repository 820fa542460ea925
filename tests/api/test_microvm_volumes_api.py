"""Volumes and harnesses with ``runtime: "microvm"`` through the API: a microVM sandbox attaches
its volumes as disks of its own (its kernel mounts them), holds them alone while it lives (a
second attach is a 409, from either runtime), and leaves them whole for the next sandbox; a
harness's workspace is such a volume, so a harness runs in a microVM too. Real VMs under TCG."""

from __future__ import annotations

import pytest

from runtime.launchers.microvm import boot
from tests.api.test_harnesses_api import create as create_harness
from tests.api.test_harnesses_api import sh, wait_run, wait_status
from tests.api.test_sandboxes_api import create
from tests.api.test_volumes_api import delete_and_wait, run
from tests.support import requires_runsc, wait_until

pytestmark = [
    requires_runsc,
    pytest.mark.skipif(boot.missing() is not None, reason=f"no microVM support here: {boot.missing()}"),
    pytest.mark.slow,
]


def test_a_microvm_holds_its_volume_alone_and_leaves_it_whole(api):
    r = api.post("/volumes", json={"name": "vmwork", "size_mb": 64})
    assert r.status_code == 201, r.text
    vm = create(api, runtime="microvm", volumes=[{"volume": "vmwork", "mount_path": "/workspace"}])
    assert vm["status"] == "running" and vm["volumes"][0]["mount_path"] == "/workspace", vm
    out = run(api, vm["id"], "grep ' /workspace ' /proc/mounts; head -c 3000000 /dev/urandom > /workspace/blob; "
              "echo kept > /workspace/note")  # fmt: skip
    assert out["exit_code"] == 0 and " ext4 rw," in out["stdout"], out
    # Its use, as the guest counts it (the host cannot mount it meanwhile).
    used = api.get("/volumes/vmwork").json()["used_bytes"]
    assert used >= 3_000_000, used

    # While the microVM lives the volume is its alone: another sandbox is refused, of either runtime.
    for runtime in ("gvisor", "microvm"):
        r = api.post("/sandboxes", json={"image": "busybox", "runtime": runtime,
                                         "volumes": [{"volume": "vmwork", "mount_path": "/data", "read_only": True}]})  # fmt: skip
        assert r.status_code == 409, r.text
        assert r.json()["sandboxes"] == [vm["id"]] and "alone" in r.json()["detail"], r.text
    assert [sb["id"] for sb in api.get("/sandboxes").json()] == [vm["id"]]  # nothing half-made

    # Paused, it still holds it (its resume needs it); deleted, it lets go, and its writes are there.
    r = api.post(f"/sandboxes/{vm['id']}/pause", json={"mode": "stop", "wait": True})
    assert r.status_code in (200, 202), r.text
    wait_until(lambda: api.get(f"/sandboxes/{vm['id']}").json()["status"] == "paused", 60, what="paused")
    assert api.post("/sandboxes", json={"image": "busybox",
                                        "volumes": [{"volume": "vmwork", "mount_path": "/data"}]}).status_code == 409  # fmt: skip
    r = api.post(f"/sandboxes/{vm['id']}/resume", json={"wait": True})
    assert r.status_code in (200, 202), r.text
    wait_until(lambda: api.get(f"/sandboxes/{vm['id']}").json()["status"] == "running", 90, what="running")
    assert run(api, vm["id"], "cat /workspace/note")["stdout"] == "kept\n"
    delete_and_wait(api, vm["id"])

    # A gVisor sandbox then reads what the microVM wrote (the host mounts the volume again)...
    g = create(api, volumes=[{"volume": "vmwork", "mount_path": "/data"}])
    assert run(api, g["id"], "cat /data/note; wc -c < /data/blob")["stdout"].split() == ["kept", "3000000"]
    # ...and while it lives, a microVM may not take the volume from under it.
    r = api.post("/sandboxes", json={"image": "busybox", "runtime": "microvm",
                                     "volumes": [{"volume": "vmwork", "mount_path": "/data"}]})  # fmt: skip
    assert r.status_code == 409 and r.json()["sandboxes"] == [g["id"]], r.text
    delete_and_wait(api, g["id"])
    assert api.delete("/volumes/vmwork").status_code == 204


def test_a_microvm_paused_in_checkpoint_mode_keeps_its_processes_and_volume(api):
    """Through the API: QEMU saves the VM (memory and devices) and a resume continues it; a
    background process keeps its count in memory and its output stream, a volume stays the
    paused sandbox's (its saved kernel has it mounted)."""
    from tests.api.test_pause_api import _output

    assert api.post("/volumes", json={"name": "ckpt", "size_mb": 32}).status_code == 201
    sb = create(
        api, runtime="microvm", pause_mode="checkpoint", volumes=[{"volume": "ckpt", "mount_path": "/keep"}]
    )
    sid = sb["id"]
    counter = api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": "i=0; while :; do i=$((i+1)); echo $i; echo $i > /root/c.new; mv /root/c.new /root/count; sleep 0.1; done",
        "background": True}).json()  # fmt: skip
    wait_until(lambda: _output(api, sid, counter["id"]).count("\n") >= 3, 30, what="the counter to count")
    for cycle in (1, 2):
        assert run(api, sid, f"echo vol-{cycle} >> /keep/log")["exit_code"] == 0
        before = int(run(api, sid, "cat /root/count")["stdout"])
        r = api.post(f"/sandboxes/{sid}/pause", json={})
        assert r.status_code == 200 and r.json()["paused_mode"] == "checkpoint", r.text
        r = api.post(
            "/sandboxes", json={"image": "busybox", "volumes": [{"volume": "ckpt", "mount_path": "/k"}]}
        )
        assert r.status_code == 409, r.text
        r = api.post(f"/sandboxes/{sid}/resume", json={})
        assert r.status_code == 200 and r.json()["status"] == "running", r.text
        assert "from its checkpoint" in r.json()["status_reason"], r.json()
        after = int(run(api, sid, "cat /root/count")["stdout"])
        assert before <= after < before + 40, (before, after)  # counting on, not from 1
        assert run(api, sid, "cat /keep/log")["stdout"] == "".join(f"vol-{c}\n" for c in range(1, cycle + 1))
    wait_until(
        lambda: int(_output(api, sid, counter["id"]).split()[-1]) > after, 30, what="the stream to go on"
    )
    numbers = [int(n) for n in _output(api, sid, counter["id"]).split()]
    assert numbers == list(range(1, len(numbers) + 1))  # one stream, whole, over both pauses
    delete_and_wait(api, sid)
    assert api.delete("/volumes/ckpt").status_code == 204


def test_a_harness_runs_its_agent_in_a_microvm(api, minimal_image, git_server):
    h = create_harness(api, name="vm", runtime="microvm", repo={"url": git_server})
    assert h["runtime"] == "microvm"
    h = wait_status(api, h["id"], "running", timeout=300)
    sandbox = api.get(f"/sandboxes/{h['sandbox']}").json()
    assert sandbox["runtime"] == "microvm"
    out = sh(
        api, h["sandbox"], "uname -r; grep ' /workspace ' /proc/mounts; cd /workspace && git log --oneline"
    )
    assert (
        boot.kernel().version in out["stdout"] and " ext4 rw," in out["stdout"] and "first" in out["stdout"]
    ), out

    run_ = wait_run(
        api, api.post(f"/harnesses/{h['id']}/runs", json={"prompt": "in a VM"}).json()["id"], timeout=300
    )
    assert run_["status"] == "succeeded" and "+in a VM" in run_["diff"], run_

    # Paused and resumed (the VM stops and boots again), the workspace keeps the run's edit.
    r = api.post(f"/harnesses/{h['id']}/pause", json={"wait": True})
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    r = api.post(f"/harnesses/{h['id']}/resume", json={"wait": True})
    assert r.status_code == 200, r.text
    wait_status(api, h["id"], "running", timeout=300)
    assert "in a VM" in sh(api, h["sandbox"], "cat /workspace/README.md")["stdout"]
    assert api.delete(f"/harnesses/{h['id']}").status_code in (202, 204)


def test_a_harness_asks_for_a_runtime_the_install_has(api, minimal_image):
    r = api.post("/harnesses", json={"name": "nope", "agent": "custom", "command": "true", "image": "minimal",
                                     "runtime": "firecracker"})  # fmt: skip
    assert r.status_code == 422 and "unknown runtime 'firecracker'" in r.text, r.text
