"""Lifecycle, scheduling, reconciliation and node routing, through the services with real
runsc and a real Celery worker."""

from __future__ import annotations

import subprocess
import threading
import time
from datetime import timedelta

import pytest
from django.utils import timezone

from runtime import lifecycle
from runtime.errors import Conflict, NoCapacity
from runtime.models import Image, Node, Sandbox, Team
from runtime.node import sandboxes as node_svc
from runtime.node.local import launcher_for
from runtime.services import sandbox_calls as calls_svc
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as svc
from runtime.services.nodes import node_pick, node_register, nodes_mark_lost
from runtime.services.sandbox_access import RemoteAccess, sandbox_access
from tests.support import GVISOR, requires_runsc, wait_until

S = Sandbox.Status


@pytest.fixture
def team(transactional_db):
    return Team.objects.create(name="t")


def _create(team, **kw):
    spec = svc.SandboxRequest(image="busybox", memory_mb=kw.pop("memory_mb", 256), **kw)
    sandbox = svc.sandbox_create(team=team, user=None, request=spec)
    return svc.sandbox_wait(sandbox=sandbox, timeout=60)


# -- state machine ----------------------------------------------------------------------------


def test_transitions_are_conditional(transactional_db, team):
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x")
    assert lifecycle.transition(sb.id, to=S.STARTING, frm=[S.PENDING]) is True
    # A duplicated task finds the row already moved and changes nothing.
    assert lifecycle.transition(sb.id, to=S.STARTING, frm=[S.PENDING]) is False
    assert Sandbox.objects.get(id=sb.id).status == S.STARTING
    assert sb.events.filter(kind="status").count() == 1


def test_illegal_transitions_are_refused(transactional_db, team):
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x")
    with pytest.raises(ValueError):
        lifecycle.transition(sb.id, to=S.RUNNING, frm=[S.DELETED])
    assert lifecycle.transition(sb.id, to=S.RUNNING) is False  # pending cannot jump to running


# -- scheduler --------------------------------------------------------------------------------


def _image(*nodes: Node) -> Image:
    image = Image.objects.create(name="img", digest="sha256:abc")
    image.nodes.add(*nodes)
    return image


def test_activity_pushes_expiry_out_but_never_in(transactional_db, team):
    now = timezone.now()
    soon = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="running",
                                  timeout_s=600, expires_at=now + timedelta(seconds=30))  # fmt: skip
    later = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="running",
                                   timeout_s=600, expires_at=now + timedelta(hours=5))  # fmt: skip
    stopped = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="stopped",
                                     timeout_s=600, expires_at=now + timedelta(seconds=30))  # fmt: skip
    moved = svc.sandboxes_touch(sandbox_ids=[soon.id, later.id, stopped.id, "sbnosuch"])
    assert moved == [soon.id]
    soon.refresh_from_db()
    assert soon.expires_at >= now + timedelta(seconds=599)
    later.refresh_from_db()
    assert later.expires_at == now + timedelta(hours=5)  # a later expiry is never brought closer
    stopped.refresh_from_db()
    assert stopped.expires_at == now + timedelta(seconds=30)


def test_scheduler_picks_the_node_with_most_room(transactional_db, team):
    small = node_register(name="small", launchers=GVISOR, cpu=2, memory_mb=1024)
    big = node_register(name="big", launchers=GVISOR, cpu=2, memory_mb=8192)
    image = _image(small, big)
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image) == big
    Sandbox.objects.create(
        team=team, image="img", image_digest="sha256:abc", node=big, memory_mb=7800, status=S.RUNNING
    )
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image) == small


def test_scheduler_refuses_when_no_node_has_room(transactional_db, team):
    node = node_register(name="n1", launchers=GVISOR, cpu=1, memory_mb=1024)
    image = _image(node)
    Sandbox.objects.create(
        team=team, image="img", image_digest="sha256:abc", node=node, memory_mb=1000, status=S.RUNNING
    )
    with pytest.raises(NoCapacity, match="^no node: 1 full on memory$"):
        node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image)
    with pytest.raises(NoCapacity, match="^no node: 1 lack runtime microvm; ready nodes run gvisor$"):
        node_pick(runtime="microvm", cpu=1, memory_mb=512, image=image)


