"""Placements of one spec in a batch (``node_pick_many``: a warm pool's refill): the same
choice as one placement after another, all or nothing unless partial, never past a node's room
when batches race (real Postgres transactions in threads), decided under each node's lock
whatever the process's view of the fleet says, and a pool's missing members started in one
transaction."""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
from django.db import DatabaseError, OperationalError, connection, transaction

from runtime.errors import NoCapacity
from runtime.models import Node, Pool, Sandbox, Team
from runtime.services import quotas
from runtime.services.fleet_view import VIEW
from runtime.services.placement import node_pick, node_pick_many
from runtime.services.pools import pool_refill
from tests.runtime.test_placement import _image, _node, _run, race

S = Sandbox.Status


@pytest.fixture
def team(transactional_db):
    return Team.objects.create(name="t")


def _counts(nodes: list[Node]) -> dict[str, int]:
    return dict(Counter(n.name for n in nodes))


def _write(team: Team, nodes: list[Node], memory_mb: int = 512) -> None:
    Sandbox.objects.bulk_create(
        Sandbox(team=team, image="img", image_digest="sha256:abc", node=n, cpu=1, memory_mb=memory_mb,
                status=S.PENDING)
        for n in nodes
    )  # fmt: skip


@pytest.mark.parametrize("policy", ["spread", "pack"])
def test_a_batch_goes_where_one_placement_after_another_would(team, settings, policy):
    settings.HANGAR_PLACEMENT = policy
    a, b, c = _node("a", cpu=16), _node("b", cpu=16), _node("c", cpu=16)
    image = _image(a, b, c)
    _run(team, a, memory_mb=3000)
    _run(team, b, memory_mb=1000)
    one_by_one = []
    with transaction.atomic():
        for _ in range(7):
            one_by_one.append(node := node_pick(runtime="gvisor", cpu=1, memory_mb=512, image=image))
            _write(team, [node])
    Sandbox.objects.filter(status=S.PENDING).delete()  # the counters back where they were
    VIEW.forget()
    with transaction.atomic():
        batch = node_pick_many(count=7, runtime="gvisor", cpu=1, memory_mb=512, image=image)
        _write(team, batch)
    assert _counts(batch) == _counts(one_by_one)
    expected = {"c": 4, "b": 3} if policy == "spread" else {"a": 2, "b": 5}
    assert _counts(batch) == expected
    # The database's counters took every row of the batch.
    for node in (a, b, c):
        node.refresh_from_db()
        assert node.memory_mb_allocated == sum(
            Sandbox.objects.filter(node=node, status__in=[S.RUNNING, S.PENDING]).values_list(
                "memory_mb", flat=True
            )
        )


def test_a_batch_is_all_or_nothing_unless_partial(team):
    a, b = _node("a", memory_mb=1024), _node("b", memory_mb=1024)  # 2 of 512 each
    image = _image(a, b)
    _run(team, a, memory_mb=512)  # a: room for one; b: two
    with (
        transaction.atomic(),
        pytest.raises(NoCapacity, match="^no room for 4 such sandboxes: the fleet takes 3 now$"),
    ):
        node_pick_many(count=4, runtime="gvisor", cpu=1, memory_mb=512, image=image)
    with transaction.atomic():
        got = node_pick_many(count=4, partial=True, runtime="gvisor", cpu=1, memory_mb=512, image=image)
        _write(team, got)
    assert _counts(got) == {"a": 1, "b": 2}
    # Nothing left: even a partial batch is refused, with the per-node reasons.
    with transaction.atomic(), pytest.raises(NoCapacity, match="^no node: 2 full on memory$"):
        node_pick_many(count=2, partial=True, runtime="gvisor", cpu=1, memory_mb=512, image=image)


def test_a_node_cordoned_or_filled_after_the_view_was_read_is_decided_under_its_lock(team):
    a, b = _node("a", memory_mb=8192), _node("b", memory_mb=4096)
    image = _image(a, b)
    with transaction.atomic():
        assert node_pick(runtime="gvisor", cpu=1, memory_mb=64, image=image) == a  # the view is read
        transaction.set_rollback(True)
    # Behind the view's back (no signal: another process did it): a cordoned, b half full.
    Node.objects.filter(id=a.id).update(state=Node.State.CORDONED)
    _run(team, b, memory_mb=2048)
    with transaction.atomic():
        got = node_pick_many(count=5, partial=True, runtime="gvisor", cpu=1, memory_mb=512, image=image)
        _write(team, got)
    assert _counts(got) == {"b": 4}


