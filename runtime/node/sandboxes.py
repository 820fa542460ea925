"""The node half of the sandbox services: what a node's worker does to the sandboxes it runs
when the control side (:mod:`runtime.services.sandboxes`) has moved their rows (start, pause, resume, stop,
delete), and reconciling the node with the database. Each is a task's body
(:mod:`runtime.tasks`), safe to run twice: only a row in the state its control side left it in
is acted on."""

from __future__ import annotations

import contextlib
import logging
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Q
from django.utils import timezone

from .. import events
from ..host.images.base import ImageError
from ..host.volumes import VolumeError
from ..launchers.base import PHASES, LauncherError, SandboxSpec
from ..lifecycle import transition, transition_row
from ..models import Node, Sandbox, SandboxEvent
from ..services import secrets as secret_svc
from ..services import spans
from ..services import volumes as volume_svc
from ..services.sandbox_calls import handle_of, sandbox_fail
from ..services.sandboxes import PAUSE_MODE_CHECKPOINT, PAUSE_MODE_STOP, WAITING_ON, resend
from .local import image_store, launcher_for, local_node_name

log = logging.getLogger(__name__)
S = Sandbox.Status


def node_sandbox_start(*, sandbox_id: str, traceparent: str = "") -> None:
    """Start the sandbox on this node; safe to run twice (only a pending row is claimed). Its
    phases are spans under ``traceparent`` (the create's), when given."""
    sandbox = transition_row(sandbox_id, to=S.STARTING, frm=[S.PENDING])
    if sandbox is None:
        return
    parent = spans.parse_traceparent(traceparent)
    with spans.span("sandbox.start", **spans.of(sandbox), parent=parent,
                    attributes={"hangar.node": local_node_name(), "hangar.image": sandbox.image}):  # fmt: skip
        _boot(sandbox_id, S.STARTING, sandbox)


def _steps(launch: spans.OpenSpan, steps: list[tuple[str, int, int]], sandbox: Sandbox) -> None:
    """The launcher's steps of a create (its disk, its network, the runtime up), as spans under
    the launch (``sandbox.start.disk`` …), with the times the launcher took them."""
    if not launch.context.trace_id:  # a start with no trace to hang them on
        return
    for name, start_ns, end_ns in steps:
        spans.record(f"sandbox.start.{name}", team_id=sandbox.team_id,
                     context=spans.SpanContext(launch.context.trace_id, spans.new_span_id()),
                     parent_span_id=launch.context.span_id, start_ns=start_ns, end_ns=end_ns,
                     attributes=spans.tie_attributes(sandbox))  # fmt: skip


def _phase(name: str, sandbox: Sandbox) -> Any:
    """A phase of a start as a span under it (a resume's start has none: nothing to hang it on)."""
    if spans.PARENT.get() is None:
        return contextlib.nullcontext(
            spans.OpenSpan(name, sandbox.team_id, spans.SpanContext("", ""), "", 0, 0)
        )
    return spans.span(f"sandbox.start.{name}", **spans.of(sandbox))


def _boot(sandbox_id: str, frm: str, sandbox: Sandbox | None = None) -> None:
    """Start (or start again, over its kept files) the sandbox whose row is ``frm`` (``sandbox``:
    that row, when the caller has just read it)."""
    if sandbox is None:
        sandbox = Sandbox.objects.get(id=sandbox_id)
    try:
        with _phase("image", sandbox):
            info = image_store().get(sandbox.image_digest)
    except ImageError:
        transition(
            sandbox_id,
            to=S.FAILED,
            frm=[frm],
            reason=f"image {sandbox.image} ({sandbox.image_digest}) is not on node {local_node_name()}",
        )
        return
    image_env = dict(e.split("=", 1) for e in info.config.get("env") or [] if "=" in e)
    launcher = launcher_for(sandbox.runtime)
    try:
        with _phase("volumes", sandbox):
            # A VM's kernel mounts its volumes itself: it gets their images as disks.
            mounts = volume_svc.sandbox_mounts(sandbox, as_disks=launcher.capabilities().vm)
    except VolumeError as exc:
        transition(sandbox_id, to=S.FAILED, frm=[frm], reason=f"its volumes could not be mounted: {exc}")
        return
    spec = SandboxSpec(
        mounts=mounts,
        id=sandbox.id,
        rootfs=info.rootfs,
        cpu=sandbox.cpu,
        memory_mb=sandbox.memory_mb,
        disk_mb=sandbox.disk_mb,
        env={**image_env, **sandbox.env, **secret_svc.env_for(sandbox), "HANGAR_SANDBOX_ID": sandbox.id},
        network=sandbox.network or None,
        hostname=sandbox.id,
        working_dir=info.config.get("working_dir") or "/",
    )
    resumed = "resumed"
    handle = None
    if frm == S.RESUMING and sandbox.paused_mode == PAUSE_MODE_CHECKPOINT:
        try:
            handle = launcher.restore(spec)
            resumed = "resumed from its checkpoint: processes continue"
        except LauncherError as exc:
            log.warning("sandbox %s could not be restored: %s", sandbox_id, exc)
            resumed = f"resumed afresh over its files: the checkpoint could not be restored ({exc})"
    try:
        if handle is None:
            # The launcher's create makes the disk and the network and starts the runtime.
            with _phase("launch", sandbox) as launch:
                launch.set({"hangar.runtime": sandbox.runtime, "hangar.network": bool(sandbox.network)})
                steps: list[tuple[str, int, int]] = []
                token = PHASES.set(steps)
                try:
                    handle = launcher.create(spec)
                finally:
                    PHASES.reset(token)
                    _steps(launch, steps, sandbox)
    except LauncherError as exc:
        log.warning("sandbox %s failed to start: %s", sandbox_id, exc)
        transition(sandbox_id, to=S.FAILED, frm=[frm], reason=str(exc))
        return
    now = timezone.now()
    # Started is active: its idle time counts from now (a resumed one's too), and its first
    # calls need not write that they were.
    fields: dict[str, Any] = {"handle": handle, "started_at": now, "last_activity_at": now, "paused_mode": ""}
    if frm == S.RESUMING:  # a resumed sandbox gets its time afresh
        fields["expires_at"] = now + timedelta(seconds=sandbox.timeout_s)
    started = transition(sandbox_id, to=S.RUNNING, frm=[frm], fields=fields,
                         reason=resumed if frm == S.RESUMING else "")  # fmt: skip
    if not started:
        # Deleted while starting: the destroy task may already have run and found nothing.
        launcher.destroy(handle)
        return
    events.sandbox_started.send(sandbox)  # a harness's sandbox sets up its workspace


