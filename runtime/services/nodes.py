"""Nodes: registration and heartbeats (the scheduler's choice of node is in ``placement``)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from .. import enqueue
from ..errors import Conflict, InvalidValue, NodeUnavailable
from ..lifecycle import record_event
from ..models import Node, Sandbox
from .placement import ACTIVE, CANNOT, node_pick, node_pick_many, nodes_with_usage, placeable

# The choice of node lives in .placement; these names stay importable from here.
__all__ = ["ACTIVE", "CANNOT", "node_pick", "node_pick_many", "nodes_with_usage", "placeable"]

N = Node.State


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
    if lost is not None:
        # Once the node's lock is released: a sandbox's row is locked before its node's (the
        # allocation counters' triggers take them in that order), never after.
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
            # Its sandboxes' rows first, then its own: the order the allocation counters'
            # triggers take them in (a sandbox that ends locks its row, then its node's).
            held = list(
                Sandbox.objects.select_for_update()
                .filter(node=node, status__in=HELD)
                .order_by("id")
                .values_list("id", flat=True)
            )
            if not Node.objects.filter(id=node.id, state=node.state, heartbeat_at__lt=cutoff).update(
                state=N.LOST, state_before_lost=node.state
            ):
                continue  # it answered meanwhile, or someone changed it
            reason = f"lost: node {node.name} stopped answering (no heartbeat for {silence:.0f} s)"
            for sandbox_id in held:
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


def runtimes_offered() -> dict[str, dict[str, bool]]:
    """The runtimes the online nodes run, each with what its sandboxes can have on at least
    one of them (for the create form)."""
    offered: dict[str, dict[str, bool]] = {}
    for launchers in placeable().values_list("launchers", flat=True):
        for runtime, caps in (launchers or {}).items():
            mine = offered.setdefault(runtime, {})
            for key, value in caps.items():
                if isinstance(value, bool):  # what its sandboxes can have (not its limits)
                    mine[key] = mine.get(key, False) or value
    return dict(sorted(offered.items()))


def runtime_require(*, runtime: str, capability: str) -> None:
    """An online node runs ``runtime`` with ``capability``, or a 422 that says it cannot (a
    runtime no node runs is left to the scheduler, which says so)."""
    online = placeable().values_list("launchers", flat=True)
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
