"""Sandbox services: create, provision, pause and resume, delete, reap, reconcile. Commands and
files are in ``sandbox_io``; the road to the sandbox in ``sandbox_access``."""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone
from kombu.exceptions import OperationalError

from .. import enqueue, events, notify
from ..errors import Conflict, InvalidValue, NotFound, QuotaExceeded
from ..host.network import validate_policy
from ..lifecycle import record_event, record_events, transition
from ..models import AuditEvent, Node, Pool, Sandbox, Team, TeamPolicy
from ..notify import wait_for_status
from . import audit, quotas, spans
from . import secrets as secret_svc
from . import usage as usage_svc
from . import volumes as volume_svc
from .auth import sandbox_reach
from .checks import (
    validate_command_size,
    validate_env,
    validate_limits,
    validate_metadata,
    validate_node_selector,
    validate_runtime,
)  # fmt: skip
from .images import image_resolve
from .nodes import CANNOT, node_pick, node_pick_many
from .previews import OPEN_PORTS, validate_ports
from .sandbox_access import sandbox_access
from .sandbox_calls import sandbox_call, sandbox_fail

log = logging.getLogger(__name__)
S = Sandbox.Status
SETTLED = (S.RUNNING, S.FAILED, S.STOPPING, S.STOPPED, S.DELETED)


# -- selectors --------------------------------------------------------------------------------


def sandboxes_for_team(*, team: Team, status: str | None = None, caller: Any = None) -> QuerySet[Sandbox]:
    """The team's sandboxes; those a harness's own token reaches when it is the ``caller``."""
    qs = (
        _reached(Sandbox.objects.filter(team=team), caller)
        .exclude(pool__isnull=False, claimed_at__isnull=True)  # warm pool members: nobody's yet
        .select_related("node")
        .prefetch_related("volume_mounts__volume")
    )
    if status:
        if status not in S.values:
            raise InvalidValue(f"unknown status {status!r}; one of: {', '.join(S.values)}")
        return qs.filter(status=status)
    return qs.exclude(status=S.DELETED)


def _reached(qs: QuerySet[Sandbox], caller: Any) -> QuerySet[Sandbox]:
    reach = sandbox_reach(caller)
    return qs if reach is None else qs.filter(reach)


def sandbox_get(*, team: Team, sandbox_id: str, caller: Any = None) -> Sandbox:
    try:
        return _reached(Sandbox.objects.select_related("node"), caller).get(team=team, id=sandbox_id)
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


def validate_network(network: dict[str, Any] | None) -> dict[str, Any]:
    """``{"egress": "none" | "allowlist" | "all", "allow": [...]}`` checked ({} for none).
    Whether the runtime gives sandboxes networks is its nodes' word (:func:`node_pick`)."""
    try:
        policy = validate_policy(network)
    except ValueError as exc:
        raise InvalidValue(f"network: {exc}") from None
    if not policy.enabled:
        return {}
    return policy.as_dict()


def _require(sandbox: Sandbox, capability: str) -> None:
    """The sandbox's node says its runtime can ``capability`` (network, checkpoint), or a 422."""
    if sandbox.node is not None and not sandbox.node.can(sandbox.runtime, capability):
        raise InvalidValue(CANNOT[capability].format(runtime=sandbox.runtime))


def _network_asked(kwargs: dict[str, Any]) -> dict[str, Any]:
    asked = kwargs.get("network")
    net: dict[str, Any] = asked if isinstance(asked, dict) else {}
    listed = net.get("allow")
    allow: list[Any] = listed if isinstance(listed, list) else []
    return {"hangar.network.egress": str(net.get("egress", "none")),
            "hangar.network.allow": [str(a) for a in allow][:100]}  # fmt: skip


@spans.traced("sandbox.network", _network_asked)
def sandbox_set_network(*, sandbox: Sandbox, network: dict[str, Any] | None) -> Sandbox:
    """Change the sandbox's egress policy: at once if it runs with a network (one nftables
    transaction on its node), else from its next start."""
    net = validate_network(network)
    if net:
        _require(sandbox, "network")
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

    sandbox_call(sandbox, lambda: sandbox_access(sandbox).set_network(net))


