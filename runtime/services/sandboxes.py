"""Sandbox services: create, provision, exec, files, delete, reap, reconcile."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from .. import notify
from ..errors import Conflict, InvalidValue, NotFound
from ..launchers import launcher_class
from ..launchers.base import (
    ExecRequest,
    ExecResult,
    FileEntry,
    FileOpError,
    LauncherError,
    SandboxGone,
    SandboxNotRunning,
    SandboxSpec,
)
from ..launchers.images import ImageError
from ..launchers.volumes import VolumeError
from ..lifecycle import record_event, transition, transition_row
from ..models import Exec, Sandbox, Team, TeamPolicy
from ..node import image_store, launcher_for, local_node_name
from ..notify import wait_for_status
from . import audit, quotas
from . import secrets as secret_svc
from . import usage as usage_svc
from . import volumes as volume_svc
from .images import image_resolve
from .nodes import node_call, node_pick

log = logging.getLogger(__name__)
S = Sandbox.Status
SETTLED = (S.RUNNING, S.FAILED, S.STOPPING, S.STOPPED, S.DELETED)


# -- selectors --------------------------------------------------------------------------------


def sandboxes_for_team(*, team: Team, status: str | None = None) -> QuerySet[Sandbox]:
    qs = (
        Sandbox.objects.filter(team=team)
        .exclude(pool__isnull=False, claimed_at__isnull=True)  # warm pool members: nobody's yet
        .select_related("node")
        .prefetch_related("volume_mounts__volume")
    )
    if status:
        if status not in S.values:
            raise InvalidValue(f"unknown status {status!r}; one of: {', '.join(S.values)}")
        return qs.filter(status=status)
    return qs.exclude(status=S.DELETED)


def sandbox_get(*, team: Team, sandbox_id: str) -> Sandbox:
    try:
        return Sandbox.objects.select_related("node").get(team=team, id=sandbox_id)
    except Sandbox.DoesNotExist:
        # Another team's sandbox is reported exactly like one that does not exist.
        raise NotFound(f"no sandbox {sandbox_id!r}") from None


# -- create -----------------------------------------------------------------------------------


def resolve_disk_mb(disk_mb: int | None) -> int:
    """The size of a new sandbox's own disk: ``disk_mb`` checked, or the node's default."""
    if disk_mb is None:
        return int(settings.HANGAR_SANDBOX_DISK_MB)
    lo, hi = settings.HANGAR_SANDBOX_MIN_DISK_MB, settings.HANGAR_SANDBOX_MAX_DISK_MB
    if isinstance(disk_mb, bool) or not isinstance(disk_mb, int) or not lo <= disk_mb <= hi:
        raise InvalidValue(f"disk_mb must be between {lo} and {hi}, got {disk_mb}")
    return disk_mb


def _validate_limits(*, cpu: float, memory_mb: int, timeout_s: int) -> None:
    max_cpu = settings.HANGAR_SANDBOX_MAX_CPU
    if not 0.1 <= cpu <= max_cpu:
        raise InvalidValue(f"cpu must be between 0.1 and {max_cpu:g}, got {cpu:g}")
    lo, hi = settings.HANGAR_SANDBOX_MIN_MEMORY_MB, settings.HANGAR_SANDBOX_MAX_MEMORY_MB
    if not lo <= memory_mb <= hi:
        raise InvalidValue(f"memory_mb must be between {lo} and {hi}, got {memory_mb}")
    max_t = settings.HANGAR_SANDBOX_MAX_TIMEOUT_S
    if not 1 <= timeout_s <= max_t:
        raise InvalidValue(f"timeout_s must be between 1 and {max_t}, got {timeout_s}")


def validate_network(network: dict[str, Any] | None, *, runtime: str) -> dict[str, Any]:
    """``{"egress": "none" | "allowlist" | "all", "allow": [...]}`` checked ({} for none)."""
    from ..launchers.network import validate_policy

    try:
        policy = validate_policy(network)
    except ValueError as exc:
        raise InvalidValue(f"network: {exc}") from None
    if not policy.enabled:
        return {}
    try:
        able = launcher_class(runtime).can_network
    except LauncherError:
        able = True  # an unknown runtime is refused with its own message
    if not able:
        raise InvalidValue(f"the {runtime} runtime gives sandboxes no network")
    return policy.as_dict()


def sandbox_set_network(*, sandbox: Sandbox, network: dict[str, Any] | None) -> Sandbox:
    """Change the sandbox's egress policy: at once if it runs with a network (one nftables
    transaction on its node), else from its next start."""
    net = validate_network(network, runtime=sandbox.runtime)
    if sandbox.network and not net:
        # It keeps its network, with nothing let out: its namespace stays (a checkpoint holds a
        # network stack that needs it back, and egress can be opened again while it runs).
        net = {"egress": "none", "allow": []}
    if sandbox.status == S.DELETED:
        raise Conflict(f"sandbox {sandbox.id} is deleted", status=sandbox.status)
    if sandbox.status in (S.PENDING, S.STARTING, S.RESUMING, S.PAUSING, S.STOPPING):
        # Its node is reading the policy right now: a change could land after and be lost.
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}; change its network once it has settled",
                       status=sandbox.status)  # fmt: skip
    if (
        sandbox.status == S.PAUSED
        and sandbox.paused_mode == PAUSE_MODE_CHECKPOINT
        and not sandbox.network
        and net
    ):
        raise Conflict(
            f"sandbox {sandbox.id} was checkpointed without a network, and it resumes as it was saved: "
            "resume it, pause it with mode stop, then set its network (or create it with a network)",
            status=sandbox.status,
        )
    if sandbox.status == S.RUNNING:
        if not sandbox.network and net:
            raise Conflict(
                f"sandbox {sandbox.id} was started without a network, and a running sandbox cannot be given "
                "one: pause it, set its network, and resume it (or create it with a network)",
                status=sandbox.status,
            )  # fmt: skip

        sandbox_network_apply(sandbox, net)
    network_store(sandbox.id, net)
    audit.record("sandbox.network", team=sandbox.team, target=sandbox.id, **net)
    sandbox.network = net
    return sandbox


def network_store(sandbox_id: str, net: dict[str, Any]) -> None:
    """The sandbox's row and events say ``net`` is its policy (once its node enforces it)."""
    Sandbox.objects.filter(id=sandbox_id).update(network=net, updated_at=timezone.now())
    record_event(sandbox_id, "network", f"egress {net.get('egress', 'none')}", **net)


