"""Warm pools: a team keeps ``size`` sandboxes of one spec started and unclaimed, so that a
create with that spec is answered at once by claiming one.

A pool with ``network`` starts its members with a network namespace of their own and egress
``none``; a create asking for a network claims from such a pool only, and the claim puts its
policy in force on the node (one nftables transaction) before the sandbox is handed over.

A pool's members are ordinary sandbox rows with ``pool`` set and ``claimed_at`` empty: they run
on nodes and count against their capacity, do not expire, and are left out of the team's
sandbox lists. Claiming one is a conditional update (two creates never get the same member);
the claim gives it the caller's env, metadata, timeout and rules, and the pool refills in the
background. A member is started with nothing of any caller's: env and files come only after
its claim, so nothing leaks between the users of a pool.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import OperationalError as DatabaseOperationalError
from django.db import transaction
from django.db.models.fields.json import KeyTransform
from django.utils import timezone
from kombu.exceptions import OperationalError

from .. import enqueue
from ..errors import Conflict, InvalidValue, NoCapacity, NotFound, QuotaExceeded
from ..lifecycle import record_event
from ..models import Pool, Sandbox, Team
from . import audit
from .checks import validate_limits, validate_node_selector, validate_runtime
from .images import image_resolve
from .nodes import runtime_require
from .placement import selector_unmatched
from .sandboxes import WARM, resolve_disk_mb, sandbox_delete, sandbox_start_members

log = logging.getLogger(__name__)
S = Sandbox.Status


def pools_for_team(*, team: Team) -> list[Pool]:
    return list(Pool.objects.filter(team=team).order_by("created_at"))


def pool_get(*, team: Team, pool_id: str) -> Pool:
    pool = Pool.objects.filter(team=team, id=pool_id).first()
    if pool is None:
        raise NotFound(f"no pool {pool_id!r}")
    return pool


def pool_fill(pool: Pool) -> dict[str, int]:
    """How full the pool is: members ready (running), still starting, and its target."""
    counts: dict[str, int] = {s: 0 for s in WARM}
    for status in Sandbox.objects.filter(pool=pool, claimed_at__isnull=True, status__in=WARM).values_list(
        "status", flat=True
    ):
        counts[status] += 1
    return {"ready": counts[S.RUNNING], "starting": counts[S.PENDING] + counts[S.STARTING], "size": pool.size}


def pool_create(
    *,
    team: Team,
    user: Any,
    image: str,
    runtime: str | None = None,
    cpu: float = 1.0,
    memory_mb: int = 512,
    size: int = 1,
    network: bool = False,
    disk_mb: int | None = None,
    node_selector: dict[str, str] | None = None,
) -> Pool:
    runtime = validate_runtime(runtime or settings.HANGAR_DEFAULT_RUNTIME)
    selector = validate_node_selector(node_selector)
    if selector and (unmatched := selector_unmatched(selector)):
        raise InvalidValue(unmatched)  # members could never start: say so now, not in last_error
    validate_limits(cpu=cpu, memory_mb=memory_mb, timeout_s=60)
    disk_mb = resolve_disk_mb(disk_mb)
    if not isinstance(network, bool):
        raise InvalidValue("network is true or false (whether members start with a network of their own)")
    if network:
        runtime_require(runtime=runtime, capability="network")  # refused where the runtime has none
    limit = settings.HANGAR_POOL_MAX_SIZE
    if not isinstance(size, int) or not 1 <= size <= limit:
        raise InvalidValue(f"size must be between 1 and {limit}, got {size}")
    image_row = image_resolve(image)
    spec: dict[str, Any] = {"image": image_row.name, "runtime": runtime, "cpu": cpu, "memory_mb": memory_mb, "disk_mb": disk_mb,
            "network": network, "node_selector": selector}  # fmt: skip
    same = Pool.objects.filter(team=team, **spec).first()
    if same is not None:
        raise Conflict(f"pool {same.id} already keeps this spec warm; change its size instead", pool=same.id)
    creator = user if user is not None and getattr(user, "is_authenticated", False) else None
    pool = Pool.objects.create(team=team, size=size, created_by=creator, **spec)
    audit.record("pool.create", team=team, target=pool.id, size=size, **spec)
    transaction.on_commit(lambda: _enqueue_refill(pool.id))
    return pool


def pool_resize(*, pool: Pool, size: int) -> Pool:
    limit = settings.HANGAR_POOL_MAX_SIZE
    if not isinstance(size, int) or not 1 <= size <= limit:
        raise InvalidValue(f"size must be between 1 and {limit}, got {size}")
    Pool.objects.filter(id=pool.id).update(size=size)
    audit.record("pool.resize", team=pool.team, target=pool.id, size_from=pool.size, size=size)
    pool.size = size
    transaction.on_commit(lambda: _enqueue_refill(pool.id))
    return pool


def pool_delete(*, pool: Pool) -> None:
    """Delete the pool and its unclaimed members; claimed sandboxes are the callers' and stay."""
    with transaction.atomic():
        # The pool's row lock first: a refill starting a member holds it too (and finds the
        # pool gone once this commits), so no member can be added between the two steps.
        if not Pool.objects.select_for_update().filter(id=pool.id).exists():
            return
        for member in (
            Sandbox.objects.filter(pool=pool, claimed_at__isnull=True)
            .exclude(status=S.DELETED)
            .select_related("node")
        ):
            sandbox_delete(sandbox=member, reason=f"its warm pool {pool.id} was deleted")
        audit.record("pool.delete", team=pool.team, target=pool.id)
        pool.delete()