def _race(image, team: Team, workers: int, batch: int, memory_mb: int) -> list[int | str]:
    """``workers`` partial batches at once, each in its own transaction that holds its
    reservations a while before writing the rows: how many each placed, or its refusal."""

    def place() -> int:
        with transaction.atomic():
            got = node_pick_many(count=batch, partial=True, runtime="gvisor", cpu=1, memory_mb=memory_mb,
                                 image=image)  # fmt: skip
            time.sleep(0.05)  # the others plan meanwhile, from the same view
            _write(team, got, memory_mb)
        return len(got)

    return race(workers, place)


@pytest.mark.parametrize("workers,batch", [(2, 4), (8, 3)])
def test_racing_batches_fill_the_fleet_to_its_ratio_and_no_further(team, settings, workers, batch):
    settings.HANGAR_MEMORY_OVERCOMMIT = 1.5
    nodes = [_node(f"n{i}", cpu=64, memory_mb=1000) for i in range(2)]  # 1500 MB each: 3 of 500
    image = _image(*nodes)
    outcomes = _race(image, team, workers=workers, batch=batch, memory_mb=500)
    assert sum(o for o in outcomes if isinstance(o, int)) == 6
    assert set(o for o in outcomes if isinstance(o, str)) <= {"no node: 2 full on memory"}
    for node in nodes:
        assert Sandbox.objects.filter(node=node).count() == 3
        node.refresh_from_db()
        assert node.memory_mb_allocated == 1500


def test_a_pool_starts_its_missing_members_in_one_transaction_as_far_as_quota_and_room_allow(
    team, monkeypatch
):
    sent: list[tuple[str, str, str]] = []
    monkeypatch.setattr("runtime.services.sandboxes._enqueue", lambda *args: sent.append(args))
    a, b = _node("a", cpu=16, memory_mb=2048), _node("b", cpu=16, memory_mb=2048)
    _image(a, b, name="busybox")
    pool = Pool.objects.create(team=team, image="busybox", runtime="gvisor", cpu=1, memory_mb=512, disk_mb=0,
                               size=6)  # fmt: skip
    quotas.limits_set(team=team, values={"sandboxes": 5}, role="owner", staff=False)
    statements: list[str] = []
    with connection.execute_wrapper(
        lambda execute, sql, *rest: statements.append(sql) or execute(sql, *rest)
    ):
        assert pool_refill(pool_id=pool.id) == 5
    members = Sandbox.objects.filter(pool=pool)
    assert _counts([m.node for m in members.select_related("node")]) == {"a": 3, "b": 2}
    # One statement wrote every member's row, one every member's event; each was enqueued.
    assert sum(s.startswith('INSERT INTO "runtime_sandbox"') for s in statements) == 1
    assert sum(s.startswith('INSERT INTO "runtime_sandboxevent"') for s in statements) == 1
    assert sorted(m[1] for m in sent) == sorted(members.values_list("id", flat=True))
    assert {m[0] for m in sent} == {"provision"}
    pool.refresh_from_db()
    assert (
        pool.last_error
        == "team t is over its concurrent sandboxes quota: 5 in use, 1 more asked for, limit 5"
    )
    # Room, not quota, is short now: three more fit (two on b, one on a), the sixth is refused.
    quotas.limits_set(team=team, values={"sandboxes": None}, role="owner", staff=False)
    pool.size = 9
    pool.save(update_fields=["size"])
    assert pool_refill(pool_id=pool.id) == 3
    pool.refresh_from_db()
    assert pool.last_error == "no node: 2 full on memory"
    assert Sandbox.objects.filter(pool=pool).count() == 8


