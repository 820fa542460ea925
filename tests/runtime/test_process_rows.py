"""What the node's bridge writes to a live exec's row, each in one statement: its pid as it
starts (once), and its outcome when it ends (once, only over a running row), before it sends the
exit; then it announces the end to who listens (real Postgres)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from runtime import events, streams
from runtime.models import Exec, Sandbox, Team
from runtime.services.processes import process_end_announce, process_record_end, process_record_pid


@pytest.fixture
def row(db) -> Exec:
    team = Team.objects.create(name="t")
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="running")
    return Exec.objects.create(
        sandbox=sb,
        kind=Exec.Kind.BACKGROUND,
        status=Exec.Status.RUNNING,
        argv=["true"],
        started_at=timezone.now(),
    )


def test_pid_is_written_once(row):
    process_record_pid(key=streams.exec_key(row.id), pid=42)
    process_record_pid(key=streams.exec_key(row.id), pid=43)
    row.refresh_from_db()
    assert row.pid == 42


def test_end_writes_status_code_output_and_times(row):
    ring = streams.OutputRing(1024)
    ring.append("stdout", b"hello\n")
    ring.append("stderr", b"oops")
    info = {"exit_code": 3, "signal": 0, "timed_out": False}
    process_record_end(key=streams.exec_key(row.id), info=info, ring=ring, duration_ms=12.5)
    row.refresh_from_db()
    assert (row.status, row.exit_code, row.signal, row.timed_out) == (Exec.Status.EXITED, 3, 0, False)
    assert (row.stdout, row.stderr, row.stdout_bytes, row.stderr_bytes) == ("hello\n", "oops", 6, 4)
    assert row.duration_ms == 12.5 and row.error == ""
    assert row.finished_at is not None and row.finished_at >= row.started_at


def test_end_without_a_status_is_a_failure_with_its_reason(row):
    info = {"exit_code": None, "signal": 9, "timed_out": True, "error": "stream failed"}
    process_record_end(key=streams.exec_key(row.id), info=info, ring=streams.OutputRing(16), duration_ms=1.0)
    row.refresh_from_db()
    assert (row.status, row.exit_code, row.signal, row.timed_out, row.error) == (
        Exec.Status.FAILED, None, 9, True, "stream failed",
    )  # fmt: skip


def test_end_is_written_once(row):
    key = streams.exec_key(row.id)
    process_record_end(key=key, info={"exit_code": 0}, ring=streams.OutputRing(16), duration_ms=1.0)
    process_record_end(key=key, info={"exit_code": 1}, ring=streams.OutputRing(16), duration_ms=2.0)
    row.refresh_from_db()
    assert (row.exit_code, row.duration_ms) == (0, 1.0)


def test_recording_the_end_announces_nothing_and_the_announcement_names_the_exec(row, monkeypatch):
    heard: list[int] = []
    monkeypatch.setattr(events.process_ended, "receivers", [lambda *, exec_id: heard.append(exec_id)])
    process_record_end(
        key=streams.exec_key(row.id), info={"exit_code": 0}, ring=streams.OutputRing(16), duration_ms=1
    )
    assert heard == []
    process_end_announce(key=streams.exec_key(row.id))
    process_end_announce(key=streams.terminal_key("tm1"))
    assert heard == [row.id]


def test_a_follower_of_an_ended_process_the_bridge_says_nothing_about_gets_the_rows_output(
    transactional_db, monkeypatch
):
    """The node's bridge busy (or gone with its node) and the row ended: the follower answers
    with what the row kept as soon as its first check finds no word, not after a minute."""
    import asyncio
    import time

    from channels.layers import InMemoryChannelLayer

    from runtime.services import processes as proc_svc
    from runtime.services.channel_layer import LAYER

    team = Team.objects.create(name="t")
    sb = Sandbox.objects.create(team=team, image="x", image_digest="sha256:x", status="running")
    row = Exec.objects.create(sandbox=sb, kind=Exec.Kind.BACKGROUND, status=Exec.Status.EXITED, argv=["true"],
                              stdout="kept\n", exit_code=4, started_at=timezone.now(), finished_at=timezone.now())  # fmt: skip
    monkeypatch.setattr(proc_svc, "BRIDGE_CHECK_S", 0.2)

    async def alive(self) -> None:  # the bridge is there: it just does not answer
        return None

    monkeypatch.setattr(proc_svc._BridgeWatch, "gone", alive)

    async def main() -> tuple[list, float]:
        LAYER.set(InMemoryChannelLayer())
        handle = proc_svc.ProcessHandle(node_name="busy-node", key=streams.exec_key(row.id), row_id=row.id)
        started = time.monotonic()
        seen = [event async for event in handle.follow()]
        return seen, time.monotonic() - started

    seen, took = asyncio.run(main())
    assert seen[0] == ("output", "stdout", b"kept\n", 5)
    assert seen[-1][0] == "exit" and seen[-1][1]["exit_code"] == 4
    assert took < 5, f"{took:.1f} s"
