"""Nodes: registration, heartbeats, and the scheduler's choice of node."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from django.conf import settings
from django.db import transaction
from django.db.models import Count, Exists, OuterRef, Q, Sum
from django.utils import timezone

from .. import enqueue
from ..errors import Conflict, InvalidValue, NoCapacity, NodeUnavailable
from ..lifecycle import record_event
from ..models import Image, Node, Sandbox

N = Node.State

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


def node_register(
    *,
    name: str,
    launchers: dict[str, dict[str, bool]],
    cpu: float,
    memory_mb: int,
    version: str = "",
    tunnel_address: str = "",
    disk_free_mb: int | None = None,
    labels: dict[str, str] | None = None,
    rejoin: bool = False,
) -> Node:
    """Create or refresh this node's row, with the runtimes it runs and their capabilities
    (``launchers``: runtime → {"network": …, "checkpoint": …}) and, when given, its labels. A
    new or lost node becomes ready; a cordoned or draining one stays so (an operator said so);
    a removed one stays removed unless it joins again (``rejoin``: ``hangar node join``)."""
    now = timezone.now()
    with transaction.atomic():
        existing = Node.objects.select_for_update().filter(name=name).first()
        state: str = N.READY
        if existing is not None and existing.state in (N.CORDONED, N.DRAINING):
            state = existing.state
        elif (
            existing is not None
            and existing.state == N.LOST
            and existing.state_before_lost in (N.CORDONED, N.DRAINING)
        ):
            state = existing.state_before_lost
        elif existing is not None and existing.state == N.REMOVED and not rejoin:
            raise Conflict(f"node {name} was removed; join it again with a join token (hangar node join)")
        defaults: dict[str, Any] = {
            "launchers": launchers, "cpu_capacity": cpu, "memory_mb_capacity": memory_mb, "version": version,
            "tunnel_address": tunnel_address, "disk_free_mb": disk_free_mb, "state": state,
            "state_before_lost": "", "heartbeat_at": now, "started_at": now,
        }  # fmt: skip
        if labels is not None:
            defaults["labels"] = labels
        node, _ = Node.objects.update_or_create(name=name, defaults=defaults)
    if existing is not None and existing.state == N.LOST:
        _node_back(node)
    return node


def node_heartbeat(
    *, name: str, disk_free_mb: int | None = None, launchers: dict[str, dict[str, bool]] | None = None
) -> bool:
    """Record that the node's worker is alive (and bring a lost node back to the state it had
    before, ready unless cordoned or draining), with the free space of its sandboxes'
    filesystem and, when given, its runtimes' capabilities."""
    fields: dict[str, Any] = {"heartbeat_at": timezone.now(), "disk_free_mb": disk_free_mb}
    if launchers is not None:
        fields["launchers"] = launchers
    found = Node.objects.filter(name=name).update(**fields) > 0
    with transaction.atomic():
        lost = Node.objects.select_for_update().filter(name=name, state=N.LOST).first()
        if lost is not None:
            back = lost.state_before_lost if lost.state_before_lost in (N.CORDONED, N.DRAINING) else N.READY
            Node.objects.filter(id=lost.id).update(state=back, state_before_lost="")
            _node_back(lost)
    return found


def local_disk_free_mb() -> int | None:
    """Free space of this node's filesystem for sandboxes (HANGAR_RUNTIME_DIR)."""
    path = settings.HANGAR_RUNTIME_DIR
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return int(shutil.disk_usage(path).free >> 20)
    except OSError:
        return None


# What a node holds that its loss (and its return) is told to: anything not ended.
HELD = [*ACTIVE, Sandbox.Status.STOPPING, Sandbox.Status.PAUSED]


def lost_silence_s() -> float:
    """How long a node may be silent before the check calls it lost: the threshold
    (HANGAR_NODE_OFFLINE_AFTER_S) less one interval of the check, so that the check that
    sees it runs at most the threshold after the node's death (never under two heartbeats)."""
    tick = settings.HANGAR_NODE_HEARTBEAT_S
    return max(settings.HANGAR_NODE_OFFLINE_AFTER_S - tick, 2 * tick)


def nodes_mark_lost() -> list[str]:
    """Nodes whose worker has not answered a heartbeat within the threshold are ``lost``:
    nothing is scheduled there, and each of their sandboxes says so in its ``status_reason``
    and an event. Returns their names."""
    silence = lost_silence_s()
    cutoff = timezone.now() - timedelta(seconds=silence)
    names = []
    for node in Node.objects.filter(state__in=[N.READY, N.CORDONED, N.DRAINING], heartbeat_at__lt=cutoff):
        with transaction.atomic():
            if not Node.objects.filter(id=node.id, state=node.state, heartbeat_at__lt=cutoff).update(
                state=N.LOST, state_before_lost=node.state
            ):
                continue  # it answered meanwhile, or someone changed it
            reason = f"lost: node {node.name} stopped answering (no heartbeat for {silence:.0f} s)"
            for sandbox_id in Sandbox.objects.filter(node=node, status__in=HELD).values_list("id", flat=True):
                Sandbox.objects.filter(id=sandbox_id).update(status_reason=reason, updated_at=timezone.now())
                record_event(sandbox_id, "node_lost", reason, node=node.name)
        names.append(node.name)
    return names