def sandbox_network_apply(sandbox: Sandbox, net: dict[str, Any]) -> None:
    """Put ``net`` in force for the running sandbox on its node (this one, or another through
    its queue); raises what the node says."""

    def apply() -> None:
        if _is_local(sandbox):
            launcher_for(sandbox.runtime).set_network(sandbox.id, net)
        else:
            _remote(sandbox, "network", {"policy": net}, timeout=30)

    _sandbox_call(sandbox, apply)


def _validate_env(env: dict[str, str]) -> None:
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise InvalidValue(
                f"env name {key!r} is not a valid variable name (letters, digits, _; not starting with a digit)"
            )
        if "\0" in value:
            raise InvalidValue(f"env value of {key} contains a NUL byte")


def sandbox_create(
    *,
    team: Team,
    user: AbstractBaseUser | None,
    image: str,
    runtime: str = "gvisor",
    cpu: float = 1.0,
    memory_mb: int = 512,
    timeout_s: int = 300,
    env: dict[str, str] | None = None,
    metadata: dict[str, Any] | None = None,
    volumes: list[volume_svc.VolumeMount] | None = None,
    ephemeral: bool = False,
    on_expire: str = "destroy",
    idle_timeout_s: int | None = None,
    pause_mode: str = "stop",
    secrets: list[str] | None = None,
    ports: list[Any] | None = None,
    auto_resume: bool = False,
    network: dict[str, Any] | None = None,
    disk_mb: int | None = None,
) -> Sandbox:
    """Write a pending sandbox on a node with room (the node of its volumes, if it attaches
    any) and enqueue its provisioning on that node."""
    env = env or {}
    _validate_limits(cpu=cpu, memory_mb=memory_mb, timeout_s=timeout_s)
    disk_mb = resolve_disk_mb(disk_mb)
    _validate_env(env)
    if on_expire not in (ON_EXPIRE_PAUSE, ON_EXPIRE_DESTROY):
        raise InvalidValue(f"on_expire must be pause or destroy, got {on_expire!r}")
    if idle_timeout_s is not None and not 10 <= idle_timeout_s <= settings.HANGAR_SANDBOX_MAX_TIMEOUT_S:
        raise InvalidValue(
            f"idle_timeout_s must be between 10 and {settings.HANGAR_SANDBOX_MAX_TIMEOUT_S}, got {idle_timeout_s}"
        )
    net = validate_network(network, runtime=runtime)
    _validate_pause_mode(pause_mode, runtime=runtime, ephemeral=ephemeral)
    secret_names = secret_svc.validate_names(team=team, names=secrets or [], env=env)
    from .previews import validate_ports

    port_list = validate_ports(ports or [])
    # The team's policy row once, for its limits and its budget.
    policy = TeamPolicy.objects.filter(team=team).first()
    eff = quotas.effective(team, policy)
    quotas.check(team, lifetime_s=timeout_s, eff=eff)
    usage_svc.budget_check(team, policy)
    image_row = image_resolve(image)
    mounts = volume_svc.resolve_mounts(team=team, mounts=volumes or [])
    if not mounts and not ephemeral:
        # A warm pool of the team keeps this spec started: take one of its members (one with a
        # network of its own when this asks for egress; the claim sets the policy).
        from .pools import claim_network, pool_claim

        def claimed_now(member_id: str, pool_id: str) -> None:  # in the claim's transaction
            audit.record("sandbox.create", team=team, target=member_id, image=image_row.name, cpu=cpu,
                         memory_mb=memory_mb, pool=pool_id, secrets=secret_names)  # fmt: skip

        claimed = pool_claim(
            team=team, image=image_row.name, runtime=runtime, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb,
            claim={"env": env, "metadata": metadata or {}, "timeout_s": timeout_s, "on_expire": on_expire,
                   "idle_timeout_s": idle_timeout_s, "pause_mode": pause_mode, "secrets": secret_names,
                   "ports": port_list, "auto_resume": auto_resume,
                   "created_by": user if user is not None and user.is_authenticated else None},
            network=bool(net), on_claim=None if net else claimed_now,
        )  # fmt: skip
        if claimed is not None and net:
            # Its row takes the policy once the node enforces it; a member that cannot take it
            # is gone, and the create starts a sandbox of its own.
            if claim_network(claimed.id, net):
                claimed_now(claimed.id, claimed.pool_id)
                claimed.network = net
            else:
                claimed = None
        if claimed is not None:
            return claimed
    now = timezone.now()
    with transaction.atomic():
        quotas.lock_team(team)
        quotas.check(team, sandboxes=1, vcpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb, eff=eff)
        node = node_pick(
            runtime=runtime, cpu=cpu, memory_mb=memory_mb, image=image_row,
            node_id=volume_svc.volume_node_id(mounts),
        )  # fmt: skip
        sandbox = Sandbox.objects.create(
            team=team,
            created_by=user if user is not None and user.is_authenticated else None,
            image=image_row.name,
            image_digest=image_row.digest,
            runtime=runtime,
            node=node,
            cpu=cpu,
            memory_mb=memory_mb,
            disk_mb=disk_mb,
            timeout_s=timeout_s,
            env=env,
            secrets=secret_names,
            ports=port_list,
            auto_resume=auto_resume,
            network=net,
            metadata=metadata or {},
            ephemeral=ephemeral,
            on_expire=on_expire,
            idle_timeout_s=idle_timeout_s,
            pause_mode=pause_mode,
            expires_at=now + timedelta(seconds=timeout_s),
        )
        volume_svc.attach(sandbox=sandbox, resolved=mounts)
        record_event(sandbox.id, "status", f"scheduled on node {node.name}", node=node.name)
        audit.record("sandbox.create", team=team, target=sandbox.id, image=image_row.name, cpu=cpu,
                     memory_mb=memory_mb, node=node.name, secrets=secret_names,
                     volumes=[v.name for v, _ in mounts])  # fmt: skip
        transaction.on_commit(lambda: _enqueue("provision", sandbox.id, node.queue))
    return sandbox


