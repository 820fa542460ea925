"""The node halves of a paused sandbox's move (runtime/node/moves.py) against the database: the
node it moves to takes the row only while it is still paused where it was (a resume or a
delete that came meanwhile wins and the copy goes), says in an event what happened, adopts
the copy and tells the source to forget its own; the source forgets only what is no longer
its own. The copy itself is stood in for here: tests/launchers/gvisor/test_moves.py moves real
sandboxes, tests/reliability/test_fleet.py between real nodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime import enqueue
from runtime.models import Node, Sandbox, SandboxEvent, Team
from runtime.node import moves
from runtime.node.local import launcher_for
from runtime.services.nodes import node_register
from tests.support import GVISOR, requires_runsc

pytestmark = [requires_runsc]


@pytest.fixture
def source(local_node) -> Node:
    return node_register(
        name="mv-source", launchers=GVISOR, cpu=2, memory_mb=2048, tunnel_address="127.0.0.1:9"
    )


@pytest.fixture
def paused(source) -> Sandbox:
    team = Team.objects.create(name="movers")
    return Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", runtime="gvisor",
                                  node=source, status="paused", paused_mode="checkpoint")  # fmt: skip


@pytest.fixture
def sent(monkeypatch) -> list[tuple[str, list, str]]:
    calls: list[tuple[str, list, str]] = []
    monkeypatch.setattr(enqueue, "send", lambda task, args, *, queue, **kw: calls.append((task, args, queue)))
    return calls


def _copy_then(meanwhile=None):
    """A stand-in for the copy from the source: a checkpoint's file lands where the real one
    would, and ``meanwhile`` happens to the row while it is being copied."""

    def pull(address: str, sandbox_id: str, into: Path) -> list[str]:
        (into / "checkpoint").mkdir(parents=True)
        (into / "checkpoint" / "checkpoint.img").write_bytes(b"state")
        if meanwhile:
            meanwhile(Sandbox.objects.filter(id=sandbox_id))
        return ["checkpoint/checkpoint.img"]

    return pull


def test_the_node_it_moves_to_takes_the_row_adopts_the_copy_and_the_source_is_told(
    local_node, source, paused, sent, monkeypatch
):
    launcher = launcher_for("gvisor")
    monkeypatch.setattr(moves, "pull", _copy_then())
    try:
        assert moves.node_sandbox_move_in(sandbox_id=paused.id, from_node=source.name) is True
        paused.refresh_from_db()
        assert paused.node == local_node and paused.status == "paused"
        d = launcher.sandboxes_dir / paused.id
        assert (d / "checkpoint" / "checkpoint.img").read_bytes() == b"state" and (d / "moved-in").exists()
        assert not launcher.incoming_dir(paused.id).exists()
        event = SandboxEvent.objects.get(sandbox=paused, kind="moved")
        assert event.message.startswith(
            f"moved from node {source.name} to node {local_node.name}: checkpoint copied"
        )
        assert sent == [("moved_away", [paused.id], source.queue)]
        # A second delivery of the task finds it here already: nothing happens.
        assert moves.node_sandbox_move_in(sandbox_id=paused.id, from_node=source.name) is False
        # This node's copy is its own now: a moved_away meant for the old node leaves it be.
        assert moves.node_sandbox_moved_away(sandbox_id=paused.id) is False and d.exists()
    finally:
        launcher.destroy(launcher.handle_for(paused.id))


@pytest.mark.parametrize("what", ["resumed", "deleted"])
def test_a_move_that_a_resume_or_a_delete_overtook_leaves_the_sandbox_where_it_was(
    local_node, source, paused, sent, monkeypatch, what
):
    launcher = launcher_for("gvisor")
    status = {"resumed": "resuming", "deleted": "stopping"}[what]
    monkeypatch.setattr(moves, "pull", _copy_then(lambda rows: rows.update(status=status)))
    assert moves.node_sandbox_move_in(sandbox_id=paused.id, from_node=source.name) is False
    paused.refresh_from_db()
    assert paused.node == source and paused.status == status
    assert not launcher.incoming_dir(paused.id).exists() and not (launcher.sandboxes_dir / paused.id).exists()
    assert sent == [] and not SandboxEvent.objects.filter(sandbox=paused, kind="moved").exists()


def test_a_copy_that_fails_leaves_it_paused_where_it_was_with_an_event_that_says_why(
    local_node, source, paused, sent, monkeypatch
):
    def pull(address: str, sandbox_id: str, into: Path) -> list[str]:
        raise moves.MoveError(f"cannot reach node's tunnel at {address}: refused")

    monkeypatch.setattr(moves, "pull", pull)
    assert moves.node_sandbox_move_in(sandbox_id=paused.id, from_node=source.name) is False
    paused.refresh_from_db()
    assert paused.node == source and paused.status == "paused"
    event = SandboxEvent.objects.get(sandbox=paused, kind="move_failed")
    assert event.message == (
        f"could not move to node {local_node.name}: cannot reach node's tunnel at 127.0.0.1:9: refused; "
        f"it stays paused on node {source.name}"
    )
    assert sent == []


def test_the_source_forgets_a_sandbox_that_lives_elsewhere_now(local_node, source, paused):
    launcher = launcher_for("gvisor")
    d = launcher.sandboxes_dir / paused.id
    (d / "checkpoint").mkdir(parents=True)  # what a paused sandbox leaves on its node
    Sandbox.objects.filter(id=paused.id).update(node=local_node)
    assert moves.node_sandbox_moved_away(sandbox_id=paused.id) is False and d.exists()  # its own: kept
    Sandbox.objects.filter(id=paused.id).update(node=source)
    assert moves.node_sandbox_moved_away(sandbox_id=paused.id) is True
    assert not d.exists()
