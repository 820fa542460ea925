"""The node's allocation counters (migration 0025): the database keeps them equal to what the
node's sandboxes that hold CPU and memory take, whichever way a sandbox's row changes, and
placement reads them."""

from __future__ import annotations

import importlib

import pytest
from django.db import connection

from runtime.errors import NoCapacity
from runtime.models import Image, Node, Sandbox, Team
from runtime.services.nodes import node_pick, node_register
from runtime.services.placement import ACTIVE
from tests.support import GVISOR

S = Sandbox.Status


@pytest.fixture
def team(transactional_db):
    return Team.objects.create(name="t")


def _counted(node: Node) -> tuple[int, int]:
    return tuple(
        Node.objects.filter(id=node.id).values_list("millicpu_allocated", "memory_mb_allocated").get()
    )


def _summed(node: Node) -> tuple[int, int]:
    rows = Sandbox.objects.filter(node=node, status__in=ACTIVE).values_list("cpu", "memory_mb")
    return sum(round(c * 1000) for c, _ in rows), sum(m for _, m in rows)


def _sandbox(team: Team, node: Node | None, status: str, cpu: float = 0.5, memory_mb: int = 256) -> Sandbox:
    return Sandbox.objects.create(
        team=team,
        image="img",
        image_digest="sha256:abc",
        node=node,
        cpu=cpu,
        memory_mb=memory_mb,
        status=status,
    )


def test_the_migration_holds_the_same_statuses_as_placement():
    migration = importlib.import_module("runtime.migrations.0025_node_allocation_counters")
    assert set(migration.HELD) == {str(s) for s in ACTIVE}


def test_every_way_a_row_changes_moves_the_counters_and_only_then(team):
    a = node_register(name="a", launchers=GVISOR, cpu=8, memory_mb=8192)
    b = node_register(name="b", launchers=GVISOR, cpu=8, memory_mb=8192)

    def check(what: str) -> None:
        for node in (a, b):
            assert _counted(node) == _summed(node), (what, node.name)

    one = _sandbox(team, a, S.PENDING, cpu=0.25, memory_mb=128)
    check("inserted holding")
    assert _counted(a) == (250, 128)
    for status in (S.STARTING, S.RUNNING):  # held to held: the node's row is not touched
        one.status = status
        one.save()
        check(status)
    two = _sandbox(team, a, S.RUNNING, cpu=1.5, memory_mb=1024)
    _sandbox(team, a, S.PAUSED)  # holds nothing
    _sandbox(team, None, S.PENDING)  # no node yet
    check("more")
    assert _counted(a) == (1750, 1152)
    Sandbox.objects.filter(id=two.id).update(status=S.PAUSING)  # a bulk update: still held
    check("pausing")
    Sandbox.objects.filter(id=two.id).update(status=S.PAUSED)  # released
    check("paused")
    assert _counted(a) == (250, 128)
    Sandbox.objects.filter(id=two.id).update(status=S.RESUMING, node=b)  # resumed elsewhere
    check("resumed on b")
    assert _counted(b) == (1500, 1024)
    Sandbox.objects.filter(id=two.id).update(cpu=2, memory_mb=2048)  # resized while held
    check("resized")
    assert _counted(b) == (2000, 2048)
    Sandbox.objects.filter(id=two.id).update(node=a)  # moved while held
    check("moved")
    assert _counted(b) == (0, 0)
    one.status = S.STOPPING  # what placement does not count (it is going)
    one.save()
    check("stopping")
    Sandbox.objects.filter(id=two.id).delete()  # a row deleted while holding
    check("deleted")
    assert _counted(a) == (0, 0)
    with connection.cursor() as cur:  # SQL by hand, past the ORM
        cur.execute(
            "UPDATE runtime_sandbox SET status = 'running' WHERE node_id = %s AND status = 'paused'", [a.id]
        )
    check("by hand")
    assert _counted(a) == (500, 256)
    # A thousand placements' worth of 0.1 CPU add up exactly (thousandths, not floats).
    Sandbox.objects.bulk_create(
        Sandbox(
            team=team, image="img", image_digest="sha256:abc", node=b, cpu=0.1, memory_mb=1, status=S.RUNNING
        )
        for _ in range(1000)
    )
    check("bulk")
    assert _counted(b) == (100_000, 1000)


def test_a_whole_row_save_of_a_node_loaded_earlier_keeps_the_counters(team):
    node = node_register(name="a", launchers=GVISOR, cpu=8, memory_mb=8192)
    stale = Node.objects.get(id=node.id)
    _sandbox(team, node, S.RUNNING, cpu=1, memory_mb=512)
    stale.labels = {"zone": "a"}
    stale.save()
    assert _counted(node) == (1000, 512)
    assert Node.objects.get(id=node.id).labels == {"zone": "a"}


def test_placement_reads_the_counters_and_refuses_past_the_ratio(team, settings):
    settings.HANGAR_MEMORY_OVERCOMMIT = 1.0
    node = node_register(name="a", launchers=GVISOR, cpu=4, memory_mb=1024)
    image, _ = Image.objects.get_or_create(name="img", defaults={"digest": "sha256:abc"})
    image.nodes.add(node)
    for _ in range(4):
        _sandbox(team, node_pick(runtime="gvisor", cpu=0.5, memory_mb=256, image=image), S.PENDING, 0.5, 256)
    assert _counted(node) == (2000, 1024)
    with pytest.raises(NoCapacity, match="full on memory"):
        node_pick(runtime="gvisor", cpu=0.5, memory_mb=256, image=image)
    Sandbox.objects.filter(node=node).update(status=S.DELETED)  # room again
    assert node_pick(runtime="gvisor", cpu=0.5, memory_mb=256, image=image) == node