def _enqueue(task_name: str, sandbox_id: str, queue: str) -> None:
    from kombu.exceptions import OperationalError

    from .. import tasks

    try:
        getattr(tasks, task_name).apply_async(args=[sandbox_id], queue=queue, retry=True,
                                              retry_policy={"max_retries": 3, "interval_start": 0.2})  # fmt: skip
    except OperationalError as exc:
        # The row is committed; without its task it would wait forever. Say why instead.
        log.error("could not enqueue %s for %s: %s", task_name, sandbox_id, exc)
        if task_name == "provision":
            sandbox_fail(sandbox_id=sandbox_id, reason=f"the task queue is unreachable: {exc}")


def sandbox_wait(*, sandbox: Sandbox, timeout: float, statuses: Iterable[str] = SETTLED) -> Sandbox:
    """Wait until the sandbox reaches one of ``statuses`` (or the timeout); returns the fresh row."""

    def read() -> str:
        return Sandbox.objects.filter(id=sandbox.id).values_list("status", flat=True).first() or S.DELETED

    wait_for_status(sandbox.id, statuses, timeout, read)
    sandbox.refresh_from_db()
    return sandbox


# -- on the node ------------------------------------------------------------------------------


def sandbox_start_member(*, pool: Any) -> Sandbox:
    """Start one member of a warm pool: the pool's spec, nobody's env, no expiry until claimed."""
    from ..models import Pool

    image_row = image_resolve(pool.image)
    with transaction.atomic():
        # Locked, so a pool being deleted meanwhile gets no new member.
        if not Pool.objects.select_for_update().filter(id=pool.id).exists():
            raise NotFound(f"pool {pool.id} was deleted")
        quotas.lock_team(pool.team)
        quotas.check(pool.team, sandboxes=1, vcpu=pool.cpu, memory_mb=pool.memory_mb, disk_mb=pool.disk_mb)
        node = node_pick(runtime=pool.runtime, cpu=pool.cpu, memory_mb=pool.memory_mb, image=image_row)
        sandbox = Sandbox.objects.create(
            team=pool.team, image=image_row.name, image_digest=image_row.digest, runtime=pool.runtime,
            node=node, cpu=pool.cpu, memory_mb=pool.memory_mb, disk_mb=pool.disk_mb, pool=pool, expires_at=None,
            network={"egress": "none", "allow": []} if pool.network else {},
        )  # fmt: skip
        record_event(sandbox.id, "status", f"warm member of pool {pool.id}, scheduled on node {node.name}",
                     node=node.name, pool=pool.id)  # fmt: skip
        transaction.on_commit(lambda: _enqueue("provision", sandbox.id, node.queue))
    return sandbox


def sandbox_provision(*, sandbox_id: str) -> None:
    """Start the sandbox on this node; safe to run twice (only a pending row is claimed)."""
    sandbox = transition_row(sandbox_id, to=S.STARTING, frm=[S.PENDING])
    if sandbox is None:
        return
    _boot(sandbox_id, S.STARTING, sandbox)


def _boot(sandbox_id: str, frm: str, sandbox: Sandbox | None = None) -> None:
    """Start (or start again, over its kept files) the sandbox whose row is ``frm`` (``sandbox``:
    that row, when the caller has just read it)."""
    if sandbox is None:
        sandbox = Sandbox.objects.get(id=sandbox_id)
    try:
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
    try:
        mounts = volume_svc.sandbox_mounts(sandbox)
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
    launcher = launcher_for(sandbox.runtime)
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
            handle = launcher.create(spec)
    except LauncherError as exc:
        log.warning("sandbox %s failed to start: %s", sandbox_id, exc)
        transition(sandbox_id, to=S.FAILED, frm=[frm], reason=str(exc))
        return
    now = timezone.now()
    fields: dict[str, Any] = {"handle": handle, "started_at": now, "paused_mode": ""}
    if frm == S.RESUMING:  # a resumed sandbox gets its time afresh
        fields["expires_at"] = now + timedelta(seconds=sandbox.timeout_s)
    started = transition(sandbox_id, to=S.RUNNING, frm=[frm], fields=fields,
                         reason=resumed if frm == S.RESUMING else "")  # fmt: skip
    if not started:
        # Deleted while starting: the destroy task may already have run and found nothing.
        launcher.destroy(handle)
        return
    if (sandbox.metadata or {}).get("harness"):
        from .harnesses import harness_setup_enqueue

        harness_setup_enqueue(sandbox)


# -- pause and resume -------------------------------------------------------------------------

PAUSE_MODE_STOP, PAUSE_MODE_CHECKPOINT = "stop", "checkpoint"
PAUSE_MODES = (PAUSE_MODE_STOP, PAUSE_MODE_CHECKPOINT)


def _validate_pause_mode(mode: str, *, runtime: str, ephemeral: bool) -> None:
    if mode not in PAUSE_MODES:
        raise InvalidValue(f"unknown pause mode {mode!r}; one of: {', '.join(PAUSE_MODES)}")
    if mode == PAUSE_MODE_CHECKPOINT:
        if ephemeral:
            raise InvalidValue("an ephemeral sandbox keeps nothing outside its volumes when paused, "
                               "so it cannot be checkpointed: pause it with mode stop")  # fmt: skip
        try:
            able = launcher_class(runtime).can_checkpoint
        except LauncherError:
            able = True  # an unknown runtime is refused with its own message
        if not able:
            raise InvalidValue(f"the {runtime} runtime cannot checkpoint; pause it with mode stop")


