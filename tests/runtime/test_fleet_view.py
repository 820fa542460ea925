"""Placement from each process's view of the fleet (runtime/services/fleet_view.py), when the view
is older than what other processes did: the view only orders the candidates, the row under its
lock decides. A node cordoned, lost or filled since is passed over; one that became placeable
since is found by the read before a refusal; a run of placements from one process spreads on
the view's own counts; and a warm view costs no read of the fleet."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from runtime.errors import NoCapacity
from runtime.models import Image, Node, Sandbox, Team
from runtime.services.fleet_view import VIEW, FleetView
from runtime.services.nodes import node_register
from runtime.services.placement import node_pick, placeable
from tests.support import GVISOR


@pytest.fixture
def aged(settings, transactional_db):
    """A view that stays as it was read for a minute, unless read again on purpose."""
    settings.HANGAR_PLACEMENT_VIEW_S = 60
    VIEW.forget()
    yield
    VIEW.forget()


def _nodes(*names: str, cpu: int = 4, memory_mb: int = 4096) -> tuple[Image, list[Node]]:
    nodes = [node_register(name=n, launchers=GVISOR, cpu=cpu, memory_mb=memory_mb) for n in names]
    image = Image.objects.create(name="img", digest="sha256:abc")
    image.nodes.add(*nodes)
    return image, nodes


def _place(team: Team, image: Image, memory_mb: int = 256, **kw) -> Node:
    with transaction.atomic():
        node = node_pick(runtime="gvisor", cpu=1, memory_mb=memory_mb, image=image, **kw)
        Sandbox.objects.create(team=team, image="img", image_digest="sha256:abc", runtime="gvisor", node=node,
                               cpu=1, memory_mb=memory_mb)  # fmt: skip
    return node


def test_a_node_cordoned_lost_or_filled_since_the_view_was_read_is_passed_over(aged):
    team = Team.objects.create(name="t")
    image, (a, b) = _nodes("view-a", "view-b", memory_mb=8192)
    Node.objects.filter(id=b.id).update(memory_mb_capacity=4096)  # elsewhere: a is the roomier
    VIEW.nodes(placeable, fresh=True)
    assert _place(team, image) == a
    # Another process cordons a (an update: no signal reaches this process's view).
    Node.objects.filter(id=a.id).update(state=Node.State.CORDONED)
    assert _place(team, image) == b
    Node.objects.filter(id=a.id).update(
        state=Node.State.READY, heartbeat_at=timezone.now() - timedelta(hours=1)
    )
    assert _place(team, image) == b  # silent for an hour: offline, whatever the view says
    # Filled by another process: its counters say so under its lock.
    Node.objects.filter(id=a.id).update(heartbeat_at=timezone.now(), memory_mb_allocated=8192 * 4)
    assert _place(team, image) == b


def test_a_node_that_became_placeable_since_is_found_before_a_refusal(aged):
    team = Team.objects.create(name="t")
    image, (a,) = _nodes("view-only", memory_mb=1024)
    VIEW.nodes(placeable, fresh=True)
    # A node joins through another process: not in this view, which a has no room for.
    late = Node.objects.create(name="view-late", launchers=GVISOR, cpu_capacity=4, memory_mb_capacity=8192,
                               state=Node.State.READY, heartbeat_at=timezone.now())  # fmt: skip
    Image.nodes.through.objects.create(image_id=image.id, node_id=late.id)
    VIEW._read_at = time.monotonic()  # as if nothing had told this process
    assert _place(team, image, memory_mb=2048) == late
    Node.objects.filter(id=late.id).update(state=Node.State.CORDONED)
    with pytest.raises(NoCapacity, match="no node: .*cordoned"):
        _place(team, image, memory_mb=2048)


def test_placements_from_one_process_spread_on_the_views_counts_without_reading_the_fleet(aged, monkeypatch):
    team = Team.objects.create(name="t")
    image, nodes = _nodes("spread-a", "spread-b", "spread-c")
    VIEW.nodes(placeable, fresh=True)
    reads = []
    original = FleetView._read
    monkeypatch.setattr(FleetView, "_read", lambda self, qs: (reads.append(1), original(self, qs)))
    placed = [_place(team, image).name for _ in range(6)]
    assert sorted(placed) == ["spread-a", "spread-a", "spread-b", "spread-b", "spread-c", "spread-c"]
    assert reads == []  # six placements, no read of the fleet


def test_a_node_saved_in_this_process_is_seen_at_once(aged):
    team = Team.objects.create(name="t")
    image, (a,) = _nodes("seen-a", memory_mb=2048)
    assert _place(team, image) == a
    b = node_register(name="seen-b", launchers=GVISOR, cpu=4, memory_mb=65536)  # its save tells the view
    image.nodes.add(b)  # and so does its image
    assert _place(team, image) == b
