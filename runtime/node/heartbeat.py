"""The node's heartbeat, from a thread of its own in the worker that serves the node's queue.

A heartbeat says the node is alive: its worker process runs and reaches the database. It used
to be a task that beat sent to the node's queue every ``HANGAR_NODE_HEARTBEAT_S``; a worker
whose threads were all busy (a burst of creates, image builds) ran it late or let it expire
unrun, and a node doing more work than its threads was marked lost for being busy, its
sandboxes told so and new placements refused ("no node: 1 offline"). This thread beats
whatever the pool is doing; beat only marks the silent nodes lost (``nodes_heartbeat``).
"""

from __future__ import annotations

import logging
import threading

from django.conf import settings
from django.db import close_old_connections

from ..services import nodes as node_services
from .local import local_capabilities, local_node_name

log = logging.getLogger(__name__)


def beat_once() -> bool:
    """One heartbeat of this node (with its free disk and its runtimes' capabilities): whether
    its row was there to take it."""
    close_old_connections()
    try:
        return node_services.node_heartbeat(
            name=local_node_name(),
            disk_free_mb=node_services.local_disk_free_mb(),
            launchers=local_capabilities(),
        )
    finally:
        close_old_connections()


class Heartbeat:
    """Beats every ``HANGAR_NODE_HEARTBEAT_S`` until :meth:`stop`; a failed beat (the database
    away for a moment) is logged and the next one tried on time."""

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hangar-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout)

    def _run(self) -> None:
        failing = False
        while not self.stopped.is_set():
            try:
                beat_once()
                if failing:
                    log.info("node %s: heartbeats recorded again", local_node_name())
                failing = False
            except Exception:
                if not failing:  # once per outage, not once per beat
                    log.warning("node %s: could not record a heartbeat", local_node_name(), exc_info=True)
                failing = True
            self.stopped.wait(float(settings.HANGAR_NODE_HEARTBEAT_S))