ON_EXPIRE_PAUSE, ON_EXPIRE_DESTROY = "pause", "destroy"
ACTIVITY_EVERY_S = 5  # last_activity_at is written at most this often per sandbox


def sandbox_mark_active(sandbox_id: str, last: Any = None) -> None:
    """Someone used the sandbox (an API call on it, an exec, terminal traffic): it is not idle.
    ``last``: its ``last_activity_at`` as just read, if at hand; recent enough, nothing is
    written (no write at all on most calls, which matters on SQLite)."""
    now = timezone.now()
    if last is not None and now - last < timedelta(seconds=ACTIVITY_EVERY_S):
        return
    Sandbox.objects.filter(id=sandbox_id).filter(
        Q(last_activity_at__isnull=True) | Q(last_activity_at__lt=now - timedelta(seconds=ACTIVITY_EVERY_S))
    ).update(last_activity_at=now)


def sandbox_pause(*, sandbox: Sandbox, mode: str | None = None, reason: str = "") -> Sandbox:
    """Pause a running sandbox; either way its CPU and memory are freed. ``stop``: its
    processes and terminals end; its files stay (on volumes, and outside them unless it is
    ephemeral). ``checkpoint``: gVisor saves the whole sandbox, processes and memory included,
    and resume continues them. ``mode`` defaults to the sandbox's ``pause_mode``."""
    mode = mode or sandbox.pause_mode or PAUSE_MODE_STOP
    _validate_pause_mode(mode, runtime=sandbox.runtime, ephemeral=sandbox.ephemeral)
    if sandbox.status != S.RUNNING:
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}; only a running sandbox can be paused",
                       status=sandbox.status)  # fmt: skip
    if not transition(sandbox.id, to=S.PAUSING, frm=[S.RUNNING], reason=reason or f"pausing (mode {mode})",
                      fields={"paused_mode": mode}):  # fmt: skip
        raise Conflict(f"sandbox {sandbox.id} changed meanwhile; try again")
    assert sandbox.node is not None
    audit.record("sandbox.pause", team=sandbox.team, target=sandbox.id, mode=mode, reason=reason)
    transaction.on_commit(lambda: _enqueue("suspend", sandbox.id, sandbox.node.queue))
    sandbox.status = S.PAUSING
    return sandbox


def sandbox_suspend(*, sandbox_id: str) -> None:
    """The node side of :func:`sandbox_pause` (idempotent: only a pausing row is acted on)."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or sandbox.status != S.PAUSING:
        return
    launcher = launcher_for(sandbox.runtime)
    fields: dict[str, Any] = {"handle": {}, "stopped_at": timezone.now()}
    why = ""
    if sandbox.paused_mode == PAUSE_MODE_CHECKPOINT:
        try:
            launcher.checkpoint(sandbox_id)
        except LauncherError as exc:
            # runsc stops a sandbox whose checkpoint failed: keep what a stop-mode pause keeps.
            log.warning("checkpoint of %s failed: %s", sandbox_id, exc)
            why = f"checkpoint failed ({exc}); "
            fields["paused_mode"] = PAUSE_MODE_STOP
        else:
            transition(sandbox_id, to=S.PAUSED, frm=[S.PAUSING], fields=fields,
                       reason="paused: checkpointed, processes and memory saved")  # fmt: skip
            return
    launcher.suspend(sandbox_id, keep_files=not sandbox.ephemeral)
    kept = "files on its volumes kept" if sandbox.ephemeral else "its files kept"
    transition(sandbox_id, to=S.PAUSED, frm=[S.PAUSING], fields=fields,
               reason=f"paused: {why}processes ended, {kept}")  # fmt: skip


def sandbox_resume(*, sandbox: Sandbox) -> Sandbox:
    """Start a paused sandbox again on its node, over the files it had."""
    if sandbox.status != S.PAUSED:
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}; only a paused sandbox can be resumed",
                       status=sandbox.status)  # fmt: skip
    image_row = image_resolve(sandbox.image)
    with transaction.atomic():
        quotas.lock_team(sandbox.team)
        # (Its disk stayed its own while paused, and counted: nothing more to check for it.)
        quotas.check(sandbox.team, sandboxes=1, vcpu=sandbox.cpu, memory_mb=sandbox.memory_mb)
        # Its files are on its node: it needs room there again (a paused sandbox held none).
        node = node_pick(runtime=sandbox.runtime, cpu=sandbox.cpu, memory_mb=sandbox.memory_mb,
                         image=image_row, node_id=sandbox.node_id)  # fmt: skip
        if not transition(sandbox.id, to=S.RESUMING, frm=[S.PAUSED], reason="resuming"):
            raise Conflict(f"sandbox {sandbox.id} changed meanwhile; try again")
        audit.record("sandbox.resume", team=sandbox.team, target=sandbox.id)
        transaction.on_commit(lambda: _enqueue("resume", sandbox.id, node.queue))
    sandbox.status = S.RESUMING
    return sandbox


def sandbox_restart(*, sandbox_id: str) -> None:
    """The node side of :func:`sandbox_resume`."""
    if Sandbox.objects.filter(id=sandbox_id, status=S.RESUMING).exists():
        _boot(sandbox_id, S.RESUMING)


def sandbox_destroy(*, sandbox_id: str) -> None:
    """Remove the sandbox's runtime resources from this node and mark it deleted."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or sandbox.status != S.STOPPING:
        return
    launcher_for(sandbox.runtime).destroy_id(sandbox_id)
    transition(
        sandbox_id, to=S.DELETED, frm=[S.STOPPING], fields={"stopped_at": timezone.now(), "handle": {}}
    )