def test_scheduler_skips_nodes_short_of_disk_and_heartbeats_report_it(transactional_db, settings):
    """Sandbox disks are thin: a node whose sandboxes' filesystem is nearly full gets no new ones."""
    from runtime.services.nodes import local_disk_free_mb, node_heartbeat

    settings.HANGAR_NODE_MIN_FREE_DISK_MB = 2048
    full = node_register(name="full", launchers=GVISOR, cpu=4, memory_mb=65536, disk_free_mb=100)
    roomy = node_register(name="roomy", launchers=GVISOR, cpu=4, memory_mb=4096, disk_free_mb=50_000)
    image = _image(full, roomy)
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == roomy  # not the one with memory
    Node.objects.filter(id=roomy.id).update(disk_free_mb=1000)
    with pytest.raises(NoCapacity, match=r"^no node: 2 full on disk \(under 2048 MB free\)$"):
        node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image)
    # The heartbeat says what is free where this node keeps sandboxes.
    free = local_disk_free_mb()
    assert free is not None and free > 0
    assert node_heartbeat(name="full", disk_free_mb=free)
    assert Node.objects.get(id=full.id).disk_free_mb == free
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == full or free < 2048


def test_scheduler_skips_nodes_without_the_image_or_heartbeat(transactional_db):
    holder = node_register(name="holder", launchers=GVISOR, cpu=4, memory_mb=4096)
    node_register(name="other", launchers=GVISOR, cpu=4, memory_mb=65536)
    image = _image(holder)
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == holder
    Node.objects.filter(name="holder").update(heartbeat_at=timezone.now() - timedelta(minutes=10))
    assert nodes_mark_lost() == ["holder"]
    with pytest.raises(NoCapacity, match="^no node: 1 lost, 1 lack image img$"):
        node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image)


# -- provisioning, expiry, reconciliation -----------------------------------------------------


@requires_runsc
def test_duplicate_provision_tasks_are_harmless(celery_worker, local_node, team):
    sb = _create(team)
    assert sb.status == S.RUNNING
    node_svc.node_sandbox_start(sandbox_id=sb.id)  # a redelivered task
    sb.refresh_from_db()
    assert sb.status == S.RUNNING
    assert sb.id in launcher_for("gvisor").states()


@requires_runsc
def test_a_start_its_worker_died_in_is_undone_and_started_again_twice_at_most(
    celery_worker, local_node, team
):
    """A worker started again (node_recover) takes back a start its predecessor died in: what
    the runtime had made of it goes, the row goes back to pending and its start is sent again;
    a third interrupted start fails with the reason instead of looping."""
    sb = _create(team)
    launcher = launcher_for("gvisor")
    # The worker died after the runtime came up, before the row said running.
    Sandbox.objects.filter(id=sb.id).update(status=S.STARTING)
    report = node_svc.node_recover(node_name=local_node.name)
    assert report["restarted"] == [sb.id] and sb.id in report["resent"]
    sb = svc.sandbox_wait(sandbox=sb, timeout=60)
    assert sb.status == S.RUNNING, sb.status_reason
    assert sb.events.filter(status_from=S.STARTING, status_to=S.PENDING).count() == 1
    for _ in range(2):
        Sandbox.objects.filter(id=sb.id).update(status=S.STARTING)
        node_svc.node_recover(node_name=local_node.name)
        sb = svc.sandbox_wait(sandbox=sb, timeout=60)
    assert sb.status == S.FAILED and "interrupted 3 times" in sb.status_reason, sb.status_reason
    wait_until(lambda: sb.id not in launcher.states(), 30, what="the runtime gone")