def node_sandbox_pause(*, sandbox_id: str) -> None:
    """The node side of :func:`.sandboxes.sandbox_pause` (idempotent: only a pausing row is acted on)."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or sandbox.status != S.PAUSING:
        return
    launcher = launcher_for(sandbox.runtime)
    handle = handle_of(sandbox, launcher)
    fields: dict[str, Any] = {"handle": {}, "stopped_at": timezone.now()}
    why = ""
    if sandbox.paused_mode == PAUSE_MODE_CHECKPOINT:
        try:
            launcher.checkpoint(handle)
        except LauncherError as exc:
            # runsc stops a sandbox whose checkpoint failed: keep what a stop-mode pause keeps.
            log.warning("checkpoint of %s failed: %s", sandbox_id, exc)
            why = f"checkpoint failed ({exc}); "
            fields["paused_mode"] = PAUSE_MODE_STOP
        else:
            transition(sandbox_id, to=S.PAUSED, frm=[S.PAUSING], fields=fields,
                       reason="paused: checkpointed, processes and memory saved")  # fmt: skip
            return
    launcher.suspend(handle, keep_files=not sandbox.ephemeral)
    kept = "files on its volumes kept" if sandbox.ephemeral else "its files kept"
    transition(sandbox_id, to=S.PAUSED, frm=[S.PAUSING], fields=fields,
               reason=f"paused: {why}processes ended, {kept}")  # fmt: skip


def node_sandbox_resume(*, sandbox_id: str) -> None:
    """The node side of :func:`.sandboxes.sandbox_resume`."""
    if Sandbox.objects.filter(id=sandbox_id, status=S.RESUMING).exists():
        _boot(sandbox_id, S.RESUMING)


def node_sandbox_delete(*, sandbox_id: str) -> None:
    """Remove the sandbox's runtime resources from this node and mark it deleted."""
    _destroy_stopping(sandbox_id, S.DELETED)


def node_sandbox_stop(*, sandbox_id: str) -> None:
    """The node side of :func:`.sandboxes.sandbox_stop`."""
    _destroy_stopping(sandbox_id, S.STOPPED)