def sandbox_fail(*, sandbox_id: str, reason: str) -> bool:
    """Record that the sandbox died (out of memory, lost by its node…) with the reason."""
    return transition(
        sandbox_id, to=S.FAILED, frm=[S.PENDING, S.STARTING, S.RUNNING, S.PAUSING, S.RESUMING], reason=reason,
        fields={"stopped_at": timezone.now()},
    )  # fmt: skip


# -- delete and expiry ------------------------------------------------------------------------


def sandbox_delete(*, sandbox: Sandbox, reason: str = "deleted") -> None:
    """Stop and destroy the sandbox wherever it runs; the row stays, as ``deleted``."""
    if sandbox.status == S.DELETED:
        return
    moved = transition(
        sandbox.id, to=S.STOPPING, reason=reason,
        frm=[S.PENDING, S.STARTING, S.RUNNING, S.STOPPED, S.FAILED, S.PAUSING, S.PAUSED, S.RESUMING],
    )  # fmt: skip
    if not moved:
        sandbox.refresh_from_db()
        if sandbox.status != S.STOPPING:
            return
    else:
        audit.record("sandbox.delete", team=sandbox.team, target=sandbox.id, reason=reason)
    if sandbox.node_id is None:
        transition(sandbox.id, to=S.DELETED, frm=[S.STOPPING], fields={"stopped_at": timezone.now()})
        return
    queue = sandbox.node.queue  # type: ignore[union-attr]
    transaction.on_commit(lambda: _enqueue("destroy", sandbox.id, queue))


def sandbox_stop(*, sandbox: Sandbox, reason: str = "stopped") -> None:
    """Stop the sandbox's processes and free what it holds on its node; the row stays, as
    ``stopped``, with its events and history. Files outside volumes do not survive."""
    if sandbox.status in (S.STOPPED, S.STOPPING):
        return
    if sandbox.status == S.DELETED:
        raise Conflict(f"sandbox {sandbox.id} is deleted", status=sandbox.status)
    moved = transition(
        sandbox.id, to=S.STOPPING, frm=[S.PENDING, S.STARTING, S.RUNNING, S.FAILED, S.PAUSED], reason=reason
    )
    if not moved:
        return
    audit.record("sandbox.stop", team=sandbox.team, target=sandbox.id, reason=reason)
    if sandbox.node_id is None:
        transition(sandbox.id, to=S.STOPPED, frm=[S.STOPPING], fields={"stopped_at": timezone.now()})
        return
    queue = sandbox.node.queue  # type: ignore[union-attr]
    transaction.on_commit(lambda: _enqueue("halt", sandbox.id, queue))


def sandbox_halt(*, sandbox_id: str) -> None:
    """The node side of :func:`sandbox_stop`."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or sandbox.status != S.STOPPING:
        return
    launcher_for(sandbox.runtime).destroy_id(sandbox_id)
    transition(
        sandbox_id, to=S.STOPPED, frm=[S.STOPPING], fields={"stopped_at": timezone.now(), "handle": {}}
    )


def sandbox_keepalive(*, sandbox: Sandbox, timeout_s: int) -> Sandbox:
    """Move the sandbox's expiry to ``timeout_s`` seconds from now."""
    if sandbox.status not in (S.PENDING, S.STARTING, S.RUNNING):
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}; only a live sandbox can be kept alive",
                       status=sandbox.status)  # fmt: skip
    limit = settings.HANGAR_SANDBOX_MAX_TIMEOUT_S
    if not 1 <= timeout_s <= limit:
        raise InvalidValue(f"timeout_s must be between 1 and {limit}, got {timeout_s}")
    quotas.check(sandbox.team, lifetime_s=timeout_s)
    sandbox.expires_at = timezone.now() + timedelta(seconds=timeout_s)
    Sandbox.objects.filter(id=sandbox.id).update(expires_at=sandbox.expires_at, updated_at=timezone.now())
    record_event(sandbox.id, "keepalive", f"expiry extended to {timeout_s} s from now", timeout_s=timeout_s)
    notify.sandbox_changed(sandbox.id, sandbox.status, sandbox.team_id)
    return sandbox


def sandboxes_touch(*, sandbox_ids: Iterable[str]) -> list[str]:
    """Someone is at work in these sandboxes (an open terminal, a command's viewer typing or
    reading): push each one's expiry out to its ``timeout_s`` from now, as Coder bumps a
    workspace's deadline on activity. Never brings an expiry closer. Returns the ids moved."""
    now = timezone.now()
    moved = []
    for sb in Sandbox.objects.filter(id__in=list(sandbox_ids), status=S.RUNNING).only(
        "id", "team_id", "status", "timeout_s", "expires_at"
    ):
        until = now + timedelta(seconds=sb.timeout_s)
        Sandbox.objects.filter(id=sb.id).update(last_activity_at=now)  # not idle, either
        if Sandbox.objects.filter(id=sb.id, status=S.RUNNING, expires_at__lt=until).update(
            expires_at=until, updated_at=now
        ):
            moved.append(sb.id)
            notify.sandbox_changed(sb.id, sb.status, sb.team_id)
    return moved


