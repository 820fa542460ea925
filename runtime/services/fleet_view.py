"""What placement chooses from: the placeable nodes as this process last read them, not as the
database has them this instant.

A placement used to ask the database for its candidates in one query built for it (the
ready nodes that run its runtime with its capabilities, carry its labels and hold its image,
with room, best first): on SQLite that query's building by the ORM was most of a placement (3.5
of 4.3 ms), and on Postgres with 1,000 nodes its execution too. Here each process reads the
placeable nodes, their counters and the images they hold at most once every
``HANGAR_PLACEMENT_VIEW_S`` (two plain queries) and filters and orders them in Python.

The view only orders the candidates: whether one takes the sandbox is decided under its row's
lock, from the row as it is then (:func:`.placement._reserve`: its state and heartbeat, its
disk floor, its counters), so a stale view never places on a node that has been cordoned,
lost or filled meanwhile; it may try a node first that is no longer the best. A node that joined
or became ready since the last read is seen at the next one (at most ``HANGAR_PLACEMENT_VIEW_S``
later), or at once when nothing in the view can take the sandbox (the view is read again before
a refusal). Each reservation this process makes is added to its view's counters, so a burst of
placements from one process spreads as it would with fresh reads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings
from django.db.models import QuerySet

from ..models import Image, Node


@dataclass
class NodeView:
    id: int
    name: str
    launchers: dict[str, dict[str, Any]]
    labels: dict[str, Any]
    cpu_capacity: float
    memory_mb_capacity: int
    disk_free_mb: int | None
    millicpu_allocated: int
    memory_mb_allocated: int
    images: frozenset[int] = field(default_factory=frozenset)


class FleetView:
    """This process's view of the placeable nodes (thread-safe: a list replaced whole)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nodes: list[NodeView] = []
        self._by_id: dict[int, NodeView] = {}
        self._read_at = -1e18
        self._matches: tuple[list[NodeView], dict[tuple[Any, ...], list[NodeView]]] = ([], {})

    def nodes(self, placeable: Callable[[], QuerySet[Node]], *, fresh: bool = False) -> list[NodeView]:
        """The view, read again (``placeable()``: the nodes that take sandboxes) when ``fresh``
        or older than ``HANGAR_PLACEMENT_VIEW_S``."""
        ttl = float(settings.HANGAR_PLACEMENT_VIEW_S)
        if fresh or time.monotonic() - self._read_at >= ttl:
            self._read(placeable())
        return self._nodes

    def _read(self, placeable: QuerySet[Node]) -> None:
        rows = list(
            placeable.values_list(
                "id", "name", "launchers", "labels", "cpu_capacity", "memory_mb_capacity", "disk_free_mb",
                "millicpu_allocated", "memory_mb_allocated",
            )
        )  # fmt: skip
        held: dict[int, set[int]] = {}
        for node_id, image_id in Image.nodes.through.objects.filter(
            node_id__in=[r[0] for r in rows]
        ).values_list("node_id", "image_id"):
            held.setdefault(node_id, set()).add(image_id)
        nodes = [
            NodeView(
                id=r[0],
                name=r[1],
                launchers=r[2] or {},
                labels=r[3] if isinstance(r[3], dict) else {},
                cpu_capacity=r[4],
                memory_mb_capacity=r[5],
                disk_free_mb=r[6],
                millicpu_allocated=r[7],
                memory_mb_allocated=r[8],
                images=frozenset(held.get(r[0], ())),
            )  # fmt: skip
            for r in rows
        ]
        with self._lock:
            self._nodes, self._by_id, self._read_at = nodes, {n.id: n for n in nodes}, time.monotonic()
            self._matches = (nodes, {})

    def matching(self, placeable: Callable[[], QuerySet[Node]], *, fresh: bool = False, runtime: str,
                 needs: tuple[str, ...], selector: Mapping[str, str], image_id: int,
                 node_id: int | None) -> list[NodeView]:  # fmt: skip
        """:func:`matching` over the view (read again as :meth:`nodes` says), remembered per
        spec until the next read: a run of placements of one spec filters the fleet once."""
        nodes = self.nodes(placeable, fresh=fresh)
        of, matches = self._matches  # the read they were filtered from, with them (one attribute)
        key = (runtime, needs, tuple(sorted(selector.items())), image_id, node_id)
        if of is not nodes or (found := matches.get(key)) is None:
            found = matching(nodes, runtime=runtime, needs=needs, selector=selector, image_id=image_id,
                             node_id=node_id)  # fmt: skip
            if of is nodes and len(matches) < 256:
                matches[key] = found
        return found

    def reserved(self, node: Node, cpu: float, memory_mb: int) -> None:
        """Count a reservation on ``node`` (whose row was just read under its lock) in the view."""
        with self._lock:
            if (view := self._by_id.get(node.id)) is not None:
                view.millicpu_allocated = node.millicpu_allocated + round(cpu * 1000)
                view.memory_mb_allocated = node.memory_mb_allocated + memory_mb
                view.disk_free_mb = node.disk_free_mb

    def forget(self) -> None:
        """Read again at the next placement."""
        self._read_at = -1e18

    def changed(self, *args: Any, **kwargs: Any) -> None:
        """A signal's receiver: a node or its images changed in this process."""
        self.forget()


VIEW = FleetView()


def matching(nodes: list[NodeView], *, runtime: str, needs: tuple[str, ...], selector: Mapping[str, str],
             image_id: int, node_id: int | None) -> list[NodeView]:  # fmt: skip
    """The nodes of the view that could take such a sandbox, room aside."""
    floor = settings.HANGAR_NODE_MIN_FREE_DISK_MB
    found = []
    for n in nodes:  # a plain loop: run for each placement over the whole fleet
        caps = n.launchers.get(runtime)
        if caps is None or image_id not in n.images or (node_id is not None and n.id != node_id):
            continue
        if (n.disk_free_mb is not None and n.disk_free_mb < floor) or (
            needs and not all(caps.get(c) for c in needs)
        ):
            continue
        if selector and any(n.labels.get(k) != v for k, v in selector.items()):
            continue
        found.append(n)
    return found