def pool_refill(*, pool_id: str) -> int:
    """Start members until the pool holds ``size`` unclaimed ones; returns how many it started.
    Members that failed are deleted (they are nobody's yet)."""
    pool = Pool.objects.filter(id=pool_id).select_related("team").first()
    if pool is None:
        return 0
    for dead in Sandbox.objects.filter(pool=pool, claimed_at__isnull=True, status=S.FAILED).select_related(
        "node"
    ):
        sandbox_delete(sandbox=dead, reason=f"a failed member of warm pool {pool.id}: {dead.status_reason}")
    started = 0
    error = ""
    # All that are missing in one transaction, placed together (counted under the pool's lock);
    # when fewer fit, the rest are asked for once more, which says why none does (quota,
    # capacity) for the pool's last_error.
    while True:
        try:
            members = sandbox_start_members(pool=pool)
        except (NoCapacity, NotFound, InvalidValue, QuotaExceeded) as exc:
            error = exc.message
            break
        except DatabaseOperationalError as exc:  # a deadlock between two batches' placements: the next refill
            log.warning("pool %s: its members could not be placed: %s", pool.id, exc)
            error = "its members' placement met another's and was rolled back; it is tried again"
            break
        if not members:
            break
        started += len(members)
    Pool.objects.filter(id=pool.id).update(last_error=error)
    return started


def pools_refill_all() -> int:
    """Refill every pool (beat's sweep); one that fails is logged and the others go on."""
    started = 0
    for pool_id in Pool.objects.values_list("id", flat=True):
        try:
            started += pool_refill(pool_id=pool_id)
        except Exception:  # noqa: BLE001 (one pool's trouble must not starve the others)
            log.exception("the refill of pool %s failed", pool_id)
    return started


def pool_claim(
    *,
    team: Team,
    image: str,
    runtime: str,
    cpu: float,
    memory_mb: int,
    disk_mb: int,
    claim: dict[str, Any],
    network: bool = False,
    on_claim: Callable[[str, str], None] | None = None,
    node_selector: dict[str, str] | None = None,
) -> Sandbox | None:
    """A running member of the team's pool for this spec, now the caller's (``claim`` holds the
    fields it takes on: env, metadata, timeout_s, created_by, rules); None if there is none.
    With ``network``, only a pool with networks matches, and the caller puts its policy in
    force once the claim is committed. With ``node_selector``, only a member on a node that
    carries its labels (whatever its pool's own selector). The claim, its event and
    ``on_claim(member_id, pool_id)`` (the caller's audit record) commit together."""
    spec = {"image": image, "runtime": runtime, "cpu": cpu, "memory_mb": memory_mb, "disk_mb": disk_mb}
    pools = list(Pool.objects.filter(team=team, network=network, **spec).values_list("id", flat=True))
    if not pools:
        return None
    members = Sandbox.objects.filter(pool_id__in=pools, claimed_at__isnull=True, status=S.RUNNING)
    for i, (key, value) in enumerate(sorted((node_selector or {}).items())):
        members = members.alias(**{f"label{i}": KeyTransform(key, "node__labels")}).filter(
            **{f"label{i}": value}
        )
    ready = list(members.order_by("created_at").values_list("id", "pool_id", "node_selector")[:5])
    if not ready:
        if not node_selector:  # a pool of this spec is empty: it should not be
            for pool_id in pools:
                transaction.on_commit(functools.partial(_enqueue_refill, pool_id))
        return None
    now = timezone.now()
    for n, (member_id, pool_id, member_selector) in enumerate(ready):
        pool = Pool(id=pool_id)
        fields = {**claim, "claimed_at": now, "expires_at": now + timedelta(seconds=claim["timeout_s"]),
                  "last_activity_at": now, "updated_at": now,
                  "node_selector": {**(member_selector or {}), **(node_selector or {})}}  # fmt: skip
        with transaction.atomic():
            if not Sandbox.objects.filter(id=member_id, claimed_at__isnull=True, status=S.RUNNING).update(
                **fields
            ):
                continue  # another create took it first
            record_event(member_id, "claimed", f"claimed from warm pool {pool.id}", pool=pool.id)
            if on_claim is not None:
                on_claim(member_id, pool.id)
            # Publishing a Celery message costs milliseconds: the caller waiting for its sandbox
            # should not pay for the refill, so it is sent from a thread of its own. While the
            # pool still has a member ready, the new one starts a moment later
            # (HANGAR_POOL_REFILL_DELAY_S): booting a sandbox takes the node's CPU for a tenth
            # of a second or more, just when the caller runs its first commands.
            delay = settings.HANGAR_POOL_REFILL_DELAY_S if len(ready) - n > 1 else 0
            refill = threading.Thread(target=_enqueue_refill, args=(pool.id, delay), daemon=True)
            transaction.on_commit(refill.start)
            return Sandbox.objects.select_related("node").get(id=member_id)
    return None  # every one taken meanwhile: their claims refill the pools


def _enqueue_refill(pool_id: str, delay: float = 0) -> None:
    try:
        enqueue.send("pool_refill", [pool_id], queue="control", countdown=delay or None, retry=True,
                     retry_policy=enqueue.RETRY_POLICY)  # fmt: skip
    except OperationalError as exc:  # beat refills every pool on its next tick anyway
        log.warning("could not enqueue the refill of pool %s: %s", pool_id, exc)