def sandboxes_reap_expired() -> int:
    """Act on every sandbox past its ``expires_at`` (pause it or delete it, per its
    ``on_expire``) or idle past its ``idle_timeout_s`` (pause it: nothing is lost). Every
    automatic action is an event that says why."""
    count = 0
    now = timezone.now()
    expired = Sandbox.objects.filter(
        status__in=[S.PENDING, S.STARTING, S.RUNNING, S.FAILED], expires_at__lte=now
    ).select_related("node")
    expired = list(expired[:500])
    from .harnesses import harnesses_with_active_runs

    working = harnesses_with_active_runs([sb.id for sb in expired if sb.on_expire == ON_EXPIRE_PAUSE])
    for sandbox in expired:
        why = f"its timeout of {sandbox.timeout_s} s was reached"
        if sandbox.id in working:
            continue  # a harness with a run going pauses once the run has ended
        if sandbox.on_expire == ON_EXPIRE_PAUSE and sandbox.status == S.RUNNING:
            with contextlib.suppress(Conflict):
                sandbox_pause(sandbox=sandbox, reason=f"pausing: {why}")
        else:
            sandbox_delete(sandbox=sandbox, reason=f"expired: {why}")
        count += 1
    idle = list(
        Sandbox.objects.filter(status=S.RUNNING, idle_timeout_s__isnull=False).select_related("node")[:2000]
    )
    from .harnesses import harnesses_with_active_runs

    busy = harnesses_with_active_runs([sb.id for sb in idle])  # a run going is activity
    for sandbox in idle:
        if sandbox.id in busy:
            continue
        since = sandbox.last_activity_at or sandbox.started_at or sandbox.created_at
        idle_s = (now - since).total_seconds()
        if idle_s >= sandbox.idle_timeout_s:  # type: ignore[operator]
            with contextlib.suppress(Conflict):
                sandbox_pause(sandbox=sandbox, reason=f"pausing: idle for {idle_s:.0f} s "
                              f"(idle_timeout_s {sandbox.idle_timeout_s})")  # fmt: skip
                count += 1
    # Pause and resume tasks lost with a dead worker: send them again (both are idempotent).
    for status, task in ((S.PAUSING, "suspend"), (S.RESUMING, "resume")):
        for sandbox in Sandbox.objects.filter(
            status=status, updated_at__lte=now - timedelta(minutes=2)
        ).select_related("node")[:100]:
            if sandbox.node is not None:
                _enqueue(task, sandbox.id, sandbox.node.queue)
    # Destroy tasks lost with a dead worker: re-send for rows stuck in stopping.
    stuck = Sandbox.objects.filter(status=S.STOPPING, updated_at__lte=timezone.now() - timedelta(minutes=2))
    for sandbox in stuck.select_related("node")[:100]:
        if sandbox.node is not None:
            _enqueue("destroy", sandbox.id, sandbox.node.queue)
    return count


def node_reconcile(*, node_name: str) -> dict[str, list[str]]:
    """Make this node and the database agree: fail rows whose sandbox is gone, destroy
    runtime resources that no live row owns."""
    from ..models import Node

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
    for runtime in node.runtimes or ["gvisor"]:
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
            if row is None or row.status in (S.FAILED, S.DELETED, S.STOPPED) or row.node_id != node.id:
                launcher.destroy_id(sandbox_id)
                report["destroyed"].append(sandbox_id)
        live = Sandbox.objects.filter(node=node, runtime=runtime, status__in=[S.RUNNING, S.STARTING])
        for row in live.only("id", "status", "updated_at"):
            if row.status == S.STARTING and row.updated_at > grace:
                continue  # being provisioned right now
            if row.updated_at >= snapshot_at:
                continue  # started (or changed) while the snapshot was being taken
            st = states.get(row.id)
            if st is not None and st.status in ("running", "paused"):
                continue
            reason = (st.reason if st else None) or f"lost: node {node.name} no longer runs this sandbox"
            if sandbox_fail(sandbox_id=row.id, reason=reason):
                report["failed"].append(row.id)
            if st is not None:
                launcher.destroy_id(row.id)
        # Namespaces, veths, rules and leases that no live sandbox owns go; allowlisted names
        # are re-resolved (and the rules follow them).
        # A sandbox paused in a checkpoint keeps its addresses (its saved network stack has them).
        holding = Sandbox.objects.filter(node=node, runtime=runtime,
                                         status__in=[S.STARTING, S.RUNNING, S.PAUSING, S.RESUMING, S.STOPPING,
                                                     S.PAUSED])  # fmt: skip
        report["networks_removed"] += launcher.network_reconcile(dict(holding.values_list("id", "network")))
    return report


# -- exec and files ---------------------------------------------------------------------------


@dataclass
class ExecOutcome:
    exec: Exec
    result: ExecResult


def _require_running(sandbox: Sandbox) -> None:
    if sandbox.status != S.RUNNING:
        detail = f": {sandbox.status_reason}" if sandbox.status_reason else ""
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}{detail}", status=sandbox.status)


def _check_path(path: str) -> str:
    if not path or not path.startswith("/"):
        raise InvalidValue(f"path must be absolute (start with /), got {path!r}")
    if "\0" in path:
        raise InvalidValue("path contains a NUL byte")
    return posixpath.normpath(path) if path != "/" else "/"


def _runtime_failure(sandbox: Sandbox, exc: LauncherError) -> Conflict:
    reason = exc.reason if isinstance(exc, SandboxNotRunning) else str(exc)
    if isinstance(exc, (SandboxNotRunning, SandboxGone)):
        sandbox_fail(sandbox_id=sandbox.id, reason=reason)
        sandbox.refresh_from_db()
    return Conflict(f"sandbox {sandbox.id} is no longer running: {reason}", status=sandbox.status)


def _is_local(sandbox: Sandbox) -> bool:
    return sandbox.node is not None and sandbox.node.name == local_node_name()


