"""Pause and resume (mode stop) against real runsc: processes end, files stay, any number of
times; a paused sandbox holds no CPU or memory and can still be deleted."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

from runtime.models import Sandbox
from runtime.services.nodes import nodes_with_usage
from tests.api.test_processes_api import ndjson
from tests.api.test_sandboxes_api import create
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def run(api, sandbox_id: str, cmd: str) -> dict:
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def volume(api):
    r = api.post("/volumes", json={"name": "keep", "size_mb": 32})
    assert r.status_code == 201, r.text
    return r.json()


def test_five_pause_resume_cycles_keep_files_and_end_processes(api, volume):
    sb = create(api, cpu=1, memory_mb=256, volumes=[{"volume": "keep", "mount_path": "/keep"}])
    sid = sb["id"]
    for cycle in range(1, 6):
        # Each cycle adds a file in the root filesystem and one on the volume, and starts a process.
        out = run(api, sid, f"echo root-{cycle} >> /root/log && echo vol-{cycle} >> /keep/log && sync")
        assert out["exit_code"] == 0, out
        proc = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sleep 600", "background": True}).json()

        r = api.post(f"/sandboxes/{sid}/pause", json={})
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "paused", r.json()
        # Paused: no processes, no room taken on the node, no exec.
        r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"})
        assert r.status_code == 409 and "paused" in r.json()["detail"]
        url = f"/sandboxes/{sid}/processes/{proc['id']}"
        wait_until(lambda u=url: api.get(u).json()["status"] != "running", 30, what="the process to end")
        node = next(n for n in nodes_with_usage() if n.name == settings.HANGAR_NODE_NAME)
        assert not node.cpu_used and not node.memory_used
        assert api.post(f"/sandboxes/{sid}/pause", json={}).status_code == 409  # already paused

        r = api.post(f"/sandboxes/{sid}/resume", json={})
        assert r.status_code == 200 and r.json()["status"] == "running", r.text
        lines = run(api, sid, "cat /root/log; cat /keep/log")["stdout"].split()
        assert lines == [f"root-{i}" for i in range(1, cycle + 1)] + [f"vol-{i}" for i in range(1, cycle + 1)]
        assert "sleep 600" not in run(api, sid, "ps -o args")["stdout"]  # processes did not survive
    assert api.post(f"/sandboxes/{sid}/resume", json={}).status_code == 409  # running already
    kinds = [e["message"] for e in api.get(f"/sandboxes/{sid}/events").json()]
    assert sum("paused: processes ended" in k for k in kinds) == 5


def test_an_ephemeral_sandbox_keeps_only_its_volumes(api, volume):
    sb = create(api, ephemeral=True, volumes=[{"volume": "keep", "mount_path": "/keep"}])
    assert sb["ephemeral"] is True
    run(api, sb["id"], "echo gone > /root/f; echo kept > /keep/f; sync")
    assert api.post(f"/sandboxes/{sb['id']}/pause", json={}).json()["status"] == "paused"
    assert api.post(f"/sandboxes/{sb['id']}/resume", json={}).json()["status"] == "running"
    assert run(api, sb["id"], "cat /root/f 2>&1; cat /keep/f")["stdout"].splitlines() == [
        "cat: can't open '/root/f': No such file or directory",
        "kept",
    ]


def test_a_paused_sandbox_can_be_deleted_and_leaves_nothing(api):
    from runtime.node.local import launcher_for

    sb = create(api)
    assert api.post(f"/sandboxes/{sb['id']}/pause", json={"mode": "stop"}).json()["status"] == "paused"
    assert api.post(f"/sandboxes/{sb['id']}/pause", json={"mode": "hibernate"}).status_code == 422
    assert api.delete(f"/sandboxes/{sb['id']}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "deleted", 30, what="delete")
    assert sb["id"] not in launcher_for("gvisor").states()
    assert not os.path.exists(launcher_for("gvisor").sandboxes_dir / sb["id"])
    assert Sandbox.objects.get(id=sb["id"]).status == "deleted"


def test_an_idle_sandbox_is_paused_with_the_reason_and_activity_keeps_one_awake(api):
    from datetime import timedelta

    from django.utils import timezone

    from runtime.services import sandboxes as svc

    idle = create(api, idle_timeout_s=60)
    busy = create(api, idle_timeout_s=60)
    assert idle["idle_timeout_s"] == 60 and idle["on_expire"] == "destroy"
    long_ago = timezone.now() - timedelta(seconds=120)
    Sandbox.objects.filter(id__in=[idle["id"], busy["id"]]).update(
        last_activity_at=long_ago, started_at=long_ago
    )
    run(api, busy["id"], "true")  # an exec is activity
    svc.sandboxes_reap_expired()  # what beat runs every few seconds
    wait_until(
        lambda: api.get(f"/sandboxes/{idle['id']}").json()["status"] == "paused", 30, what="the idle pause"
    )
    assert api.get(f"/sandboxes/{busy['id']}").json()["status"] == "running"
    messages = [e["message"] for e in api.get(f"/sandboxes/{idle['id']}/events").json()]
    assert any("idle for" in m and "idle_timeout_s 60" in m for m in messages), messages
    # Nothing was lost: it resumes.
    assert api.post(f"/sandboxes/{idle['id']}/resume", json={}).json()["status"] == "running"


def test_expiry_and_idle_settings_are_validated(api):
    r = api.post("/sandboxes", json={"image": "busybox", "on_expire": "explode"})
    assert r.status_code == 422 and "on_expire" in r.json()["detail"]
    r = api.post("/sandboxes", json={"image": "busybox", "idle_timeout_s": 5})
    assert (
        r.status_code == 422
        and "idle_timeout_s: Input should be greater than or equal to 10" in r.json()["detail"]
    )


# -- checkpoint mode --------------------------------------------------------------------------


def _output(api, sid: str, proc_id: int) -> str:
    events = ndjson(api, "GET", f"/sandboxes/{sid}/processes/{proc_id}/output", params={"follow": False})
    return "".join(e["data"] for e in events if e["type"] == "stdout")


def test_five_checkpoint_cycles_keep_processes_memory_files_and_output(api, volume):
    sb = create(api, cpu=1, memory_mb=256, pause_mode="checkpoint",
                volumes=[{"volume": "keep", "mount_path": "/keep"}])  # fmt: skip
    sid = sb["id"]
    assert sb["pause_mode"] == "checkpoint" and sb["paused_mode"] == ""
    # A counter whose count lives only in its shell's memory, as a background process.
    counter = api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": "i=0; while :; do i=$((i+1)); echo $i; echo $i > /root/c.new; mv /root/c.new /root/count; sleep 0.05; done",
        "background": True}).json()  # fmt: skip
    wait_until(lambda: _output(api, sid, counter["id"]).count("\n") >= 3, 30, what="the counter to count")
    for cycle in range(1, 6):
        assert (
            run(api, sid, f"echo root-{cycle} >> /root/log && echo vol-{cycle} >> /keep/log")["exit_code"]
            == 0
        )
        before = int(run(api, sid, "cat /root/count")["stdout"])

        r = api.post(f"/sandboxes/{sid}/pause", json={})  # the sandbox's pause_mode: checkpoint
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "paused" and r.json()["paused_mode"] == "checkpoint", r.json()[
            "status_reason"
        ]
        node = next(n for n in nodes_with_usage() if n.name == settings.HANGAR_NODE_NAME)
        assert not node.cpu_used and not node.memory_used  # it holds no CPU or memory
        assert api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 409
        assert api.get(f"/sandboxes/{sid}/processes/{counter['id']}").json()["status"] == "running"

        r = api.post(f"/sandboxes/{sid}/resume", json={})
        assert r.status_code == 200 and r.json()["status"] == "running", r.text
        assert r.json()["paused_mode"] == ""
        after = int(run(api, sid, "cat /root/count")["stdout"])
        assert before <= after < before + 60, (before, after)  # counting on from where it was
        lines = run(api, sid, "cat /root/log; cat /keep/log")["stdout"].split()
        assert lines == [f"root-{i}" for i in range(1, cycle + 1)] + [f"vol-{i}" for i in range(1, cycle + 1)]
    # Its output streamed on through every pause, whole: 1, 2, 3, ... with nothing repeated.
    wait_until(
        lambda: int(_output(api, sid, counter["id"]).split()[-1]) > after, 30, what="output after resume"
    )
    numbers = [int(n) for n in _output(api, sid, counter["id"]).split()]
    assert numbers == list(range(1, len(numbers) + 1))
    messages = [e["message"] for e in api.get(f"/sandboxes/{sid}/events").json()]
    assert sum("paused: checkpointed" in m for m in messages) == 5
    assert sum("resumed from its checkpoint" in m for m in messages) == 5
    r = api.post(f"/sandboxes/{sid}/processes/{counter['id']}/signal", json={"signal": "KILL"})
    assert r.status_code == 202, r.text
    wait_until(lambda: api.get(f"/sandboxes/{sid}/processes/{counter['id']}").json()["status"] != "running",
               30, what="the counter to end")  # fmt: skip


def test_checkpoint_mode_per_call_and_its_refusals(api):
    from runtime.node.local import launcher_for

    sb = create(api)  # pause_mode stop by default; a call may still ask for a checkpoint
    assert sb["pause_mode"] == "stop"
    run(api, sb["id"], "echo 41 > /root/n")
    shell = api.post(f"/sandboxes/{sb['id']}/exec", json={
        "cmd": "read x; echo got-$x-$(cat /root/n)", "background": True, "stdin_open": True}).json()  # fmt: skip
    r = api.post(f"/sandboxes/{sb['id']}/pause", json={"mode": "checkpoint"})
    assert r.json()["paused_mode"] == "checkpoint", r.text
    assert (launcher_for("gvisor").sandboxes_dir / sb["id"] / "checkpoint").is_dir()
    assert api.post(f"/sandboxes/{sb['id']}/resume", json={}).json()["status"] == "running"
    # The process, blocked on its stdin across the pause, takes input and finishes.
    url = f"/sandboxes/{sb['id']}/processes/{shell['id']}"
    wait_until(lambda: api.post(f"{url}/stdin", json={"data": "hi\n"}).status_code == 202, 10, what="stdin")
    wait_until(lambda: api.get(url).json()["status"] == "exited", 30, what="the process to finish")
    assert _output(api, sb["id"], shell["id"]) == "got-hi-41\n"
    assert not (launcher_for("gvisor").sandboxes_dir / sb["id"] / "checkpoint").exists()  # disk freed

    # An ephemeral sandbox keeps nothing outside its volumes: it cannot be checkpointed.
    r = api.post("/sandboxes", json={"image": "busybox", "ephemeral": True, "pause_mode": "checkpoint"})
    assert r.status_code == 422 and "ephemeral" in r.json()["detail"], r.text
    eph = create(api, ephemeral=True)
    r = api.post(f"/sandboxes/{eph['id']}/pause", json={"mode": "checkpoint"})
    assert r.status_code == 422 and "mode stop" in r.json()["detail"], r.text

    # Deleting a checkpointed sandbox removes its checkpoint with everything else.
    assert api.post(f"/sandboxes/{sb['id']}/pause", json={"mode": "checkpoint"}).json()["status"] == "paused"
    assert api.delete(f"/sandboxes/{sb['id']}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "deleted", 30, what="delete")
    assert not os.path.exists(launcher_for("gvisor").sandboxes_dir / sb["id"])