def test_fractional_cpu_ties_fall_as_for_one_placement_after_another(team, settings):
    settings.HANGAR_PLACEMENT = "spread"
    settings.HANGAR_CPU_OVERCOMMIT = 1.0
    a, b = _node("a", cpu=4, memory_mb=4096), _node("b", cpu=4, memory_mb=4096)
    image = _image(a, b)
    _run(team, b, cpu=0.3, memory_mb=0)  # b: 3.7 CPUs free; memory ties, so CPU decides
    one_by_one = []
    with transaction.atomic():
        for _ in range(9):
            one_by_one.append(node := node_pick(runtime="gvisor", cpu=0.1, memory_mb=0, image=image))
            Sandbox.objects.create(team=team, image="img", image_digest="sha256:abc", node=node, cpu=0.1,
                                   memory_mb=0, status=S.PENDING)  # fmt: skip
        transaction.set_rollback(True)
    VIEW.forget()
    with transaction.atomic():
        batch = node_pick_many(count=9, runtime="gvisor", cpu=0.1, memory_mb=0, image=image)
        transaction.set_rollback(True)
    assert [n.name for n in sorted(batch, key=lambda n: n.name)] == [
        n.name for n in sorted(one_by_one, key=lambda n: n.name)
    ]


def test_a_node_found_full_under_its_lock_is_let_go_at_once(team):
    a, b = _node("a", memory_mb=4096), _node("b", memory_mb=2048)
    image = _image(a, b)
    with transaction.atomic():  # the view is read: a has the most room
        assert node_pick(runtime="gvisor", cpu=1, memory_mb=64, image=image) == a
        transaction.set_rollback(True)
    _run(team, a, memory_mb=4096)  # filled behind the view's back
    placed, release = threading.Event(), threading.Event()
    outcome: list = []

    def batch() -> None:
        try:
            with transaction.atomic():
                outcome.extend(node_pick_many(count=2, partial=True, runtime="gvisor", cpu=1, memory_mb=512,
                                              image=image))  # fmt: skip
                placed.set()
                release.wait(10)
        finally:
            connection.close()

    t = threading.Thread(target=batch)
    t.start()
    try:
        assert placed.wait(10)
        assert {n.name for n in outcome} == {"b"}
        # a (found full) is not held by the batch's open transaction; b (used) is.
        with transaction.atomic():
            assert Node.objects.select_for_update(nowait=True).filter(id=a.id).exists()
        with pytest.raises(DatabaseError), transaction.atomic():
            Node.objects.select_for_update(nowait=True).filter(id=b.id).exists()
    finally:
        release.set()
        t.join()


def test_two_refills_of_one_pool_at_once_never_overfill_it(team, monkeypatch):
    monkeypatch.setattr("runtime.services.sandboxes._enqueue", lambda *args: None)
    a, b = _node("a", cpu=16, memory_mb=8192), _node("b", cpu=16, memory_mb=8192)
    _image(a, b, name="busybox")
    pool = Pool.objects.create(
        team=team, image="busybox", runtime="gvisor", cpu=1, memory_mb=256, disk_mb=0, size=5
    )
    race(2, lambda: pool_refill(pool_id=pool.id))
    assert Sandbox.objects.filter(pool=pool).count() == 5


def test_one_pool_s_failed_refill_does_not_keep_the_sweep_from_the_others(team, monkeypatch):
    from runtime.services import pools

    monkeypatch.setattr("runtime.services.sandboxes._enqueue", lambda *args: None)
    a = _node("a", cpu=16, memory_mb=8192)
    _image(a, name="busybox")
    first = Pool.objects.create(
        team=team, image="busybox", runtime="gvisor", cpu=1, memory_mb=256, disk_mb=0, size=1
    )
    second = Pool.objects.create(
        team=team, image="busybox", runtime="gvisor", cpu=2, memory_mb=256, disk_mb=0, size=2
    )
    real = pools.pool_refill

    def flaky(*, pool_id: str) -> int:
        if pool_id == first.id:
            raise OperationalError("deadlock detected")
        return real(pool_id=pool_id)

    monkeypatch.setattr(pools, "pool_refill", flaky)
    assert pools.pools_refill_all() == 2
    assert Sandbox.objects.filter(pool=second).count() == 2