def test_a_start_that_began_after_the_worker_started_is_its_own_and_left_alone(local_node, team, monkeypatch):
    """node_recover runs as one of the new worker's tasks, beside a start it has already taken
    (a sandbox placed on the node while its worker was starting): that start is not undone."""
    sent: list[str] = []
    monkeypatch.setattr(node_svc, "resend", lambda row: sent.append(row.id))
    mine = Sandbox.objects.create(
        team=team, image="x", image_digest="sha256:x", node=local_node, status=S.STARTING
    )
    queued = Sandbox.objects.create(
        team=team, image="x", image_digest="sha256:x", node=local_node, status=S.PENDING
    )
    report = node_svc.node_recover(
        node_name=local_node.name, worker_started_at=timezone.now() - timedelta(seconds=5)
    )
    assert report == {"restarted": [], "failed": [], "resent": []} and not sent
    assert Sandbox.objects.get(id=mine.id).status == S.STARTING
    # The same rows as the predecessor left them (changed before this worker started): taken back.
    Sandbox.objects.filter(id__in=[mine.id, queued.id]).update(
        updated_at=timezone.now() - timedelta(seconds=60)
    )
    report = node_svc.node_recover(
        node_name=local_node.name, worker_started_at=timezone.now() - timedelta(seconds=5)
    )
    assert report["restarted"] == [mine.id] and sorted(report["resent"]) == sorted([mine.id, queued.id])
    assert Sandbox.objects.get(id=mine.id).status == S.PENDING


def test_a_lost_stop_is_sent_again_as_a_stop_and_a_lost_delete_as_a_delete(transactional_db, team):
    stopped = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status=S.RUNNING)
    deleted = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status=S.RUNNING)
    svc.sandbox_stop(sandbox=stopped)
    svc.sandbox_delete(sandbox=deleted)
    for sb in (stopped, deleted):  # no node: their rows moved on at once; as a node's they wait
        Sandbox.objects.filter(id=sb.id).update(status=S.STOPPING)
        sb.refresh_from_db()
    assert svc.waiting_on(stopped) == "halt"
    assert svc.waiting_on(deleted) == "destroy"
    assert svc.waiting_on(Sandbox(status=S.PENDING)) == "provision"


@requires_runsc
def test_expired_sandboxes_are_stopped_and_destroyed(celery_worker, local_node, team):
    sb = _create(team, timeout_s=1)
    assert sb.status == S.RUNNING
    time.sleep(1.2)
    assert svc.sandboxes_reap_expired() == 1
    wait_until(lambda: Sandbox.objects.get(id=sb.id).status == S.DELETED, 30, what="deleted")
    assert sb.id not in launcher_for("gvisor").states()
    assert sb.events.filter(message__startswith="expired").exists()


@requires_runsc
def test_reconcile_removes_runtime_sandboxes_no_row_owns(celery_worker, local_node, team):
    sb = _create(team)
    Sandbox.objects.filter(id=sb.id).delete()  # the database forgot it
    report = node_svc.node_reconcile(node_name=local_node.name)
    assert sb.id in report["destroyed"]
    assert sb.id not in launcher_for("gvisor").states()


@requires_runsc
def test_reconcile_fails_rows_whose_sandbox_is_gone(celery_worker, local_node, team):
    sb = _create(team)
    launcher = launcher_for("gvisor")
    subprocess.run(
        [launcher.runsc.binary, "--root", str(launcher.runsc.root), "kill", "--all", sb.id, "KILL"],
        check=True,
    )
    report = node_svc.node_reconcile(node_name=local_node.name)
    assert report["failed"] == [sb.id]
    sb.refresh_from_db()
    assert sb.status == S.FAILED and sb.status_reason
    assert sb.id not in launcher.states()


@requires_runsc
def test_reconcile_leaves_a_sandbox_whose_state_runsc_cannot_tell(
    celery_worker, local_node, team, monkeypatch
):
    """A runsc that fails for another reason than "no such sandbox" (a busy host, a lock) says
    nothing about the sandbox: it is neither failed nor destroyed, and stays usable."""
    sb = _create(team)
    launcher = launcher_for("gvisor")
    runsc_type = type(launcher.runsc)
    real_call = runsc_type.__call__

    def flaky(self, *args, **kwargs):
        if args and args[0] == "state":
            return subprocess.CompletedProcess(
                ["runsc", *args], 1, "", "acquiring lock: resource temporarily unavailable"
            )
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(runsc_type, "__call__", flaky)
    assert launcher.states()[sb.id].status == "unknown"
    report = node_svc.node_reconcile(node_name=local_node.name)
    assert sb.id not in report["failed"] and sb.id not in report["destroyed"]
    monkeypatch.setattr(runsc_type, "__call__", real_call)
    sb.refresh_from_db()
    assert sb.status == S.RUNNING, sb.status_reason
    assert io_svc.sandbox_exec(sandbox=sb, cmd="echo still").exec.stdout == "still\n"