def _node_back(node: Node) -> None:
    """A lost node answers again: its sandboxes' ``lost`` reasons go (its reconciliation,
    next, fails those that did not survive and destroys what no row wants)."""
    prefix = f"lost: node {node.name} "
    for sandbox_id in Sandbox.objects.filter(
        node=node, status__in=HELD, status_reason__startswith=prefix
    ).values_list("id", flat=True):
        Sandbox.objects.filter(id=sandbox_id, status_reason__startswith=prefix).update(
            status_reason="", updated_at=timezone.now()
        )
        record_event(sandbox_id, "node_back", f"node {node.name} answers again", node=node.name)


def nodes_with_usage():
    active = Q(sandboxes__status__in=ACTIVE)
    return Node.objects.annotate(
        cpu_used=Sum("sandboxes__cpu", filter=active),
        memory_used=Sum("sandboxes__memory_mb", filter=active),
        sandbox_count=Count("sandboxes", filter=active),
    ).order_by("name")


def node_pick(
    *, runtime: str, cpu: float, memory_mb: int, image: Image, node_id: int | None = None,
    needs: Iterable[str] = (),
) -> Node:  # fmt: skip
    """The online node with the most free memory that runs ``runtime`` with the capabilities
    ``needs`` (network, checkpoint), holds the image and has room. Call inside a transaction:
    the chosen node's row stays locked until commit so two concurrent creates cannot both take
    its last unit of room."""
    cutoff = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_AFTER_S)
    holds_image = Image.nodes.through.objects.filter(image_id=image.id, node_id=OuterRef("pk"))
    candidates = [
        n
        for n in nodes_with_usage()
        .filter(state=N.READY, heartbeat_at__gte=cutoff)
        .annotate(has_image=Exists(holds_image))
        if runtime in (n.launchers or {})
    ]
    if not candidates:
        runtimes = sorted({r for n in Node.objects.filter(state=N.READY) for r in n.launchers or {}})
        raise NoCapacity(
            f"no online node runs runtime {runtime!r}"
            + (f"; available: {', '.join(runtimes)}" if runtimes else "")
        )
    for capability in needs:
        candidates = [n for n in candidates if n.can(runtime, capability)]
        if not candidates:
            raise InvalidValue(CANNOT[capability].format(runtime=runtime))
    if node_id is not None:  # its volumes are there
        candidates = [n for n in candidates if n.id == node_id]
        if not candidates:
            raise NoCapacity(
                "the node that holds the sandbox's volumes is offline or does not run that runtime"
            )
    with_image = [n for n in candidates if n.has_image]
    if not with_image:
        raise NoCapacity(f"image {image.name!r} is not on any online node; build or pull it there first")
    floor = settings.HANGAR_NODE_MIN_FREE_DISK_MB
    with_disk = [n for n in with_image if n.disk_free_mb is None or n.disk_free_mb >= floor]
    if not with_disk:
        raise NoCapacity(
            f"no node has disk room: their sandboxes' filesystems have less than {floor} MB free; "
            "free space there or add nodes"
        )
    roomy = []
    for n in with_disk:
        free_cpu = n.cpu_capacity * settings.HANGAR_CPU_OVERCOMMIT - (n.cpu_used or 0)
        free_mem = n.memory_mb_capacity * settings.HANGAR_MEMORY_OVERCOMMIT - (n.memory_used or 0)
        if free_cpu >= cpu and free_mem >= memory_mb:
            roomy.append((free_mem, free_cpu, n))
    if not roomy:
        raise NoCapacity(
            f"no node has room for {cpu:g} cpu and {memory_mb} MB right now; delete sandboxes or add nodes"
        )
    roomy.sort(key=lambda t: (t[0], t[1]), reverse=True)
    chosen = roomy[0][2]
    # Lock so the capacity decision holds until the caller's transaction commits (that
    # transaction is the caller's: no savepoint of its own).
    with transaction.atomic(savepoint=False):
        Node.objects.select_for_update().filter(id=chosen.id).values_list("id").first()
    return chosen


def runtimes_offered() -> dict[str, dict[str, bool]]:
    """The runtimes the online nodes run, each with what its sandboxes can have on at least
    one of them (for the create form)."""
    offered: dict[str, dict[str, bool]] = {}
    for launchers in Node.objects.filter(state=N.READY).values_list("launchers", flat=True):
        for runtime, caps in (launchers or {}).items():
            mine = offered.setdefault(runtime, {})
            for key, value in caps.items():
                if isinstance(value, bool):  # what its sandboxes can have (not its limits)
                    mine[key] = mine.get(key, False) or value
    return dict(sorted(offered.items()))


def runtime_require(*, runtime: str, capability: str) -> None:
    """An online node runs ``runtime`` with ``capability``, or a 422 that says it cannot (a
    runtime no node runs is left to the scheduler, which says so)."""
    online = Node.objects.filter(state=N.READY).values_list("launchers", flat=True)
    running = [launchers[runtime] for launchers in online if runtime in (launchers or {})]
    if running and not any(caps.get(capability) for caps in running):
        raise InvalidValue(CANNOT[capability].format(runtime=runtime))


def node_call(node: Node, task: str, args: list[Any], timeout: float) -> dict[str, Any]:
    """Run the task named ``task`` on ``node``'s own queue and wait for its JSON answer; a node
    that does not answer in time is :class:`NodeUnavailable` (502)."""
    result = enqueue.send(task, args, queue=node.queue, answer=True)
    try:
        answer: dict[str, Any] = result.get(timeout=timeout, propagate=True)
    except CeleryTimeout:
        raise NodeUnavailable(f"node {node.name} did not answer within {timeout:.0f} s") from None
    finally:
        result.forget()
    return answer
