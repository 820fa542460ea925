"""Celery tasks: ids in, one service call. Node tasks are sent to ``node.<name>`` queues."""

from __future__ import annotations

import logging
from typing import Any

from celery import shared_task

from .models import Node
from .node import local_node_name, node_queue
from .services import images as image_services
from .services import nodes as node_services
from .services import sandboxes as sandbox_services

log = logging.getLogger(__name__)


@shared_task(bind=True, max_retries=3, default_retry_delay=2, acks_late=True)
def provision(self, sandbox_id: str) -> None:
    try:
        sandbox_services.sandbox_provision(sandbox_id=sandbox_id)
    except Exception as exc:  # a database or broker blip: retry; the service is idempotent
        if self.request.retries >= self.max_retries:
            sandbox_services.sandbox_fail(sandbox_id=sandbox_id, reason=f"provisioning failed: {exc}")
            raise
        raise self.retry(exc=exc) from exc


@shared_task(bind=True, max_retries=5, default_retry_delay=3, acks_late=True)
def destroy(self, sandbox_id: str) -> None:
    try:
        sandbox_services.sandbox_destroy(sandbox_id=sandbox_id)
    except Exception as exc:
        raise self.retry(exc=exc) from exc


@shared_task(bind=True, max_retries=5, default_retry_delay=3, acks_late=True)
def halt(self, sandbox_id: str) -> None:
    try:
        sandbox_services.sandbox_halt(sandbox_id=sandbox_id)
    except Exception as exc:
        raise self.retry(exc=exc) from exc


@shared_task(bind=True, max_retries=5, default_retry_delay=3, acks_late=True)
def suspend(self, sandbox_id: str) -> None:
    try:
        sandbox_services.sandbox_suspend(sandbox_id=sandbox_id)
    except Exception as exc:
        raise self.retry(exc=exc) from exc


@shared_task(bind=True, max_retries=3, default_retry_delay=2, acks_late=True)
def resume(self, sandbox_id: str) -> None:
    try:
        sandbox_services.sandbox_restart(sandbox_id=sandbox_id)
    except Exception as exc:
        if self.request.retries >= self.max_retries:
            sandbox_services.sandbox_fail(sandbox_id=sandbox_id, reason=f"resuming failed: {exc}")
            raise
        raise self.retry(exc=exc) from exc


@shared_task(acks_late=False, ignore_result=False)
def node_op(op: str, sandbox_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    return sandbox_services.node_op(op=op, sandbox_id=sandbox_id, payload=payload)


@shared_task(acks_late=False, ignore_result=False)
def volume_op(op: str, volume_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    from .launchers.volumes import VolumeError
    from .services import volumes as volume_services

    try:
        return volume_services.volume_op(op=op, volume_id=volume_id, payload=payload)
    except VolumeError as exc:
        return {"error": str(exc)}


@shared_task(acks_late=False)
def pool_refill(pool_id: str) -> int:
    from .services import pools as pool_services

    return pool_services.pool_refill(pool_id=pool_id)


@shared_task(acks_late=False)
def image_job(job_id: int) -> None:
    image_services.image_job_run(job_id=job_id)


@shared_task
def node_heartbeat() -> None:
    node_services.node_heartbeat(name=local_node_name(), disk_free_mb=node_services.local_disk_free_mb())
    sandbox_services.sandboxes_stats_collect(node_name=local_node_name())


@shared_task
def node_reconcile() -> dict[str, list[str]]:
    report = sandbox_services.node_reconcile(node_name=local_node_name())
    if report["failed"] or report["destroyed"]:
        log.info("reconciled node %s: %s", local_node_name(), report)
    return report


@shared_task
def nodes_tick() -> None:
    """Beat: ask every node's own worker to heartbeat and reconcile; mark silent nodes offline."""
    node_services.nodes_mark_offline()
    for name in Node.objects.exclude(status=Node.Status.OFFLINE).values_list("name", flat=True):
        node_heartbeat.apply_async(queue=node_queue(name), expires=30)
        node_reconcile.apply_async(queue=node_queue(name), expires=30)
    # Offline nodes still get a heartbeat request: one that comes back answers it.
    for name in Node.objects.filter(status=Node.Status.OFFLINE).values_list("name", flat=True):
        node_heartbeat.apply_async(queue=node_queue(name), expires=30)


@shared_task
def sandboxes_reap() -> int:
    from .services import pools as pool_services
    from .services import runs as run_services

    reaped = sandbox_services.sandboxes_reap_expired()
    pool_services.pools_refill_all()  # heals pools whose refill was lost or stopped short
    run_services.runs_sweep()
    return reaped


@shared_task
def usage_meter() -> int:
    """Beat: count what running sandboxes and volumes used up to now into the hourly rollups,
    and warn teams past 80% of their budget."""
    from .services import usage

    return usage.meter()


@shared_task(bind=True, max_retries=3, default_retry_delay=3)
def harness_setup(self, harness_id: str) -> None:
    """On the harness's node: clone the repository, install the agent (streamed to its log)."""
    from .services import harnesses

    harnesses.harness_setup(harness_id=harness_id)


@shared_task(acks_late=True)
def run_start(run_id: str) -> None:
    from .services import runs

    runs.run_start(run_id=run_id)


@shared_task(bind=True, max_retries=5, default_retry_delay=2)
def run_finish(self, run_id: str) -> None:
    from .services import runs

    try:
        runs.run_finish(run_id=run_id)
    except Exception as exc:
        raise self.retry(exc=exc) from exc


@shared_task(bind=True, max_retries=180, default_retry_delay=10)
def volume_delete_when_free(self, volume_id: str) -> None:
    """A deleted harness's volume, once its sandbox has let go of it (tried for half an hour:
    a node that is down keeps it; then it is left, with an error in the log, to delete by hand)."""
    from .services import harnesses

    if not harnesses.volume_delete_when_free(volume_id=volume_id):
        if self.request.retries >= self.max_retries:
            log.error("volume %s of a deleted harness is still held; delete it by hand", volume_id)
            return
        raise self.retry(countdown=2 if self.request.retries < 30 else 10)