def _remote(sandbox: Sandbox, op: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one node operation on the sandbox's node through its queue and wait for the answer."""
    from .. import tasks

    assert sandbox.node is not None
    answer = node_call(sandbox.node, tasks.node_op, [op, sandbox.id, payload], timeout)
    if "error" in answer:
        kind = answer["error"]
        if kind == "file":
            raise FileOpError(answer["errno"], answer["message"])
        if kind == "not_running":
            raise SandboxNotRunning(answer["message"], reason=answer["message"])
        raise LauncherError(answer["message"])
    return answer


def node_op(*, op: str, sandbox_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The node side of :func:`_remote`: JSON in, JSON out."""
    sandbox = Sandbox.objects.filter(id=sandbox_id).first()
    if sandbox is None or not sandbox.handle:
        return {"error": "not_running", "message": f"sandbox {sandbox_id} is not running on this node"}
    launcher = launcher_for(sandbox.runtime)
    try:
        if op == "exec":
            req = ExecRequest(
                argv=payload["argv"], env=payload["env"], cwd=payload["cwd"],
                stdin=base64.b64decode(payload["stdin"]) if payload["stdin"] is not None else None,
                timeout=payload["timeout"], max_output=payload["max_output"],
            )  # fmt: skip
            r = launcher.exec(sandbox.handle, req)
            return {
                "exit_code": r.exit_code, "stdout": base64.b64encode(r.stdout).decode(),
                "stderr": base64.b64encode(r.stderr).decode(), "duration_ms": r.duration_ms,
                "timed_out": r.timed_out, "signal": r.signal, "truncated": r.truncated,
            }  # fmt: skip
        if op == "read":
            entry, chunks = launcher.read_file(sandbox.handle, payload["path"])
            return {"entry": entry.__dict__, "data": base64.b64encode(b"".join(chunks)).decode()}
        if op == "write":
            n = launcher.write_file(sandbox.handle, payload["path"], base64.b64decode(payload["data"]))
            return {"size": n}
        if op == "list":
            return {"entries": [e.__dict__ for e in launcher.list_files(sandbox.handle, payload["path"])]}
        if op == "network":
            launcher.set_network(sandbox.id, payload["policy"])
            return {}
        if op == "stats":
            return dataclasses.asdict(launcher.stats(sandbox.handle))
    except FileOpError as exc:
        return {"error": "file", "errno": exc.errno_name, "message": exc.message}
    except SandboxNotRunning as exc:
        return {"error": "not_running", "message": exc.reason}
    except LauncherError as exc:
        return {"error": "launcher", "message": str(exc)}
    return {"error": "launcher", "message": f"unknown node operation {op!r}"}


def _decode_for_storage(data: bytes, limit: int) -> str:
    return (
        data[:limit].decode("utf-8", errors="replace").replace("\x00", "\ufffd")
    )  # a text column holds no NUL


def exec_validate(
    *, cmd: str | list[str], env: dict[str, str] | None, cwd: str | None, timeout_s: float | None
) -> tuple[list[str], dict[str, str], str | None]:
    """Check a command's parameters; returns (argv, env, cwd). ``timeout_s=None``: no limit."""
    if isinstance(cmd, str):
        if not cmd.strip():
            raise InvalidValue("cmd must not be empty")
        argv = ["/bin/sh", "-c", cmd]
    else:
        if not cmd or not all(isinstance(a, str) for a in cmd) or not cmd[0]:
            raise InvalidValue("cmd must be a non-empty string or a non-empty list of strings")
        argv = list(cmd)
    if any("\0" in a for a in argv):
        raise InvalidValue("cmd contains a NUL byte")
    env = env or {}
    _validate_env(env)
    max_timeout = settings.HANGAR_EXEC_MAX_TIMEOUT_S
    if timeout_s is not None and not 0 < timeout_s <= max_timeout:
        raise InvalidValue(f"timeout_s must be between 1 and {max_timeout}, got {timeout_s:g}")
    if cwd is not None:
        cwd = _check_path(cwd)
    return argv, env, cwd


def sandbox_exec(
    *,
    sandbox: Sandbox,
    cmd: str | list[str],
    cwd: str | None = None,
    env: dict[str, str] | None = None,
    stdin: bytes | None = None,
    timeout_s: float = 60,
    user: AbstractBaseUser | None = None,
    keep_output: bool = True,
) -> ExecOutcome:
    """Run a command to completion in a running sandbox; a string runs under ``/bin/sh -c``.
    ``keep_output=False``: its output is returned but not kept in its history row (Hangar's
    own commands whose output may hold what a user's files hold: a run's diff)."""
    _require_running(sandbox)
    sandbox_mark_active(sandbox.id, sandbox.last_activity_at)
    argv, env, cwd = exec_validate(cmd=cmd, env=env, cwd=cwd, timeout_s=timeout_s)
    # A claimed pool member got its env and secrets after it started: they come with each exec.
    env = {**sandbox.env, **secret_svc.env_for(sandbox), **env}
    # One row per exec, written once it has ended (one write on the hot path, not two).
    row = Exec(
        sandbox=sandbox, argv=argv, cwd=cwd or "", started_at=timezone.now(),
        created_by=user if user is not None and user.is_authenticated else None,
    )  # fmt: skip
    max_output = settings.HANGAR_EXEC_MAX_OUTPUT_BYTES
    try:
        if _is_local(sandbox):
            req = ExecRequest(
                argv=argv, env=env, cwd=cwd, stdin=stdin, timeout=timeout_s, max_output=max_output
            )
            result = launcher_for(sandbox.runtime).exec(sandbox.handle, req)
        else:
            payload = {
                "argv": argv, "env": env, "cwd": cwd, "timeout": timeout_s, "max_output": max_output,
                "stdin": base64.b64encode(stdin).decode() if stdin is not None else None,
            }  # fmt: skip
            a = _remote(sandbox, "exec", payload, timeout=timeout_s + 30)
            result = ExecResult(
                exit_code=a["exit_code"], stdout=base64.b64decode(a["stdout"]), stderr=base64.b64decode(a["stderr"]),
                duration_ms=a["duration_ms"], timed_out=a["timed_out"], signal=a["signal"], truncated=a["truncated"],
            )  # fmt: skip
    except FileOpError as exc:
        # The agent could not start the command (no such binary, missing cwd): a client error.
        row.error, row.finished_at = str(exc), timezone.now()
        row.save()
        raise InvalidValue(f"could not run {argv[0]!r}: {exc.message} ({exc.errno_name})") from exc
    except LauncherError as exc:
        row.error, row.finished_at = str(exc), timezone.now()
        row.save()
        raise _runtime_failure(sandbox, exc) from exc
    keep = settings.HANGAR_EXEC_KEEP_OUTPUT_BYTES
    row.exit_code, row.timed_out = result.exit_code, result.timed_out
    if not keep_output:
        keep = 0
    row.stdout = _decode_for_storage(result.stdout, keep)
    row.stderr = _decode_for_storage(result.stderr, keep)
    row.stdout_bytes, row.stderr_bytes = len(result.stdout), len(result.stderr)
    row.finished_at, row.duration_ms = timezone.now(), result.duration_ms
    row.save()
    return ExecOutcome(exec=row, result=result)


def _sandbox_call(sandbox: Sandbox, fn):
    _require_running(sandbox)
    sandbox_mark_active(sandbox.id, sandbox.last_activity_at)
    try:
        return fn()
    except FileOpError as exc:
        if exc.errno_name == "ENOENT":
            raise NotFound(f"{exc.message}") from exc
        if exc.errno_name in ("EISDIR", "ENOTDIR", "EINVAL", "ENAMETOOLONG", "ELOOP"):
            raise InvalidValue(f"{exc.message} ({exc.errno_name})") from exc
        raise Conflict(f"{exc.message} ({exc.errno_name})") from exc
    except LauncherError as exc:
        raise _runtime_failure(sandbox, exc) from exc


def sandbox_file_write(*, sandbox: Sandbox, path: str, data: bytes) -> int:
    """Write a file inside the sandbox (parents created, replaced atomically)."""
    path = _check_path(path)
    if len(data) > settings.HANGAR_FILE_MAX_BYTES:
        raise InvalidValue(f"file is larger than the {settings.HANGAR_FILE_MAX_BYTES} byte limit")

    def call() -> int:
        if _is_local(sandbox):
            return launcher_for(sandbox.runtime).write_file(sandbox.handle, path, data)
        return int(
            _remote(sandbox, "write", {"path": path, "data": base64.b64encode(data).decode()}, 120)["size"]
        )

    size = _sandbox_call(sandbox, call)
    record_event(sandbox.id, "file", f"wrote {path} ({size} bytes)", path=path, size=size)
    return size


def sandbox_file_read(*, sandbox: Sandbox, path: str) -> tuple[FileEntry, Iterator[bytes]]:
    """Stream a file from inside the sandbox."""
    path = _check_path(path)

    def call() -> tuple[FileEntry, Iterator[bytes]]:
        if _is_local(sandbox):
            entry, chunks = launcher_for(sandbox.runtime).read_file(sandbox.handle, path)
            return entry, chunks
        a = _remote(sandbox, "read", {"path": path}, 120)
        return FileEntry(**a["entry"]), iter([base64.b64decode(a["data"])])

    return _sandbox_call(sandbox, call)  # type: ignore[no-any-return]


def sandbox_file_list(*, sandbox: Sandbox, path: str) -> list[FileEntry]:
    """List a directory inside the sandbox."""
    path = _check_path(path)

    def call() -> list[FileEntry]:
        if _is_local(sandbox):
            return launcher_for(sandbox.runtime).list_files(sandbox.handle, path)
        return [FileEntry(**e) for e in _remote(sandbox, "list", {"path": path}, 60)["entries"]]

    return _sandbox_call(sandbox, call)  # type: ignore[no-any-return]


def sandbox_stats(*, sandbox: Sandbox) -> dict[str, Any]:
    """CPU time, memory and disk the running sandbox uses now."""

    def call() -> dict[str, Any]:
        if _is_local(sandbox):
            return dataclasses.asdict(launcher_for(sandbox.runtime).stats(sandbox.handle))
        return _remote(sandbox, "stats", {}, 30)

    return _sandbox_call(sandbox, call)  # type: ignore[no-any-return]


# -- usage figures for pages ---------------------------------------------------------------------

STATS_KEY = "hangar:sandbox-stats"
_last_cpu: dict[str, tuple[float, float]] = {}  # sandbox id -> (monotonic time, cpu seconds)


def sandboxes_stats_collect(*, node_name: str) -> int:
    """Sample CPU and memory of every running sandbox on this node into Redis (one hash), so
    pages show usage for a thousand rows with one round trip instead of one runtime call each."""
    import json
    import time
    from concurrent.futures import ThreadPoolExecutor

    rows = list(
        Sandbox.objects.filter(node__name=node_name, status=S.RUNNING).values_list("id", "runtime", "handle")
    )

    def sample(row: tuple[str, str, dict[str, Any]]) -> tuple[str, dict[str, Any]] | None:
        sandbox_id, runtime, handle = row
        try:
            st = launcher_for(runtime).stats(handle)
        except LauncherError:
            return None
        now = time.monotonic()
        prev = _last_cpu.get(sandbox_id)
        _last_cpu[sandbox_id] = (now, st.cpu_seconds)
        cpu_pct = None
        if prev is not None and now > prev[0]:
            cpu_pct = max(0.0, (st.cpu_seconds - prev[1]) / (now - prev[0]) * 100.0)
        return sandbox_id, {"cpu_pct": cpu_pct, "memory_bytes": st.memory_bytes, "disk_bytes": st.disk_bytes,
                            "at": time.time()}  # fmt: skip

    with ThreadPoolExecutor(max_workers=4) as pool:
        samples = [s for s in pool.map(sample, rows) if s is not None]
    live = {r[0] for r in rows}
    for gone in set(_last_cpu) - live:
        del _last_cpu[gone]
    if samples:
        notify.redis_client().hset(STATS_KEY, mapping={sid: json.dumps(v) for sid, v in samples})
    return len(samples)


def sandboxes_stats_cached(*, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The last usage sample of each sandbox (see :func:`sandboxes_stats_collect`)."""
    import json

    if not ids:
        return {}
    try:
        values = notify.redis_client().hmget(STATS_KEY, ids)
    except Exception:  # usage figures are decoration; a Redis blip must not break a page
        return {}
    return {sid: json.loads(v) for sid, v in zip(ids, values, strict=True) if v}