@requires_runsc
def test_running_sandboxes_survive_reconciliation(celery_worker, local_node, team):
    sb = _create(team)
    assert node_svc.node_reconcile(node_name=local_node.name) == {
        "failed": [],
        "destroyed": [],
        "volumes_removed": [],
        "networks_removed": [],
    }
    sb.refresh_from_db()
    assert sb.status == S.RUNNING


@requires_runsc
def test_exec_on_another_node_goes_through_its_queue(celery_worker, local_node, team, settings):
    sb = _create(team)
    # This process now plays a control plane on a different machine: every node operation must
    # travel through the node's Celery queue to the worker.
    settings.HANGAR_NODE_NAME = "control-plane-elsewhere"
    sb.refresh_from_db()
    assert isinstance(sandbox_access(sb), RemoteAccess)
    out = io_svc.sandbox_exec(sandbox=sb, cmd="echo remote; echo e >&2; exit 2", stdin=None)
    assert (out.result.exit_code, out.result.stdout, out.result.stderr) == (2, b"remote\n", b"e\n")
    assert io_svc.sandbox_file_write(sandbox=sb, path="/tmp/r.bin", data=b"\x00\xffdata") == 6
    entry, chunks = io_svc.sandbox_file_read(sandbox=sb, path="/tmp/r.bin")
    assert b"".join(chunks) == b"\x00\xffdata" and entry.size == 6
    assert [e.name for e in io_svc.sandbox_file_list(sandbox=sb, path="/tmp")] == ["r.bin"]
    assert io_svc.sandbox_stats(sandbox=sb)["memory_limit_bytes"] == 256 * 1024 * 1024


@requires_runsc
def test_a_write_past_the_file_limit_is_refused_and_leaves_the_file_as_it_was(
    celery_worker, local_node, team, settings
):
    from runtime.errors import TooLarge

    settings.HANGAR_FILE_MAX_BYTES = 9 * 1024 * 1024  # past one 8 MiB part to another node

    def chunks():  # 10 MiB, never announced
        return (b"x" * 65536 for _ in range(160))

    sb = _create(team)
    assert io_svc.sandbox_file_write(sandbox=sb, path="/tmp/f", data=iter([b"old"])) == 3
    with pytest.raises(TooLarge, match="HANGAR_FILE_MAX_BYTES"):
        io_svc.sandbox_file_write(sandbox=sb, path="/tmp/f", data=chunks())
    with pytest.raises(TooLarge):
        io_svc.sandbox_file_write(sandbox=sb, path="/tmp/f", data=iter([]), size=10 * 1024 * 1024)
    assert b"".join(io_svc.sandbox_file_read(sandbox=sb, path="/tmp/f")[1]) == b"old"
    # Through another node's queue: its parts are dropped, the file is untouched.
    settings.HANGAR_NODE_NAME = "control-plane-elsewhere"
    sb.refresh_from_db()
    with pytest.raises(TooLarge):
        io_svc.sandbox_file_write(sandbox=sb, path="/tmp/f", data=chunks())
    assert b"".join(io_svc.sandbox_file_read(sandbox=sb, path="/tmp/f")[1]) == b"old"
    assert not list((settings.DATA_DIR / "uploads").iterdir())


@requires_runsc
def test_exec_on_a_pending_sandbox_is_a_conflict(transactional_db, local_node, team):
    sb = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", node=local_node)
    with pytest.raises(Conflict, match="pending"):
        io_svc.sandbox_exec(sandbox=sb, cmd="true")


@requires_runsc
def test_exec_history_is_recorded_and_truncated(celery_worker, local_node, team, settings):
    settings.HANGAR_EXEC_KEEP_OUTPUT_BYTES = 100
    sb = _create(team)
    out = io_svc.sandbox_exec(sandbox=sb, cmd="head -c 5000 /dev/zero | tr '\\0' a")
    row = out.exec
    assert row.exit_code == 0 and row.stdout_bytes == 5000 and len(row.stdout) == 100
    assert row.finished_at is not None and row.duration_ms > 0
    assert len(out.result.stdout) == 5000