def _destroy_stopping(sandbox_id: str, to: str) -> None:
    """Destroy a stopping sandbox's runtime resources here, then move it to ``to``."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or sandbox.status != S.STOPPING:
        return
    launcher = launcher_for(sandbox.runtime)
    launcher.destroy(handle_of(sandbox, launcher))
    transition(sandbox_id, to=to, frm=[S.STOPPING], fields={"stopped_at": timezone.now(), "handle": {}})


# A paused sandbox's copy from another node that nothing has written to for this long is a move
# whose worker died: reconciliation removes it (runtime/node/moves.py).
INCOMING_IDLE_S = 3600.0


def node_reconcile(*, node_name: str) -> dict[str, list[str]]:
    """Make this node and the database agree: fail rows whose sandbox is gone, destroy
    runtime resources that no live row owns."""
    node = Node.objects.filter(name=node_name).first()
    report: dict[str, list[str]] = {
        "failed": [],
        "destroyed": [],
        "volumes_removed": [],
        "networks_removed": [],
    }
    if node is None:
        return report
    report["volumes_removed"] = volume_svc.volumes_reconcile()
    grace = timezone.now() - timedelta(seconds=120)
    for runtime in node.runtimes:
        launcher = launcher_for(runtime)
        # A row that changed after this snapshot may describe a sandbox the snapshot predates.
        snapshot_at = timezone.now()
        states = launcher.states()
        rows = {
            r.id: r
            for r in Sandbox.objects.filter(id__in=list(states)).only(
                "id", "status", "node_id", "updated_at", "runtime"
            )
        }
        for sandbox_id in states:
            row = rows.get(sandbox_id)
            if states[sandbox_id].status == "unknown":
                continue  # the runtime could not tell this time: decide nothing on it
            if row is None or row.status in (S.FAILED, S.DELETED, S.STOPPED) or row.node_id != node.id:
                launcher.destroy(launcher.handle_for(sandbox_id))
                report["destroyed"].append(sandbox_id)
        live = Sandbox.objects.filter(node=node, runtime=runtime, status__in=[S.RUNNING, S.STARTING])
        for row in live.only("id", "status", "updated_at"):
            if row.status == S.STARTING and row.updated_at > grace:
                continue  # being provisioned right now
            if row.updated_at >= snapshot_at:
                continue  # started (or changed) while the snapshot was being taken
            st = states.get(row.id)
            if st is not None and st.status in ("running", "paused", "unknown"):
                continue
            reason = (st.reason if st else None) or f"lost: node {node.name} no longer runs this sandbox"
            if sandbox_fail(sandbox_id=row.id, reason=reason):
                report["failed"].append(row.id)
            if st is not None:
                launcher.destroy(launcher.handle_for(row.id))
        # Namespaces, veths, rules and leases that no live sandbox owns go; allowlisted names
        # are re-resolved (and the rules follow them).
        # A sandbox paused in a checkpoint keeps its addresses (its saved network stack has them).
        holding = Sandbox.objects.filter(node=node, runtime=runtime,
                                         status__in=[S.STARTING, S.RUNNING, S.PAUSING, S.RESUMING, S.STOPPING,
                                                     S.PAUSED])  # fmt: skip
        report["networks_removed"] += launcher.network_reconcile(dict(holding.values_list("id", "network")))
        if swept := launcher.sweep_incoming(INCOMING_IDLE_S):
            log.warning("node %s removed copies of moves that stopped: %s", node.name, swept)
        if pruned := launcher.prune_images({info.rootfs for info in image_store().list()}):
            log.info(
                "node %s removed what the %s runtime kept for deleted images: %s", node.name, runtime, pruned
            )
    return report


# A start interrupted this many times by its worker's death is not tried again: it fails.
RESTARTS = 2


def node_recover(*, node_name: str, worker_started_at: datetime | None = None) -> dict[str, list[str]]:
    """What this node's worker, just started, owes the sandboxes its predecessor was working on
    when it died (a SIGKILL, an OOM kill, a crash): a start it was in the middle of is undone
    (what the runtime had made of it goes) and tried again, twice at most; the task of every
    other row waiting on this node (provision, suspend, resume, halt, destroy) is sent again,
    now rather than when the broker would give its message back. Every task is idempotent.

    One worker consumes a node's queue, but this runs as one of its tasks, beside the others it
    has already taken: a start that row says began after ``worker_started_at`` (when this
    worker's process started) is this worker's own, in progress, and is left alone."""
    report: dict[str, list[str]] = {"restarted": [], "failed": [], "resent": []}
    node = Node.objects.filter(name=node_name).first()
    if node is None:
        return report
    starting = Sandbox.objects.filter(node=node, status=S.STARTING)
    if worker_started_at is not None:
        starting = starting.filter(updated_at__lt=worker_started_at)
    for row in starting:
        launcher = launcher_for(row.runtime)
        with contextlib.suppress(LauncherError):
            launcher.destroy(handle_of(row, launcher))
        tries = SandboxEvent.objects.filter(
            sandbox_id=row.id, status_from=S.STARTING, status_to=S.PENDING
        ).count()
        if tries >= RESTARTS:
            if sandbox_fail(sandbox_id=row.id, reason=f"its start was interrupted {tries + 1} times: "
                            f"node {node_name}'s worker stopped during it each time"):  # fmt: skip
                report["failed"].append(row.id)
        elif transition(row.id, to=S.PENDING, frm=[S.STARTING],
                        reason=f"node {node_name}'s worker stopped during its start: starting it again"):  # fmt: skip
            report["restarted"].append(row.id)
    waiting = Sandbox.objects.filter(node=node, status__in=list(WAITING_ON))
    if worker_started_at is not None:  # a row that changed since has its task on the queue
        waiting = waiting.filter(Q(updated_at__lt=worker_started_at) | Q(id__in=report["restarted"]))
    for row in waiting.select_related("node"):
        resend(row)
        report["resent"].append(row.id)
    if any(report.values()):
        log.warning("node %s recovered its worker's lost work: %s", node_name, report)
    return report
