"""The Celery app: one control queue, and one queue per node (``node.<name>``)."""

import os
import time

from celery import Celery
from celery.signals import worker_ready, worker_shutdown

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dashboard.settings")
# When this process started: what a node's rows show changed since then is this worker's own
# work in progress, not its predecessor's (node_recover leaves it alone).
STARTED_AT = time.time()

app = Celery("hangar")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["runtime"])


@worker_ready.connect
def _recover_node(sender: object = None, **_: object) -> None:
    """A worker that serves this node's queue, once ready, takes back the work its predecessor
    died holding (runtime.node.sandboxes.node_recover), as a task on that queue."""
    from runtime.node.local import local_node_name, node_queue

    queue = node_queue(local_node_name())
    consumer = getattr(sender, "task_consumer", None)
    served = {q.name for q in getattr(consumer, "queues", None) or []}
    if queue in served:
        app.send_task("runtime.tasks.node_recover", kwargs={"worker_started_at": STARTED_AT}, queue=queue,
                      ignore_result=True)  # fmt: skip
        _start_heartbeat()


_heartbeat = None


def _start_heartbeat() -> None:
    """The node's heartbeat, from a thread of this worker (runtime.node.heartbeat): on time
    however busy its pool is."""
    global _heartbeat
    from runtime.node.heartbeat import Heartbeat

    if _heartbeat is None:
        _heartbeat = Heartbeat().start()


@worker_shutdown.connect
def _stop_heartbeat(**_: object) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()
