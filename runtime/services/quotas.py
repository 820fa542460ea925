"""Team quotas: how much a team may hold at once, checked atomically where it grows.

Three layers, for each quota: the site default (settings, overridden by site administrators in
:class:`~runtime.models.SiteDefaults`), a team's *ceiling* (site administrators may raise or
lower it for one team; absent: the site default) and the team's own *limit* (its admins may
set it anywhere up to the ceiling; absent: the ceiling). What is enforced is the limit.

Every check that lets a team grow (create, resume, a pool's refill, a volume) runs in the
transaction that writes the new row, after :func:`lock_team` took the team's row lock, so two
concurrent creates cannot both fit under the last unit of a quota: the second waits for the
first to commit and then counts its row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Sum

from ..errors import Forbidden, InvalidValue, QuotaExceeded
from ..models import Harness, Sandbox, SiteDefaults, Team, TeamPolicy, Volume
from . import audit

S = Sandbox.Status
# A sandbox in these holds CPU and memory (or is about to): it counts against the quotas.
HOLDING = (S.PENDING, S.STARTING, S.RUNNING, S.PAUSING, S.RESUMING)
# A sandbox in these holds its disk (a paused one too; a stopped one's goes).
HOLDING_DISK = (*HOLDING, S.PAUSED, S.STOPPING)


@dataclass(frozen=True)
class Quota:
    key: str
    label: str
    unit: str
    setting: str
    integer: bool = True


QUOTAS: dict[str, Quota] = {
    q.key: q
    for q in (
        Quota("sandboxes", "concurrent sandboxes", "", "HANGAR_QUOTA_SANDBOXES"),
        Quota("vcpu", "vCPU in use", "vCPU", "HANGAR_QUOTA_VCPU", integer=False),
        Quota("memory_mb", "memory in use", "MB", "HANGAR_QUOTA_MEMORY_MB"),
        Quota("storage_mb", "volume storage", "MB", "HANGAR_QUOTA_STORAGE_MB"),
        Quota("disk_mb", "sandbox disks", "MB", "HANGAR_QUOTA_DISK_MB"),
        Quota("lifetime_s", "sandbox lifetime (timeout_s)", "s", "HANGAR_QUOTA_LIFETIME_S"),
        Quota("harnesses", "harnesses", "", "HANGAR_QUOTA_HARNESSES"),
        Quota("gpus", "GPUs in use", "", "HANGAR_QUOTA_GPUS"),
    )
}


def _fmt(value: float) -> str:
    return f"{value:g}"


def validate_values(values: dict[str, Any], *, allow_none: bool = True) -> dict[str, float | int | None]:
    """``{key: number | None}`` checked: known keys, non-negative numbers (integers where the
    quota counts whole things)."""
    if not isinstance(values, dict):
        raise InvalidValue("quotas must be an object of {name: number}")
    out: dict[str, float | int | None] = {}
    for key, value in values.items():
        quota = QUOTAS.get(key)
        if quota is None:
            raise InvalidValue(f"unknown quota {key!r}; known: {', '.join(QUOTAS)}")
        if value is None and allow_none:
            out[key] = None
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidValue(f"quota {key} must be a number of 0 or more, got {value!r}")
        if quota.integer and value != int(value):
            raise InvalidValue(f"quota {key} must be a whole number, got {value!r}")
        out[key] = int(value) if quota.integer else float(value)
    return out


def site_defaults() -> dict[str, float | int]:
    row = SiteDefaults.objects.filter(id=1).values_list("quotas", flat=True).first() or {}
    return {key: row.get(key, getattr(settings, q.setting)) for key, q in QUOTAS.items()}


def _policy(team: Team) -> TeamPolicy:
    policy, _ = TeamPolicy.objects.get_or_create(team=team)
    return policy


# "The caller has not read the team's TeamPolicy row" (None: it read it, and there is none).
UNREAD: Any = object()


def effective(team: Team, policy: TeamPolicy | None = UNREAD) -> dict[str, dict[str, float | int]]:
    """``{key: {"limit", "ceiling"}}`` for the team (``policy``: its TeamPolicy row, or None
    when it has none, if the caller read it already)."""
    defaults = site_defaults()
    if policy is UNREAD:
        policy = TeamPolicy.objects.filter(team=team).first()
    ceilings = policy.ceilings if policy else {}
    limits = policy.limits if policy else {}
    out = {}
    for key in QUOTAS:
        ceiling = ceilings.get(key, defaults[key])
        out[key] = {"ceiling": ceiling, "limit": min(limits.get(key, ceiling), ceiling)}
    return out


def usage(team: Team, keys: Iterable[str] | None = None) -> dict[str, float | int | None]:
    """What the team holds now, per quota (None: a bound, not an amount); with ``keys``, only
    those are counted (the others are 0: a create does not pay for counting volumes)."""
    want = set(keys) if keys is not None else set(QUOTAS)
    out: dict[str, float | int | None] = {key: 0 for key in QUOTAS}
    out["lifetime_s"] = None
    if want & {"sandboxes", "vcpu", "memory_mb"}:
        # One pass over the team's held sandboxes for all three.
        held = Sandbox.objects.filter(team=team, status__in=HOLDING).aggregate(
            n=Count("id"), vcpu=Sum("cpu"), memory_mb=Sum("memory_mb")
        )
        out.update(sandboxes=held["n"], vcpu=float(held["vcpu"] or 0), memory_mb=int(held["memory_mb"] or 0))
    if "disk_mb" in want:
        disks = Sandbox.objects.filter(team=team, status__in=HOLDING_DISK).aggregate(s=Sum("disk_mb"))
        out["disk_mb"] = int(disks["s"] or 0)
    if "storage_mb" in want:
        out["storage_mb"] = int(Volume.objects.filter(team=team).aggregate(s=Sum("size_mb"))["s"] or 0)
    if "harnesses" in want:
        out["harnesses"] = Harness.objects.filter(team=team, deleted_at__isnull=True).count()
    # No GPU sandboxes exist yet: nothing is held against "gpus".
    return out


def report(team: Team) -> dict[str, dict[str, Any]]:
    """Per quota: label, unit, limit, ceiling and current use (the API's and dashboard's view)."""
    eff, used = effective(team), usage(team)
    return {
        key: {"label": q.label, "unit": q.unit, **eff[key], "used": used[key]} for key, q in QUOTAS.items()
    }


def lock_team(team: Team) -> None:
    """Take the team's row lock until the end of the transaction (checks then count rows that
    concurrent creators committed before it)."""
    Team.objects.select_for_update().filter(id=team.id).values_list("id", flat=True).first()


def check(
    team: Team,
    *,
    sandboxes: int = 0,
    vcpu: float = 0,
    memory_mb: int = 0,
    storage_mb: int = 0,
    disk_mb: int = 0,
    lifetime_s: int | None = None,
    harnesses: int = 0,
    eff: dict[str, dict[str, float | int]] | None = None,
) -> None:
    """Raise :class:`QuotaExceeded` if adding this much would put the team over a limit.
    Call inside the transaction that adds it, after :func:`lock_team`. ``eff``: the team's
    :func:`effective` limits when the caller has them already."""
    eff = eff if eff is not None else effective(team)
    if lifetime_s is not None and lifetime_s > eff["lifetime_s"]["limit"]:
        limit = eff["lifetime_s"]["limit"]
        raise QuotaExceeded(
            f"timeout_s {lifetime_s} is longer than team {team.name}'s sandbox lifetime quota of {limit} s",
            quota="lifetime_s", limit=limit, requested=lifetime_s, used=None,
        )  # fmt: skip
    wanted = {"sandboxes": sandboxes, "vcpu": vcpu, "memory_mb": memory_mb, "storage_mb": storage_mb,
              "disk_mb": disk_mb, "harnesses": harnesses}  # fmt: skip
    if not any(wanted.values()):
        return
    if not transaction.get_connection().in_atomic_block:
        raise RuntimeError("quota checks must run inside the transaction that adds the rows")
    used = usage(team, [k for k, v in wanted.items() if v])
    for key, amount in wanted.items():
        if not amount:
            continue
        limit = eff[key]["limit"]
        held = used[key]
        assert held is not None  # what a create asks an amount of is counted, never a bound
        if held + amount > limit + 1e-9:
            q = QUOTAS[key]
            unit = f" {q.unit}" if q.unit else ""
            raise QuotaExceeded(
                f"team {team.name} is over its {q.label} quota: {_fmt(held)}{unit} in use, "
                f"{_fmt(amount)}{unit} more asked for, limit {_fmt(limit)}{unit}",
                quota=key, used=used[key], requested=amount, limit=limit,
            )  # fmt: skip


def limits_set(*, team: Team, values: dict[str, Any], role: str, staff: bool) -> dict[str, dict[str, Any]]:
    """A team admin sets the team's limits (``None``: back to the ceiling); each at most its
    ceiling, which only a site administrator may raise (with :func:`ceilings_set`)."""
    values = validate_values(values)
    if not staff and role not in ("admin", "owner"):
        raise Forbidden(f"only a team's admins change its quotas; you are {role}")
    with transaction.atomic():
        lock_team(team)
        policy = _policy(team)
        eff = effective(team)
        for key, value in values.items():
            if value is None:
                policy.limits.pop(key, None)
                continue
            ceiling = eff[key]["ceiling"]
            if value > ceiling and not staff:
                raise Forbidden(
                    f"quota {key} can be at most {_fmt(ceiling)} for team {team.name} (the site's ceiling); "
                    "ask a site administrator to raise it", quota=key, ceiling=ceiling,
                )  # fmt: skip
            if value > ceiling:  # a site administrator raising a limit raises the ceiling with it
                policy.ceilings[key] = value
            policy.limits[key] = value
        policy.save(update_fields=["limits", "ceilings", "updated_at"])
        audit.record("quota.limits", team=team, target=f"team {team.name}", values=values)
    return report(team)


def ceilings_set(*, team: Team, values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Site administrators: the most this team's admins may set (``None``: the site default)."""
    values = validate_values(values)
    with transaction.atomic():
        lock_team(team)
        policy = _policy(team)
        for key, value in values.items():
            if value is None:
                policy.ceilings.pop(key, None)
            else:
                policy.ceilings[key] = value
        policy.save(update_fields=["ceilings", "updated_at"])
        audit.record("quota.ceilings", team=team, target=f"team {team.name}", values=values)
    return report(team)


def site_defaults_set(*, values: dict[str, Any]) -> dict[str, float | int]:
    values = validate_values(values)
    with transaction.atomic():
        row, _ = SiteDefaults.objects.select_for_update().get_or_create(id=1)
        for key, value in values.items():
            if value is None:
                row.quotas.pop(key, None)
            else:
                row.quotas[key] = value
        row.save(update_fields=["quotas", "updated_at"])
        audit.record("quota.site_defaults", target="site", values=values)
    return site_defaults()
