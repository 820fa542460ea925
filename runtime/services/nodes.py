"""Nodes: registration and heartbeats (the scheduler's choice of node is in ``placement``)."""

from __future__ import annotations

import shutil
from datetime import timedelta
from typing import Any

from celery.exceptions import TimeoutError as CeleryTimeout
from django.conf import settings
from django.utils import timezone

from .. import enqueue
from ..errors import InvalidValue, NodeUnavailable
from ..models import Node
from .placement import ACTIVE, CANNOT, node_pick, nodes_with_usage, placeable

# The choice of node lives in .placement; these names stay importable from here.
__all__ = ["ACTIVE", "CANNOT", "node_pick", "nodes_with_usage", "placeable"]


def node_register(
    *,
    name: str,
    launchers: dict[str, dict[str, bool]],
    cpu: float,
    memory_mb: int,
    version: str = "",
    tunnel_address: str = "",
    disk_free_mb: int | None = None,
) -> Node:
    """Create or refresh this node's row and mark it online, with the runtimes it runs and
    their capabilities (``launchers``: runtime → {"network": …, "checkpoint": …})."""
    now = timezone.now()
    node, _ = Node.objects.update_or_create(
        name=name,
        defaults={
            "launchers": launchers,
            "cpu_capacity": cpu,
            "memory_mb_capacity": memory_mb,
            "version": version,
            "tunnel_address": tunnel_address,
            "disk_free_mb": disk_free_mb,
            "status": Node.Status.ONLINE,
            "heartbeat_at": now,
            "started_at": now,
        },
    )
    return node


def node_heartbeat(
    *, name: str, disk_free_mb: int | None = None, launchers: dict[str, dict[str, bool]] | None = None
) -> bool:
    """Record that the node's worker is alive (and bring an offline node back online), with
    the free space of its sandboxes' filesystem and, when given, its runtimes' capabilities."""
    Node.objects.filter(name=name, status=Node.Status.OFFLINE).update(status=Node.Status.ONLINE)
    fields: dict[str, Any] = {"heartbeat_at": timezone.now(), "disk_free_mb": disk_free_mb}
    if launchers is not None:
        fields["launchers"] = launchers
    return Node.objects.filter(name=name).update(**fields) > 0


def local_disk_free_mb() -> int | None:
    """Free space of this node's filesystem for sandboxes (HANGAR_RUNTIME_DIR)."""
    path = settings.HANGAR_RUNTIME_DIR
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return int(shutil.disk_usage(path).free >> 20)
    except OSError:
        return None


def nodes_mark_offline() -> list[str]:
    """Nodes whose worker has not answered a heartbeat for a while stop getting new sandboxes."""
    cutoff = timezone.now() - timedelta(seconds=settings.HANGAR_NODE_OFFLINE_AFTER_S)
    stale = Node.objects.filter(status=Node.Status.ONLINE, heartbeat_at__lt=cutoff)
    names = list(stale.values_list("name", flat=True))
    stale.update(status=Node.Status.OFFLINE)
    return names


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
