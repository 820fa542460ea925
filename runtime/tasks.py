"""Celery tasks: ids in, one service call. Node tasks are sent to ``node.<name>`` queues."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from celery import Task, shared_task

from .host.volumes import VolumeError
from .models import Node
from .node import heartbeat, moves
from .node import sandboxes as node_svc
from .node.local import local_node_name, node_queue
from .services import harnesses, node_redis, pools, retention, runs, traces, usage, volumes
from .services import images as image_services
from .services import nodes as node_services
from .services import sandbox_access as access_svc
from .services import sandbox_calls as calls_svc
from .services import sandbox_io as io_svc
from .services import sandboxes as sandbox_services

log = logging.getLogger(__name__)


def retried(
    *, retries: int, delay: int, gives_up: str = "", **options: Any
) -> Callable[[Callable[..., Any]], Any]:
    """A task retried on any error, ``retries`` times ``delay`` s apart (a database or broker
    blip: every service a task calls is safe to run twice). ``gives_up``: once the last try has
    failed too, its sandbox (the first argument) fails with this reason and the error."""

    def on_failure(self: Task, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        if gives_up:
            calls_svc.sandbox_fail(
                sandbox_id=(args or [kwargs.get("sandbox_id")])[0], reason=f"{gives_up}: {exc}"
            )

    return shared_task(autoretry_for=(Exception,), max_retries=retries, default_retry_delay=delay,
                       on_failure=on_failure, **options)  # fmt: skip


@retried(retries=3, delay=2, gives_up="provisioning failed", acks_late=True)
def provision(sandbox_id: str, traceparent: str = "") -> None:
    """``traceparent``: the span of the create that asked (the start's phases go under it)."""
    node_svc.node_sandbox_start(sandbox_id=sandbox_id, traceparent=traceparent)


@retried(retries=5, delay=3, acks_late=True)
def destroy(sandbox_id: str) -> None:
    node_svc.node_sandbox_delete(sandbox_id=sandbox_id)


@retried(retries=5, delay=3, acks_late=True)
def halt(sandbox_id: str) -> None:
    node_svc.node_sandbox_stop(sandbox_id=sandbox_id)


@retried(retries=5, delay=3, acks_late=True)
def suspend(sandbox_id: str) -> None:
    node_svc.node_sandbox_pause(sandbox_id=sandbox_id)


@retried(retries=3, delay=2, gives_up="resuming failed", acks_late=True)
def resume(sandbox_id: str) -> None:
    node_svc.node_sandbox_resume(sandbox_id=sandbox_id)


@shared_task(acks_late=True)
def move_in(sandbox_id: str, from_node: str) -> bool:
    """Sent to the node a paused sandbox moves to (a drain): it copies the sandbox from ``from_node``."""
    return moves.node_sandbox_move_in(sandbox_id=sandbox_id, from_node=from_node)


@shared_task(acks_late=True)
def moved_away(sandbox_id: str) -> bool:
    return moves.node_sandbox_moved_away(sandbox_id=sandbox_id)


@shared_task(acks_late=False, ignore_result=False)
def node_op(op: str, sandbox_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    return access_svc.node_op(op=op, sandbox_id=sandbox_id, payload=payload)


@shared_task(acks_late=False, ignore_result=False)
def volume_op(op: str, volume_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    try:
        return volumes.volume_op(op=op, volume_id=volume_id, payload=payload)
    except VolumeError as exc:
        return {"error": str(exc)}


@shared_task(acks_late=False)
def pool_refill(pool_id: str) -> int:
    return pools.pool_refill(pool_id=pool_id)


@shared_task(acks_late=False)
def image_job(job_id: int) -> None:
    image_services.image_job_run(job_id=job_id)


@shared_task
def node_heartbeat() -> None:
    """One heartbeat, on request (the worker's own thread beats on its own)."""
    heartbeat.beat_once()


@shared_task
def node_reconcile() -> dict[str, list[str]]:
    io_svc.sandboxes_stats_collect(node_name=local_node_name())  # as often as before (nodes_tick)
    report = node_svc.node_reconcile(node_name=local_node_name())
    if report["failed"] or report["destroyed"]:
        log.info("reconciled node %s: %s", local_node_name(), report)
    return report


@shared_task
def node_recover(worker_started_at: float | None = None) -> dict[str, list[str]]:
    """Sent by this node's worker to itself once it is ready (dashboard.celery), with when the
    worker's process started."""
    since = datetime.fromtimestamp(worker_started_at, tz=UTC) if worker_started_at else None
    return node_svc.node_recover(node_name=local_node_name(), worker_started_at=since)


@shared_task
def nodes_tick() -> None:
    """Beat: ask every answering node's own worker to reconcile (a lost node reconciles once
    it answers a heartbeat again)."""
    live = Node.objects.exclude(state__in=[Node.State.LOST, Node.State.REMOVED])
    for name in live.values_list("name", flat=True):
        node_reconcile.apply_async(queue=node_queue(name), expires=30)


@shared_task
def nodes_heartbeat() -> None:
    """Beat (every HANGAR_NODE_HEARTBEAT_S): mark silent nodes lost. Each node's worker
    heartbeats from a thread of its own (runtime.node.heartbeat), not from a task a busy pool
    would run late. And give Redis back any node's user it lost (runtime.services.node_redis)."""
    node_services.nodes_mark_lost()
    node_redis.node_redis_users_restore()


@shared_task
def sandboxes_reap() -> int:
    reaped = sandbox_services.sandboxes_reap_expired()
    pools.pools_refill_all()  # heals pools whose refill was lost or stopped short
    runs.runs_sweep()
    return reaped


@shared_task
def sandboxes_prune() -> int:
    """Beat: rows of sandboxes deleted longer ago than HANGAR_DELETED_RETENTION_DAYS go."""
    return retention.sandboxes_prune()


@shared_task
def traces_prune() -> int:
    """Beat: traces untouched for HANGAR_TRACE_RETENTION_DAYS go, with their spans and logs."""
    return traces.traces_prune()


@shared_task
def usage_meter() -> int:
    """Beat: count what running sandboxes and volumes used up to now into the hourly rollups,
    and warn teams past 80% of their budget."""
    return usage.meter()


@shared_task(bind=True, max_retries=3, default_retry_delay=3)
def harness_setup(self, harness_id: str) -> None:
    """On the harness's node: clone the repository, install the agent (streamed to its log)."""
    harnesses.harness_setup(harness_id=harness_id)


@shared_task(acks_late=True)
def run_start(run_id: str) -> None:
    runs.run_start(run_id=run_id)


@retried(retries=5, delay=2)
def run_finish(run_id: str) -> None:
    runs.run_finish(run_id=run_id)


@shared_task(bind=True, max_retries=180, default_retry_delay=10)
def volume_delete_when_free(self, volume_id: str) -> None:
    """A deleted harness's volume, once its sandbox has let go of it (tried for half an hour:
    a node that is down keeps it; then it is left, with an error in the log, to delete by hand)."""
    if not harnesses.volume_delete_when_free(volume_id=volume_id):
        if self.request.retries >= self.max_retries:
            log.error("volume %s of a deleted harness is still held; delete it by hand", volume_id)
            return
        raise self.retry(countdown=2 if self.request.retries < 30 else 10)