@requires_runsc
def test_reconcile_does_not_fail_a_sandbox_that_started_during_its_snapshot(
    celery_worker, local_node, team, monkeypatch
):
    launcher = launcher_for("gvisor")
    before = launcher.states()  # taken before the sandbox exists
    sb = _create(team)
    assert sb.status == S.RUNNING
    monkeypatch.setattr(launcher, "states", lambda: before)
    real_now = timezone.now

    # The snapshot "was taken" just before the sandbox's row turned running.
    monkeypatch.setattr(svc.timezone, "now", lambda: sb.updated_at - timedelta(milliseconds=1))
    report = node_svc.node_reconcile(node_name=local_node.name)
    monkeypatch.setattr(svc.timezone, "now", real_now)
    assert sb.id not in report["failed"]
    sb.refresh_from_db()
    assert sb.status == S.RUNNING


def test_expiry_and_idle_rules_pause_or_delete_and_say_why(transactional_db, team):
    from runtime.models import SandboxEvent

    node = node_register(name="n1", launchers=GVISOR, cpu=4, memory_mb=8192)
    now = timezone.now()

    def sandbox(**fields) -> Sandbox:
        fields.setdefault("expires_at", now + timedelta(hours=1))
        return Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", node=node,
                                      status="running", started_at=now - timedelta(hours=1), **fields)  # fmt: skip

    expired_pause = sandbox(on_expire="pause", expires_at=now - timedelta(seconds=1))
    expired_destroy = sandbox(expires_at=now - timedelta(seconds=1))
    idle = sandbox(idle_timeout_s=600, last_activity_at=now - timedelta(seconds=900))
    busy = sandbox(idle_timeout_s=600, last_activity_at=now - timedelta(seconds=30))
    never_active = sandbox(idle_timeout_s=600)  # idle since it started, an hour ago
    paused = sandbox(on_expire="pause", expires_at=now - timedelta(seconds=1))
    Sandbox.objects.filter(id=paused.id).update(status="paused")

    svc.sandboxes_reap_expired()

    def status(sb: Sandbox) -> str:
        return Sandbox.objects.get(id=sb.id).status

    def last_event(sb: Sandbox) -> str:
        return SandboxEvent.objects.filter(sandbox_id=sb.id).order_by("-id").first().message

    assert status(expired_pause) == "pausing" and "its timeout of 300 s was reached" in last_event(
        expired_pause
    )
    assert status(expired_destroy) == "stopping" and "expired" in last_event(expired_destroy)
    assert status(idle) == "pausing" and "idle for 900 s (idle_timeout_s 600)" in last_event(idle)
    assert status(never_active) == "pausing"
    assert status(busy) == "running"
    assert status(paused) == "paused"  # a paused sandbox does not expire


def test_activity_is_recorded_at_most_every_few_seconds(transactional_db, team):
    sb = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", status="running")
    calls_svc.sandbox_mark_active(sb.id)
    first = Sandbox.objects.get(id=sb.id).last_activity_at
    assert first is not None
    calls_svc.sandbox_mark_active(sb.id)
    assert Sandbox.objects.get(id=sb.id).last_activity_at == first  # throttled
    Sandbox.objects.filter(id=sb.id).update(last_activity_at=first - timedelta(seconds=10))
    calls_svc.sandbox_mark_active(sb.id)
    assert Sandbox.objects.get(id=sb.id).last_activity_at > first - timedelta(seconds=10)


def test_activity_is_not_written_when_the_loaded_row_says_it_is_recent(transactional_db, team):
    sb = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", status="running")
    recent = timezone.now() - timedelta(seconds=1)
    calls_svc.sandbox_mark_active(sb.id, recent)  # the caller's row: active a second ago
    assert Sandbox.objects.get(id=sb.id).last_activity_at is None  # nothing written
    calls_svc.sandbox_mark_active(sb.id, timezone.now() - timedelta(seconds=30))
    assert Sandbox.objects.get(id=sb.id).last_activity_at is not None


# -- robustness: tasks cut short by a dead worker ------------------------------------------


def test_reconcile_removes_volume_data_no_row_owns(celery_worker, local_node, team):
    from runtime.node.local import volume_store
    from runtime.services import volumes as volume_svc

    kept = volume_svc.volume_create(team=team, name="kept", size_mb=16)
    store = volume_store()
    store.create("volorphan00000", 16)  # a create whose row went away (or never committed)
    store.mount("volorphan00000")
    report = node_svc.node_reconcile(node_name=local_node.name)
    assert report["volumes_removed"] == ["volorphan00000"]
    assert store.list() == [kept.id] and not store.mountpoint("volorphan00000").exists()
    with open("/proc/self/mountinfo") as f:
        assert "volorphan00000" not in f.read()