@dataclass(frozen=True)
class SandboxRequest:
    """What a create asks for, built once at the edge (the API, the form, a harness, a test)
    and passed down whole; :func:`sandbox_create` checks it (the defaults are the API's)."""

    image: str
    runtime: str | None = None  # None: HANGAR_DEFAULT_RUNTIME
    cpu: float = 1.0
    memory_mb: int = 512
    timeout_s: int = 300
    env: dict[str, str] | None = None
    metadata: dict[str, Any] | None = None
    volumes: list[volume_svc.VolumeMount] | None = None
    ephemeral: bool = False
    on_expire: str = "destroy"
    idle_timeout_s: int | None = None
    pause_mode: str = "stop"
    secrets: list[str] | None = None
    ports: list[Any] | None = None
    auto_resume: bool = False
    network: dict[str, Any] | None = None
    disk_mb: int | None = None
    node_selector: dict[str, str] | None = None  # labels its node must carry, all of them
    # Every port reachable at its preview host: "public", "private" (the traffic token), or "".
    open_ports: str = ""


@spans.traced("sandbox.create")
def sandbox_create(
    *, team: Team, user: User | None, request: SandboxRequest, created_by_token: Any = None
) -> Sandbox:
    """Write a pending sandbox on a node with room (the node of its volumes, if it attaches
    any) and enqueue its provisioning on that node."""
    r = request
    image, cpu, memory_mb, timeout_s, ephemeral = r.image, r.cpu, r.memory_mb, r.timeout_s, r.ephemeral
    on_expire, idle_timeout_s, pause_mode, auto_resume = (
        r.on_expire,
        r.idle_timeout_s,
        r.pause_mode,
        r.auto_resume,
    )
    runtime, disk_mb, metadata = r.runtime, r.disk_mb, r.metadata
    env = dict(r.env or {})
    runtime = validate_runtime(runtime or settings.HANGAR_DEFAULT_RUNTIME)
    validate_limits(cpu=cpu, memory_mb=memory_mb, timeout_s=timeout_s)
    disk_mb = resolve_disk_mb(disk_mb)
    validate_env(env)
    metadata = validate_metadata(metadata)
    if on_expire not in (ON_EXPIRE_PAUSE, ON_EXPIRE_DESTROY):
        raise InvalidValue(f"on_expire must be pause or destroy, got {on_expire!r}")
    if idle_timeout_s is not None and not 10 <= idle_timeout_s <= settings.HANGAR_SANDBOX_MAX_TIMEOUT_S:
        raise InvalidValue(
            f"idle_timeout_s must be between 10 and {settings.HANGAR_SANDBOX_MAX_TIMEOUT_S}, got {idle_timeout_s}"
        )
    net = validate_network(r.network)
    node_selector = validate_node_selector(r.node_selector)
    _validate_pause_mode(pause_mode, ephemeral=ephemeral)
    secret_names = secret_svc.validate_names(team=team, names=r.secrets or [], env=env)
    port_list = validate_ports(r.ports or [])
    if r.open_ports not in OPEN_PORTS:
        raise InvalidValue(
            f"open_ports must be one of {', '.join(map(repr, OPEN_PORTS))}, got {r.open_ports!r}"
        )
    # The team's policy row once, for its limits and its budget.
    policy = TeamPolicy.objects.filter(team=team).first()
    eff = quotas.effective(team, policy)
    quotas.check(team, lifetime_s=timeout_s, eff=eff)
    usage_svc.budget_check(team, policy)
    image_row = image_resolve(image)
    mounts = volume_svc.resolve_mounts(team=team, mounts=r.volumes or [])
    if not mounts and not ephemeral:
        # A warm pool of the team keeps this spec started: take one of its members (one with a
        # network of its own when this asks for egress; the claim sets the policy).
        def claimed_now(member_id: str, pool_id: str | None) -> None:  # in the claim's transaction
            audit.record("sandbox.create", team=team, target=member_id, image=image_row.name, cpu=cpu,
                         memory_mb=memory_mb, pool=pool_id, secrets=secret_names)  # fmt: skip

        claimed = events.sandbox_claim.first(
            team=team, image=image_row.name, runtime=runtime, cpu=cpu, memory_mb=memory_mb, disk_mb=disk_mb,
            claim={"env": env, "metadata": metadata or {}, "timeout_s": timeout_s, "on_expire": on_expire,
                   "idle_timeout_s": idle_timeout_s, "pause_mode": pause_mode, "secrets": secret_names,
                   "ports": port_list, "open_ports": r.open_ports, "auto_resume": auto_resume,
                   "created_by": user if user is not None and user.is_authenticated else None,
                   "created_by_token": created_by_token},
            network=bool(net), on_claim=None if net else claimed_now, node_selector=node_selector,
        )  # fmt: skip
        if claimed is not None:
            try:
                _env_fits(claimed.node, runtime, env)
            except InvalidValue:
                sandbox_delete(
                    sandbox=claimed, reason="claimed by a create whose env leaves no room for a command"
                )
                raise
        if claimed is not None and net:
            # Its row takes the policy once the node enforces it; a member that cannot take it
            # is gone, and the create starts a sandbox of its own.
            if _claim_network(claimed.id, net):
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
        needs = ["network"] * bool(net) + ["checkpoint"] * (pause_mode == PAUSE_MODE_CHECKPOINT)
        with spans.span("sandbox.create.schedule", team_id=team.id) as scheduling:
            node = node_pick(
                runtime=runtime, cpu=cpu, memory_mb=memory_mb, image=image_row,
                node_id=volume_svc.volume_node_id(mounts), needs=needs, node_selector=node_selector,
            )  # fmt: skip
            scheduling.set({"hangar.node": node.name, "hangar.runtime": runtime})
        _env_fits(node, runtime, env)
        volume_svc.check_exclusive(resolved=mounts, node=node, runtime=runtime)
        sandbox = Sandbox.objects.create(
            team=team,
            created_by=user if user is not None and user.is_authenticated else None,
            created_by_token=created_by_token,
            image=image_row.name,
            image_digest=image_row.digest,
            runtime=runtime,
            node=node,
            node_selector=node_selector,
            cpu=cpu,
            memory_mb=memory_mb,
            disk_mb=disk_mb,
            timeout_s=timeout_s,
            env=env,
            secrets=secret_names,
            ports=port_list,
            open_ports=r.open_ports,
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


def _claim_network(sandbox_id: str, net: dict[str, Any]) -> bool:
    """The claimed member's egress policy, in force on its node, then on its row (which says
    egress none until then, as the node does). A member that cannot take it, whatever the
    reason (the node's answer, its queue, a timeout), is deleted (it never ran anything of the
    caller's) and False returned."""
    sandbox = Sandbox.objects.select_related("node", "team").get(id=sandbox_id)
    try:
        sandbox_network_apply(sandbox, net)
        network_store(sandbox_id, net)
        return True
    except Exception as exc:
        log.warning("claimed member %s could not take its network policy: %s", sandbox_id, exc)
        record_event(sandbox_id, "network", f"the claim's network policy could not be applied: {exc}")
        transition(
            sandbox_id, to=S.FAILED, frm=[S.RUNNING], reason=f"its network policy was not applied: {exc}"
        )
        sandbox.refresh_from_db()
        sandbox_delete(sandbox=sandbox, reason="a warm member that could not take its network policy")
        return False


def _env_fits(node: Any, runtime: str, env: dict[str, str]) -> None:
    """Every command a sandbox runs carries its env: one that leaves no room for a command on
    ``node`` (its runtime's limit there) is refused at its create, a 422."""
    validate_command_size(node=node, runtime=runtime, argv=["/bin/sh"], env=env, cwd=None)


def _enqueue(task_name: str, sandbox_id: str, queue: str) -> None:
    args = [sandbox_id] + ([spans.current_traceparent()] if task_name == "provision" else [])
    try:
        enqueue.send(task_name, args, queue=queue, retry=True, retry_policy=enqueue.RETRY_POLICY)
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


# -- warm pools' members ---------------------------------------------------------------------

# An unclaimed member in these counts towards its pool's size.
WARM = [S.PENDING, S.STARTING, S.RUNNING]


def sandbox_start_member(*, pool: Any) -> Sandbox:
    """Start one member of a warm pool: the pool's spec, nobody's env, no expiry until claimed."""
    return sandbox_start_members(pool=pool, count=1)[0]


def sandbox_start_members(*, pool: Any, count: int | None = None) -> list[Sandbox]:
    """Start members of a warm pool in one transaction: ``count`` of them, or (None) as many as
    it lacks, counted under the pool's lock (so two refills of one pool never both fill the
    same gap); as many as the team's quotas and the fleet's room allow, placed together
    (:func:`node_pick_many`). At least one, else the refusal (quota, capacity) is raised; none
    (an empty list) when the pool lacks none."""
    image_row = image_resolve(pool.image)
    with transaction.atomic():
        # Locked, so a pool being deleted meanwhile gets no new member.
        size = Pool.objects.select_for_update().filter(id=pool.id).values_list("size", flat=True).first()
        if size is None:
            raise NotFound(f"pool {pool.id} was deleted")
        if count is None:
            count = (
                size
                - Sandbox.objects.filter(pool_id=pool.id, claimed_at__isnull=True, status__in=WARM).count()
            )
        if count < 1:
            return []
        quotas.lock_team(pool.team)
        count = _quota_room(pool, count)
        nodes = node_pick_many(count=count, partial=True, runtime=pool.runtime, cpu=pool.cpu,
                               memory_mb=pool.memory_mb, image=image_row,
                               needs=["network"] if pool.network else [],
                               node_selector=pool.node_selector or None)  # fmt: skip
        members = Sandbox.objects.bulk_create(
            Sandbox(team=pool.team, image=image_row.name, image_digest=image_row.digest, runtime=pool.runtime,
                    node=node, cpu=pool.cpu, memory_mb=pool.memory_mb, disk_mb=pool.disk_mb, pool=pool,
                    expires_at=None, network={"egress": "none", "allow": []} if pool.network else {},
                    node_selector=pool.node_selector or {})
            for node in nodes
        )  # fmt: skip
        record_events(
            (m.id, "status", f"warm member of pool {pool.id}, scheduled on node {node.name}",
             {"node": node.name, "pool": pool.id})
            for m, node in zip(members, nodes, strict=True)
        )  # fmt: skip
        for m, node in zip(members, nodes, strict=True):
            transaction.on_commit(functools.partial(_enqueue, "provision", m.id, node.queue))
    return members


def _quota_room(pool: Any, count: int) -> int:
    """How many of ``count`` members the pool's team has quota for (at least one, else the
    :class:`QuotaExceeded` that says why). Inside the transaction, after the team's lock."""
    per = {"sandboxes": 1, "vcpu": pool.cpu, "memory_mb": pool.memory_mb, "disk_mb": pool.disk_mb}
    while True:
        try:
            quotas.check(pool.team, **{key: amount * count for key, amount in per.items()})
            return count
        except QuotaExceeded as exc:
            key, held, limit = exc.extra.get("quota"), exc.extra.get("used"), exc.extra.get("limit")
            if count <= 1 or key not in per or not per[key] or held is None or limit is None:
                raise
            fits = int((limit - held + 1e-9) // per[key])
            if fits < 1 or fits >= count:
                raise
            count = fits


# -- pause and resume -------------------------------------------------------------------------

PAUSE_MODE_STOP, PAUSE_MODE_CHECKPOINT = "stop", "checkpoint"
PAUSE_MODES = (PAUSE_MODE_STOP, PAUSE_MODE_CHECKPOINT)


def _validate_pause_mode(mode: str, *, ephemeral: bool) -> None:
    """The mode checked; whether the runtime can checkpoint is its nodes' word (:func:`node_pick`)."""
    if mode not in PAUSE_MODES:
        raise InvalidValue(f"unknown pause mode {mode!r}; one of: {', '.join(PAUSE_MODES)}")
    if mode == PAUSE_MODE_CHECKPOINT and ephemeral:
        raise InvalidValue("an ephemeral sandbox keeps nothing outside its volumes when paused, "
                           "so it cannot be checkpointed: pause it with mode stop")  # fmt: skip


ON_EXPIRE_PAUSE, ON_EXPIRE_DESTROY = "pause", "destroy"


@spans.traced("sandbox.pause")
def sandbox_pause(*, sandbox: Sandbox, mode: str | None = None, reason: str = "") -> Sandbox:
    """Pause a running sandbox; either way its CPU and memory are freed. ``stop``: its
    processes and terminals end; its files stay (on volumes, and outside them unless it is
    ephemeral). ``checkpoint``: gVisor saves the whole sandbox, processes and memory included,
    and resume continues them. ``mode`` defaults to the sandbox's ``pause_mode``."""
    mode = mode or sandbox.pause_mode or PAUSE_MODE_STOP
    _validate_pause_mode(mode, ephemeral=sandbox.ephemeral)
    if mode == PAUSE_MODE_CHECKPOINT:
        _require(sandbox, "checkpoint")
    if sandbox.status != S.RUNNING:
        raise Conflict(f"sandbox {sandbox.id} is {sandbox.status}; only a running sandbox can be paused",
                       status=sandbox.status)  # fmt: skip
    if not transition(sandbox.id, to=S.PAUSING, frm=[S.RUNNING], reason=reason or f"pausing (mode {mode})",
                      fields={"paused_mode": mode}):  # fmt: skip
        raise Conflict(f"sandbox {sandbox.id} changed meanwhile; try again")
    assert sandbox.node is not None
    queue = sandbox.node.queue
    audit.record("sandbox.pause", team=sandbox.team, target=sandbox.id, mode=mode, reason=reason)
    transaction.on_commit(lambda: _enqueue("suspend", sandbox.id, queue))
    sandbox.status = S.PAUSING
    return sandbox


@spans.traced("sandbox.resume")
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


# -- delete and expiry ------------------------------------------------------------------------


@spans.traced("sandbox.delete")
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
    if sandbox.node_id is None or Node.objects.filter(id=sandbox.node_id, state=Node.State.LOST).exists():
        # On a lost node: the row is released now; the node, once back, destroys what is left
        # of it (its reconciliation: a runtime that no live row wants).
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
    due = Sandbox.objects.filter(
        status__in=[S.PENDING, S.STARTING, S.RUNNING, S.FAILED], expires_at__lte=now
    ).select_related("node")
    expired = list(due[:500])
    working = _busy([sb.id for sb in expired if sb.on_expire == ON_EXPIRE_PAUSE])
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
    busy = _busy([sb.id for sb in idle])  # a run going is activity
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
    # Tasks lost with a dead worker (each is idempotent): send them again. A node's worker
    # started again does it at once (runtime.node.sandboxes.node_recover); this is the net
    # under that, for a message lost some other way.
    for sandbox in Sandbox.objects.filter(
        status__in=list(WAITING_ON), updated_at__lte=now - timedelta(minutes=2)
    ).select_related("node")[:200]:
        if sandbox.node is not None:
            _enqueue(waiting_on(sandbox), sandbox.id, sandbox.node.queue)
    return count


# The node task a row in each transitional state waits on.
WAITING_ON: dict[str, str] = {
    S.PENDING: "provision",
    S.PAUSING: "suspend",
    S.RESUMING: "resume",
    S.STOPPING: "destroy",
}


def waiting_on(sandbox: Sandbox) -> str:
    """The node task ``sandbox``'s row waits on: a stopping row, ``halt`` when a stop moved it
    there (it ends ``stopped``), ``destroy`` when a delete did (it ends ``deleted``)."""
    if sandbox.status != S.STOPPING:
        return WAITING_ON[sandbox.status]
    last = (
        AuditEvent.objects.filter(target=sandbox.id, action__in=("sandbox.stop", "sandbox.delete"))
        .order_by("-created_at", "-id")
        .values_list("action", flat=True)
        .first()
    )
    return "halt" if last == "sandbox.stop" else "destroy"


def resend(sandbox: Sandbox) -> None:
    """Send again the node task ``sandbox``'s row waits on (after its worker was lost)."""
    if sandbox.node is not None:
        _enqueue(waiting_on(sandbox), sandbox.id, sandbox.node.queue)


def _busy(sandbox_ids: list[str]) -> set[str]:
    """Of these sandboxes, those at work by a feature's word (a harness's run going)."""
    return set().union(*events.sandboxes_busy.send(sandbox_ids)) if sandbox_ids else set()


# -- exec and files ---------------------------------------------------------------------------


# -- usage figures for pages ---------------------------------------------------------------------
