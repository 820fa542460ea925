"""Placement: which node a new (or resuming) sandbox goes to, and why none can take it.

A node takes a sandbox when it is ready (:func:`node_unready`), runs its runtime with every
capability it needs, carries every label of its ``node_selector``, is the node of its volumes
when it attaches any (a sandbox using a volume goes where the volume lives: volumes do not
move), holds its image, has disk above the floor, and has CPU and memory left under the
overcommit ratios. Among those, ``HANGAR_PLACEMENT=spread`` (the default) takes the one with the
most free memory (then CPU), ``pack`` the one with the least that still fits.

The candidates come from this process's view of the placeable nodes (:mod:`.fleet_view`: read at
most once every ``HANGAR_PLACEMENT_VIEW_S``, with their allocation counters, which the database
keeps), ordered by the policy; the reservation is the chosen node's row, locked, and everything
that decides whether it takes the sandbox is read again under the lock (its state, heartbeat,
labels, capabilities, disk floor and counters), so a stale view never places where it should
not, and two concurrent placements on the last unit of room cannot both succeed. When nothing fits, every node is looked at once more to say why, in one
line: ``no node: 2 lack kvm, 1 offline, 3 full on memory``.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal

from django.conf import settings
from django.db import transaction
from django.db.models import (
    Count,
    Exists,
    OuterRef,
    Q,
    QuerySet,
    Sum,
)
from django.utils import timezone

from ..errors import InvalidValue, NoCapacity
from ..models import Image, Node, Sandbox
from .fleet_view import VIEW, NodeView

# What holds CPU and memory on a node (a paused sandbox holds only its disk).
ACTIVE = [
    Sandbox.Status.PENDING, Sandbox.Status.STARTING, Sandbox.Status.RUNNING,
    Sandbox.Status.PAUSING, Sandbox.Status.RESUMING,
]  # fmt: skip

# What a runtime without a capability says when a sandbox asks for it (a 422).
CANNOT = {
    "network": "network: the {runtime} runtime gives sandboxes no network",
    "checkpoint": "pause mode checkpoint: the {runtime} runtime cannot checkpoint; pause it with mode stop",
}

POLICIES = ("spread", "pack")
# How many of the best candidates a placement tries to reserve before it waits for one (and,
# when all of them filled up meanwhile, asks for the next ones).
TRIES = 8
EPSILON = 1e-9  # CPU is a float: 0.1 + 0.2 fits in 0.3


@dataclass(frozen=True)
class Placement:
    """What a sandbox asks of its node."""

    runtime: str
    cpu: float
    memory_mb: int
    image: Image
    node_id: int | None = None  # the node of its volumes
    needs: tuple[str, ...] = ()  # capabilities: network, checkpoint, kvm, gpu…
    node_selector: Mapping[str, str] = field(default_factory=dict)


# -- the one place that reads a node's state ---------------------------------------------------


def _cutoff() -> datetime:
    return timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_AFTER_S)


# The node field that says whether it takes new sandboxes, and the value that does: the one line
# that knows how a node's state is stored.
READY_FIELD, READY = "state", Node.State.READY


def placeable(qs: QuerySet[Node] | None = None) -> QuerySet[Node]:
    """The nodes that take new sandboxes (ready, with a recent heartbeat)."""
    qs = Node.objects.all() if qs is None else qs
    return qs.filter(**{READY_FIELD: READY}, heartbeat_at__gte=_cutoff())


def node_unready(node: Node, cutoff: datetime | None = None) -> str | None:
    """Why ``node`` takes no new sandboxes (its state, as one word), or None when it does.
    The same test as :func:`placeable`, for a row already read."""
    if (state := getattr(node, READY_FIELD)) != READY:
        return str(state)
    if node.heartbeat_at is None or node.heartbeat_at < (cutoff or _cutoff()):
        return "offline"
    return None


# -- usage ---------------------------------------------------------------------------------------


def nodes_with_usage():  # its rows carry the usage annotations
    active = Q(sandboxes__status__in=ACTIVE)
    return Node.objects.annotate(
        cpu_used=Sum("sandboxes__cpu", filter=active),
        memory_used=Sum("sandboxes__memory_mb", filter=active),
        sandbox_count=Count("sandboxes", filter=active),
    ).order_by("name")


def _free(node: Node, cpu_used: float, memory_used: int) -> tuple[float, float]:
    return (
        node.cpu_capacity * settings.HANGAR_CPU_OVERCOMMIT - cpu_used,
        node.memory_mb_capacity * settings.HANGAR_MEMORY_OVERCOMMIT - memory_used,
    )


def _short_of(node: Node, p: Placement, cpu_used: float, memory_used: int) -> list[str]:
    """The resources ``node`` lacks for ``p`` (cpu, memory): none when it fits."""
    free_cpu, free_mem = _free(node, cpu_used, memory_used)
    return ["cpu"] * (free_cpu + EPSILON < p.cpu) + ["memory"] * (free_mem < p.memory_mb)


# -- the choice ------------------------------------------------------------------------------------


def node_pick(
    *, runtime: str, cpu: float, memory_mb: int, image: Image, node_id: int | None = None,
    needs: Iterable[str] = (), node_selector: Mapping[str, str] | None = None,
) -> Node:  # fmt: skip
    """The ready node for a sandbox of ``runtime`` with ``needs`` (capabilities), ``cpu`` and
    ``memory_mb``, on ``node_id`` when given (its volumes are there), carrying every label of
    ``node_selector``, chosen by ``HANGAR_PLACEMENT``. Call inside a transaction that then writes
    the sandbox's row: the node's row stays locked until commit, so concurrent placements never
    take more than its room. :class:`NoCapacity` (503) says why each node could not take it;
    :class:`InvalidValue` (422) when no node running ``runtime`` has a capability it needs."""
    p = Placement(
        runtime=runtime, cpu=cpu, memory_mb=memory_mb, image=image, node_id=node_id,
        needs=tuple(dict.fromkeys(needs)), node_selector=dict(node_selector or {}),
    )  # fmt: skip
    # The caller's transaction holds the reservation (no savepoint of its own around it).
    with transaction.atomic(savepoint=False):
        full: set[int] = set()  # found unable under their lock: not tried again
        for fresh in (False, True):  # this process's view of the fleet, then read again
            while candidates := _candidates(p, fresh=fresh, skip=full):
                fresh = False
                waiting: list[NodeView] = []
                for view in candidates:  # first, those no other placement holds right now
                    got = _reserve(view.id, p, wait=False)
                    if isinstance(got, Node):
                        return got
                    if got is None:
                        waiting.append(view)
                    else:
                        full.add(view.id)
                for view in waiting:  # then wait for them, one at a time (holding no other node)
                    if isinstance(got := _reserve(view.id, p, wait=True), Node):
                        return got
                    full.add(view.id)
    raise _refusal(p)


def node_pick_many(
    *, count: int, partial: bool = False, runtime: str, cpu: float, memory_mb: int, image: Image,
    node_id: int | None = None, needs: Iterable[str] = (), node_selector: Mapping[str, str] | None = None,
) -> list[Node]:  # fmt: skip
    """``count`` placements of one spec at once (a pool's refill, a batch of creates): the nodes,
    one per placement (a node repeats for each it takes), chosen as :func:`node_pick` would
    choose them one after another, reserved in the caller's transaction. All or nothing: when
    not all fit, the refusal says why (:class:`NoCapacity`, :class:`InvalidValue`); with
    ``partial``, as many as fit (the refusal only when none does).

    The batch is planned from this process's view of the fleet (a heap of the nodes with room,
    each placement going to the best one left, as it would with fresh reads); the planned
    nodes' rows that no other placement holds are locked in one statement (``SKIP LOCKED``), and
    every planned placement is decided under its node's lock, from the row as it is then. What
    could not be placed (a node held by another placement, or filled since the view was read)
    is planned again on the other nodes; when only nodes held by other placements are left,
    they are waited for one at a time, holding the batch's own. Two batches that both come to
    that point on each other's nodes at once wait on each other: Postgres ends one of them with
    a deadlock error (its transaction rolled back, nothing placed), and its caller tries again."""
    p = Placement(
        runtime=runtime, cpu=cpu, memory_mb=memory_mb, image=image, node_id=node_id,
        needs=tuple(dict.fromkeys(needs)), node_selector=dict(node_selector or {}),
    )  # fmt: skip
    if count < 1:
        return []
    got: list[Node] = []
    with transaction.atomic(savepoint=False):
        locked: dict[int, Node] = {}  # the rows this batch holds (and uses), as locked
        taken: Counter[int] = Counter()  # this batch's placements on each
        full: set[int] = set()  # found unable under their lock (and let go)
        busy: set[int] = set()  # held by other placements when last asked
        for fresh in (False, True):
            while len(got) < count:
                plan = _plan(p, count - len(got), fresh=fresh, skip=full | busy, locked=locked, taken=taken)
                fresh = False
                if not plan:
                    if not busy:
                        break
                    waited = busy.pop()  # only held nodes are left: wait for one (holding ours)
                    _lock(p, [waited], wait=True, locked=locked, full=full, busy=busy)
                    continue
                if new := sorted(plan.keys() - locked.keys()):
                    _lock(p, new, wait=False, locked=locked, full=full, busy=busy)
                for nid, wanted in plan.items():
                    if (row := locked.get(nid)) is None:
                        continue
                    fit = _room_for(row, p, taken[nid], wanted)
                    taken[nid] += fit
                    got.extend([row] * fit)
                    if fit < wanted:
                        full.add(nid)
        if not got:
            raise _refusal(p)
        if len(got) < count and not partial:
            raise NoCapacity(f"no room for {count} such sandboxes: the fleet takes {len(got)} now")
    mcpu = round(p.cpu * 1000)
    for nid, n in taken.items():
        if n:
            VIEW.reserved(locked[nid], n * mcpu / 1000, p.memory_mb * n)
    return got


def _lock(p: Placement, ids: list[int], *, wait: bool, locked: dict[int, Node], full: set[int],
          busy: set[int]) -> None:  # fmt: skip
    """Lock the rows of ``ids`` for the batch (those no other placement holds, unless ``wait``)
    and keep those that can take one more of ``p`` in ``locked``; the others are let go at once
    (a savepoint rolled back, as :func:`_reserve` does), so a full node is not held for the
    batch's whole transaction, and go to ``full``; the rows another placement held go to
    ``busy`` (a row that is gone, to ``full``)."""
    sid = transaction.savepoint()
    rows = {
        r.id: r
        for r in Node.objects.select_for_update(skip_locked=not wait).filter(id__in=ids).order_by("id")
    }
    for i in ids:
        if i not in rows:
            (full if wait else busy).add(i)
    useless = {i for i, row in rows.items() if not _room_for(row, p, 0, 1)}
    if not useless:
        transaction.savepoint_commit(sid)
        locked.update(rows)
        return
    transaction.savepoint_rollback(sid)  # which lets every row of that statement go
    full.update(useless)
    if again := [i for i in rows if i not in useless]:  # the useful ones, locked again
        sid = transaction.savepoint()
        rows = {
            r.id: r
            for r in Node.objects.select_for_update(skip_locked=True).filter(id__in=again).order_by("id")
        }
        transaction.savepoint_commit(sid)
        busy.update(i for i in again if i not in rows)  # taken by another placement in between
        locked.update(rows)  # (one filled in between holds no placement of the batch: its plan skips it)


def _room_for(node: Node, p: Placement, already: int, wanted: int) -> int:
    """How many of ``wanted`` more of ``p`` the locked row ``node`` takes beyond ``already`` of
    this batch: counted as the counters will count them (CPU in whole thousandths, each
    placement's ``round(cpu * 1000)``), with :func:`_short_of`'s test, as successive placements
    would be."""
    if _unfit(node, p):
        return 0
    mcpu = round(p.cpu * 1000)
    fit = 0
    while fit < wanted and not _short_of(
        node, p, (node.millicpu_allocated + (already + fit) * mcpu) / 1000,
        node.memory_mb_allocated + (already + fit) * p.memory_mb,
    ):  # fmt: skip
        fit += 1
    return fit


def _plan(p: Placement, want: int, *, fresh: bool, skip: set[int], locked: Mapping[int, Node],
          taken: Counter[int]) -> Counter[int]:  # fmt: skip
    """Where ``want`` more placements of ``p`` go, as the view has the fleet (the rows this batch
    holds as locked, and what it has placed on them): ``{node id: how many}``, each one to the
    best node left by the policy, as one placement after another would choose."""
    nodes = VIEW.matching(placeable, fresh=fresh, runtime=p.runtime, needs=p.needs, selector=p.node_selector,
                          image_id=p.image.id, node_id=p.node_id)  # fmt: skip
    oc_cpu, oc_mem = settings.HANGAR_CPU_OVERCOMMIT, settings.HANGAR_MEMORY_OVERCOMMIT
    sign = 1 if _policy() == "pack" else -1
    want_cpu, want_mem, mcpu = p.cpu - EPSILON, p.memory_mb, round(p.cpu * 1000)
    # Room as _candidates computes it from the counters (CPU in thousandths, as each placement
    # adds ``round(cpu * 1000)``), so ties fall as they would for placements one at a time.
    heap = []
    for n in nodes:  # a plain loop over the whole fleet, once per round of a batch
        nid = n.id
        if nid in skip:
            continue
        if nid in locked:  # the row as this batch holds it, with what the batch put there
            row, already = locked[nid], taken.get(nid, 0)
            alloc_m, alloc_mem = (
                row.millicpu_allocated + already * mcpu,
                row.memory_mb_allocated + already * want_mem,
            )
        else:
            alloc_m, alloc_mem = n.millicpu_allocated, n.memory_mb_allocated
        cap_cpu, cap_mem = n.cpu_capacity * oc_cpu, n.memory_mb_capacity * oc_mem
        free_cpu, free_mem = cap_cpu - alloc_m / 1000, cap_mem - alloc_mem
        if free_cpu >= want_cpu and free_mem >= want_mem:
            heap.append((sign * free_mem, sign * free_cpu, n.name, nid, cap_cpu, alloc_m, cap_mem, alloc_mem))
    heapq.heapify(heap)
    plan: Counter[int] = Counter()
    while want and heap:
        _, _, name, nid, cap_cpu, alloc_m, cap_mem, alloc_mem = heap[0]
        plan[nid] += 1
        want -= 1
        alloc_m, alloc_mem = alloc_m + mcpu, alloc_mem + want_mem
        free_cpu, free_mem = cap_cpu - alloc_m / 1000, cap_mem - alloc_mem
        if free_cpu >= want_cpu and free_mem >= want_mem:
            heapq.heapreplace(
                heap, (sign * free_mem, sign * free_cpu, name, nid, cap_cpu, alloc_m, cap_mem, alloc_mem)
            )
        else:
            heapq.heappop(heap)
    return plan


def _policy() -> str:
    policy = str(settings.HANGAR_PLACEMENT)
    if policy not in POLICIES:
        raise InvalidValue(f"HANGAR_PLACEMENT must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def _candidates(p: Placement, *, fresh: bool, skip: set[int]) -> list[NodeView]:
    """The best few nodes for ``p`` as this process's view of the fleet has them (module
    :mod:`.fleet_view`): those that run its runtime with its capabilities, carry its labels, hold
    its image, are above the disk floor and have room, ordered by the policy."""
    nodes = VIEW.matching(placeable, fresh=fresh, runtime=p.runtime, needs=p.needs, selector=p.node_selector,
                          image_id=p.image.id, node_id=p.node_id)  # fmt: skip
    oc_cpu, oc_mem = settings.HANGAR_CPU_OVERCOMMIT, settings.HANGAR_MEMORY_OVERCOMMIT
    want_cpu, want_mem = p.cpu - EPSILON, p.memory_mb
    roomy = []
    for n in nodes:
        free_cpu = n.cpu_capacity * oc_cpu - n.millicpu_allocated / 1000
        free_mem = n.memory_mb_capacity * oc_mem - n.memory_mb_allocated
        if free_cpu >= want_cpu and free_mem >= want_mem and n.id not in skip:
            roomy.append((free_mem, free_cpu, n))
    if _policy() == "pack":
        best = heapq.nsmallest(TRIES, roomy, key=lambda r: (r[0], r[1], r[2].name))
    else:
        best = heapq.nsmallest(TRIES, roomy, key=lambda r: (-r[0], -r[1], r[2].name))
    return [r[2] for r in best]


def _reserve(node_id: int, p: Placement, *, wait: bool) -> Node | Literal[False] | None:
    """Lock the node's row and decide under the lock, from the row as it is now (its state
    and heartbeat, labels, capabilities, disk floor and counters): the node (reserved: the lock
    stays until the caller's transaction ends), False (it cannot take ``p``: released), None
    (another placement holds it and ``wait`` is False, or it is gone)."""
    sid = transaction.savepoint()
    # The row as locked is its latest committed version: its counters count every placement
    # on this node that committed before (ours moves them when its sandbox's row is written).
    locked = Node.objects.select_for_update(skip_locked=not wait).filter(id=node_id).first()
    if locked is None:
        transaction.savepoint_rollback(sid)
        return None
    if _unfit(locked, p) or _short_of(
        locked, p, locked.millicpu_allocated / 1000, locked.memory_mb_allocated
    ):
        transaction.savepoint_rollback(sid)  # which releases the row's lock
        return False
    transaction.savepoint_commit(sid)
    VIEW.reserved(locked, p.cpu, p.memory_mb)
    return locked


def _unfit(node: Node, p: Placement) -> bool:
    """Whether the row, read under its lock, says the node cannot take ``p`` whatever its room
    (the view it was chosen from may be older than a cordon, a loss or a label change)."""
    labels = node.labels if isinstance(node.labels, dict) else {}
    floor = settings.HANGAR_NODE_MIN_FREE_DISK_MB
    return bool(
        node_unready(node)
        or p.runtime not in (node.launchers or {})
        or not all(node.can(p.runtime, c) for c in p.needs)
        or any(labels.get(k) != v for k, v in p.node_selector.items())
        or (node.disk_free_mb is not None and node.disk_free_mb < floor)
    )


# -- the refusal ------------------------------------------------------------------------------------


def _why_not(node: Node, p: Placement, cutoff: datetime) -> str | None:
    """The first reason ``node`` cannot take ``p`` (None: it can)."""
    if unready := node_unready(node, cutoff):
        return unready
    if p.runtime not in (node.launchers or {}):
        return f"lack runtime {p.runtime}"
    for capability in p.needs:
        if not node.can(p.runtime, capability):
            return f"lack {capability}"
    labels = node.labels if isinstance(node.labels, dict) else {}
    for key, value in sorted(p.node_selector.items()):
        if labels.get(key) != value:
            return f"lack label {key}={value}"
    if p.node_id is not None and node.id != p.node_id:
        return "lack its volumes"
    if not getattr(node, "has_image", True):
        return f"lack image {p.image.name}"
    if node.disk_free_mb is not None and node.disk_free_mb < settings.HANGAR_NODE_MIN_FREE_DISK_MB:
        return "full on disk"
    short = _short_of(node, p, getattr(node, "cpu_used", None) or 0, getattr(node, "memory_used", None) or 0)
    return f"full on {' and '.join(short)}" if short else None


def placement_refusal(p: Placement) -> str:
    """Why no node takes ``p``, per node, in one line."""
    holds_image = Image.nodes.through.objects.filter(image_id=p.image.id, node_id=OuterRef("pk"))
    nodes = list(nodes_with_usage().annotate(has_image=Exists(holds_image)))
    if not nodes:
        return "no node: none has joined; start one with `hangar node`"
    cutoff = _cutoff()
    reasons = Counter(_why_not(n, p, cutoff) or "busy with other placements" for n in nodes)
    line = "no node: " + ", ".join(f"{count} {reason}" for reason, count in reasons.items())
    if f"lack runtime {p.runtime}" in reasons:
        offered = sorted({r for n in nodes if node_unready(n, cutoff) is None for r in n.launchers or {}})
        line += f"; ready nodes run {', '.join(offered)}" if offered else "; no node is ready"
    if any(r.startswith("full on disk") for r in reasons):
        line += f" (under {settings.HANGAR_NODE_MIN_FREE_DISK_MB} MB free)"
    return line


def selector_unmatched(selector: Mapping[str, str]) -> str:
    """Why no node of the fleet (removed ones aside) could ever take a sandbox with this
    ``node_selector`` (none carries all its labels), or "" when one could."""
    if not selector or any(
        all((n.labels if isinstance(n.labels, dict) else {}).get(k) == v for k, v in selector.items())
        for n in Node.objects.exclude(state=Node.State.REMOVED).only("labels")
    ):
        return ""
    wanted = ", ".join(f"{k}={v}" for k, v in sorted(selector.items()))
    return f"node_selector: no node carries the labels {wanted}"


def _refusal(p: Placement) -> Exception:
    line = placement_refusal(p)
    if unmatched := selector_unmatched(p.node_selector):
        # Nothing in the fleet carries them: waiting would not help, the request must change.
        return InvalidValue(f"{unmatched} ({line})")
    running = list(placeable().filter(launchers__has_key=p.runtime))
    for capability in p.needs:
        if running and capability in CANNOT and not any(n.can(p.runtime, capability) for n in running):
            return InvalidValue(f"{CANNOT[capability].format(runtime=p.runtime)} ({line})")
    return NoCapacity(line)