@requires_runsc
@pytest.mark.parametrize("died", ["after the quiesce", "after the checkpoint", "before anything"])
def test_a_checkpoint_pause_cut_short_by_a_dead_worker_is_finished_by_the_resent_task(
    celery_worker, local_node, team, died
):
    from runtime.launchers.base import ExecRequest, ProcessRequest

    sb = _create(team, pause_mode="checkpoint")
    launcher = launcher_for("gvisor")
    launcher.exec(sb.handle, ExecRequest(argv=["sh", "-c", "echo 1 > /root/n"]))
    # A live process, as a background process or terminal is (its stream is re-attached later).
    process = launcher.open_process(sb.handle, ProcessRequest(argv=["sleep", "600"]))
    ended: list = []
    threading.Thread(target=lambda: ended.extend(process.events()), daemon=True).start()
    # The pause was accepted (the row says pausing) and its worker died part-way through.
    assert lifecycle.transition(sb.id, to=S.PAUSING, frm=[S.RUNNING], fields={"paused_mode": "checkpoint"})
    if died == "after the quiesce":  # what the launcher leaves: its marker, a quiesced agent
        (launcher.sandboxes_dir / sb.id / "quiesced").touch()
        launcher.agent(sb.handle).quiesce()
    elif died == "after the checkpoint":
        launcher.checkpoint(sb.handle)
    node_svc.node_sandbox_pause(sandbox_id=sb.id)  # what the reaper sends again
    sb.refresh_from_db()
    assert sb.status == S.PAUSED and sb.paused_mode == "checkpoint", sb.status_reason
    node_svc.node_sandbox_pause(sandbox_id=sb.id)  # and once more: nothing changes
    svc.sandbox_resume(sandbox=sb)
    sb = svc.sandbox_wait(sandbox=sb, timeout=60)
    assert sb.status == S.RUNNING
    assert "resumed from its checkpoint" in sb.events.order_by("-id").values_list("message", flat=True)[0]
    ps = launcher.exec(sb.handle, ExecRequest(argv=["sh", "-c", "cat /root/n; ps -o args"])).stdout.decode()
    assert ps.startswith("1\n") and "sleep 600" in ps  # the process from before the pause runs on
    process.send_signal(9)  # through its re-attached stream
    wait_until(lambda: bool(ended), 10, what="the exit")
    assert ended[-1][1].signal == 9
    node_svc.node_sandbox_resume(sandbox_id=sb.id)  # a duplicated resume task is harmless too
    sb.refresh_from_db()
    assert sb.status == S.RUNNING


@requires_runsc
def test_a_checkpoint_that_fails_falls_back_to_a_stop_pause_and_says_why(celery_worker, local_node, team):
    from runtime.launchers.base import ExecRequest

    sb = _create(team, pause_mode="checkpoint")
    launcher = launcher_for("gvisor")
    launcher.exec(sb.handle, ExecRequest(argv=["sh", "-c", "echo kept > /root/f"]))
    # The sandbox died under the pause: there is nothing left to checkpoint.
    subprocess.run(
        [launcher.runsc.binary, "--root", str(launcher.runsc.root), "kill", "--all", sb.id, "KILL"],
        check=True,
    )
    assert lifecycle.transition(sb.id, to=S.PAUSING, frm=[S.RUNNING], fields={"paused_mode": "checkpoint"})
    node_svc.node_sandbox_pause(sandbox_id=sb.id)
    sb.refresh_from_db()
    assert sb.status == S.PAUSED and sb.paused_mode == "stop"
    assert "checkpoint failed" in sb.status_reason and "its files kept" in sb.status_reason
    svc.sandbox_resume(sandbox=sb)
    sb = svc.sandbox_wait(sandbox=sb, timeout=60)
    assert launcher.exec(sb.handle, ExecRequest(argv=["cat", "/root/f"])).stdout == b"kept\n"
    assert not (launcher.sandboxes_dir / sb.id / "checkpoint").exists()
    assert not (launcher.sandboxes_dir / sb.id / "checkpoint.partial").exists()
