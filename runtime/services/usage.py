"""Usage metering: what each team used, per hour, as it accrues; cost and budgets.

A sandbox accrues vCPU-seconds and GB-seconds of memory while it holds them (starting,
running, pausing, resuming): :func:`runtime.lifecycle.transition` counts the slice up to every
change of state into and out of those, and the beat's :func:`meter` counts running ones up to
now every ``HANGAR_METER_TICK_S``, so the hourly rows fill while sandboxes run. A volume
accrues GB-hours of storage from creation to deletion, and a sandbox's own disk (``disk_mb``)
while the node holds it: from its start to its stop or failure, paused included unless the
sandbox is ephemeral (whose pause lets its disk go). A slice that spans hours is split between
them. Every slice is counted once: ``metered_at`` and ``disk_metered_at`` move under the row's
lock.

Cost: the team's rates (site defaults from settings and the site administrators, per team over
them) times its usage. A budget is per calendar month (UTC): at 80% the team is warned (audit
log, dashboard, API); at 100%, with enforcement on, new sandboxes are refused.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q, Sum
from django.utils import timezone

from ..errors import InvalidValue, QuotaExceeded
from ..models import Sandbox, SiteDefaults, Team, TeamPolicy, UsageHour, Volume
from . import audit
from .quotas import UNREAD

log = logging.getLogger(__name__)
S = Sandbox.Status
BILLED = (S.STARTING, S.RUNNING, S.PAUSING, S.RESUMING)
DISK_HELD = (*BILLED, S.PAUSED, S.STOPPING)
METRICS = ("vcpu_seconds", "memory_gb_seconds", "storage_gb_hours", "gpu_seconds", "sandboxes")
RATES = {
    "vcpu_hour": "HANGAR_RATE_VCPU_HOUR",
    "memory_gb_hour": "HANGAR_RATE_MEMORY_GB_HOUR",
    "storage_gb_hour": "HANGAR_RATE_STORAGE_GB_HOUR",
    "gpu_hour": "HANGAR_RATE_GPU_HOUR",
}
MAX_RANGE = timedelta(days=400)
WARN_AT = 0.8


def _hour(t: datetime) -> datetime:
    return t.replace(minute=0, second=0, microsecond=0)


def _upsert(team_id: int, hour: datetime, **amounts: float) -> None:
    cols = ", ".join(METRICS)
    values = [amounts.get(m, 0) for m in METRICS]
    updates = ", ".join(f"{m} = runtime_usagehour.{m} + EXCLUDED.{m}" for m in METRICS)
    with connection.cursor() as cur:
        cur.execute(
            f"INSERT INTO runtime_usagehour (team_id, hour, {cols}) VALUES (%s, %s, {', '.join(['%s'] * len(values))}) "
            f"ON CONFLICT (team_id, hour) DO UPDATE SET {updates}",
            [team_id, hour, *values],
        )


def _slices(team_id: int, start: datetime, end: datetime, *, vcpu: float = 0, memory_mb: int = 0,
            storage_mb: int = 0, gpus: int = 0) -> list[tuple[int, datetime, dict[str, float]]]:  # fmt: skip
    """What was held from ``start`` to ``end``, split at each hour."""
    out = []
    t = start
    while t < end:
        nxt = min(_hour(t) + timedelta(hours=1), end)
        secs = (nxt - t).total_seconds()
        out.append((team_id, _hour(t), {
            "vcpu_seconds": vcpu * secs, "memory_gb_seconds": memory_mb / 1024 * secs,
            "storage_gb_hours": storage_mb / 1024 * secs / 3600, "gpu_seconds": gpus * secs,
        }))  # fmt: skip
        t = nxt
    return out


def accrue(team_id: int, start: datetime, end: datetime, **held: Any) -> None:
    """Add what was held from ``start`` to ``end`` to the team's hours, split at each hour."""
    for team, hour, amounts in _slices(team_id, start, end, **held):
        _upsert(team, hour, **amounts)


def count_start(team_id: int, at: datetime) -> None:
    _upsert(team_id, _hour(at), sandboxes=1)


def holds_disk(row: Sandbox, status: str) -> bool:
    """Whether a sandbox in ``status`` holds its own disk on its node."""
    return row.disk_mb > 0 and status in DISK_HELD and not (status == S.PAUSED and row.ephemeral)


def on_transition(row: Sandbox, to: str, now: datetime) -> dict[str, Any]:
    """Called by :func:`runtime.lifecycle.transition` with the locked row: counts what it held
    up to now when it stops holding, and returns the fields to write with the new status."""
    out: dict[str, Any] = {}
    was, will = row.status in BILLED, to in BILLED
    if row.status == S.PENDING and to == S.STARTING:
        count_start(row.team_id, now)
    if was and not will:
        if row.metered_at is not None:
            accrue(row.team_id, row.metered_at, now, vcpu=row.cpu, memory_mb=row.memory_mb)
        out["metered_at"] = None
    elif will and not was:
        out["metered_at"] = now
    had, will_hold = holds_disk(row, row.status), holds_disk(row, to)
    if had and not will_hold:
        if row.disk_metered_at is not None:
            accrue(row.team_id, row.disk_metered_at, now, storage_mb=row.disk_mb)
        out["disk_metered_at"] = None
    elif will_hold and not had:
        out["disk_metered_at"] = now
    return out


def meter(now: datetime | None = None) -> int:
    """Count every running sandbox, every sandbox disk and every volume up to now (the beat,
    each minute).
    Rows another process holds locked are left for the next tick."""
    now = now or timezone.now()
    n = 0
    with transaction.atomic():
        # Running (or holding a disk) since before metering existed: counted from now on.
        Sandbox.objects.filter(status__in=BILLED, metered_at__isnull=True).update(metered_at=now)
        holding_disk = Q(status__in=DISK_HELD, disk_mb__gt=0) & ~Q(status=S.PAUSED, ephemeral=True)
        Sandbox.objects.filter(holding_disk, disk_metered_at__isnull=True).update(disk_metered_at=now)
        # Summed per (team, hour) and written in that order: a transition writing one of the same
        # rows meanwhile cannot deadlock with this.
        total: dict[tuple[int, datetime], dict[str, float]] = {}

        def add(slices: list[tuple[int, datetime, dict[str, float]]]) -> None:
            for team, hour, amounts in slices:
                acc = total.setdefault((team, hour), dict.fromkeys(amounts, 0.0))
                for k, v in amounts.items():
                    acc[k] += v

        for sb in (
            Sandbox.objects.select_for_update(skip_locked=True)
            .filter(status__in=BILLED, metered_at__lt=now)
            .only("id", "team_id", "cpu", "memory_mb", "metered_at")
        ):
            assert sb.metered_at is not None  # metered_at__lt above
            add(_slices(sb.team_id, sb.metered_at, now, vcpu=sb.cpu, memory_mb=sb.memory_mb))
            Sandbox.objects.filter(id=sb.id).update(metered_at=now)
            n += 1
        for sb in (
            Sandbox.objects.select_for_update(skip_locked=True)
            .filter(holding_disk, disk_metered_at__lt=now)
            .only("id", "team_id", "disk_mb", "disk_metered_at")
        ):
            assert sb.disk_metered_at is not None  # disk_metered_at__lt above
            add(_slices(sb.team_id, sb.disk_metered_at, now, storage_mb=sb.disk_mb))
            Sandbox.objects.filter(id=sb.id).update(disk_metered_at=now)
            n += 1
        for vol in Volume.objects.select_for_update(skip_locked=True).only(
            "id", "team_id", "size_mb", "metered_at", "created_at"
        ):
            start = vol.metered_at or vol.created_at
            if start < now:
                add(_slices(vol.team_id, start, now, storage_mb=vol.size_mb))
                Volume.objects.filter(id=vol.id).update(metered_at=now)
                n += 1
        for (team, hour), amounts in sorted(total.items()):
            _upsert(team, hour, **amounts)
    budgets_warn(now)
    return n


def volume_final(volume: Volume) -> None:
    """The last slice of a volume being deleted (call in the transaction that deletes it)."""
    row = Volume.objects.select_for_update().filter(id=volume.id).first()
    if row is not None:
        now = timezone.now()
        accrue(row.team_id, row.metered_at or row.created_at, now, storage_mb=row.size_mb)


# -- rates, cost and budgets ------------------------------------------------------------------


def site_rates() -> dict[str, float]:
    site = SiteDefaults.objects.filter(id=1).values_list("rates", flat=True).first() or {}
    return {k: float(site.get(k, getattr(settings, s))) for k, s in RATES.items()}


def rates_for(team: Team) -> dict[str, float]:
    own = TeamPolicy.objects.filter(team=team).values_list("rates", flat=True).first() or {}
    return {k: float(own.get(k, v)) for k, v in site_rates().items()}


def validate_rates(values: dict[str, Any]) -> dict[str, float | None]:
    if not isinstance(values, dict):
        raise InvalidValue("rates must be an object of {name: number}")
    out: dict[str, float | None] = {}
    for k, v in values.items():
        if k not in RATES:
            raise InvalidValue(f"unknown rate {k!r}; known: {', '.join(RATES)}")
        if v is not None and (
            isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0
        ):
            raise InvalidValue(f"rate {k} must be a number of 0 or more, got {v!r}")
        out[k] = None if v is None else float(v)
    return out


def cost_of(row: dict[str, float], rates: dict[str, float]) -> float:
    return (
        row["vcpu_seconds"] / 3600 * rates["vcpu_hour"]
        + row["memory_gb_seconds"] / 3600 * rates["memory_gb_hour"]
        + row["storage_gb_hours"] * rates["storage_gb_hour"]
        + row["gpu_seconds"] / 3600 * rates["gpu_hour"]
    )


def _month_start(now: datetime) -> datetime:
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def month_cost(team: Team, now: datetime | None = None) -> float:
    now = now or timezone.now()
    sums = UsageHour.objects.filter(team=team, hour__gte=_month_start(now)).aggregate(
        **{m: Sum(m) for m in METRICS if m != "sandboxes"}
    )
    return cost_of({k: v or 0.0 for k, v in sums.items()}, rates_for(team))


@dataclass
class Budget:
    amount: float | None
    enforced: bool
    spent: float
    currency: str

    @property
    def fraction(self) -> float | None:
        return self.spent / self.amount if self.amount else None

    @property
    def percent(self) -> float | None:
        f = self.fraction
        return None if f is None else round(f * 100, 1)

    @property
    def state(self) -> str:
        f = self.fraction
        if f is None:
            return "none"
        return "exceeded" if f >= 1 else "warning" if f >= WARN_AT else "ok"

    def as_dict(self) -> dict[str, Any]:
        return {"amount": self.amount, "enforced": self.enforced, "spent": round(self.spent, 4),
                "percent": self.percent, "state": self.state,
                "currency": self.currency}  # fmt: skip


def budget_of(team: Team) -> Budget:
    policy = TeamPolicy.objects.filter(team=team).first()
    amount = policy.budget if policy else None
    return Budget(amount=amount, enforced=bool(policy and policy.budget_enforced),
                  spent=month_cost(team) if amount else 0.0, currency=settings.HANGAR_CURRENCY)  # fmt: skip


def budget_check(team: Team, policy: TeamPolicy | None = UNREAD) -> None:
    """Refuse a new sandbox when the team spent its month's budget and enforcement is on
    (``policy``: the team's TeamPolicy row or None, if the caller read it already)."""
    if policy is UNREAD:
        policy = TeamPolicy.objects.filter(team=team).only("budget", "budget_enforced").first()
    if policy is None or not policy.budget_enforced or not policy.budget:
        return
    spent = month_cost(team)
    if spent >= policy.budget:
        cur = settings.HANGAR_CURRENCY
        raise QuotaExceeded(
            f"team {team.name} has spent {spent:.2f} {cur} of its {policy.budget:.2f} {cur} budget this month; "
            "new sandboxes are refused until next month or until an admin raises the budget",
            quota="budget", used=round(spent, 4), limit=policy.budget,
        )  # fmt: skip


def budget_set(*, team: Team, amount: float | None, enforced: bool | None) -> Budget:
    if amount is not None and (
        isinstance(amount, bool)
        or not isinstance(amount, int | float)
        or not math.isfinite(amount)
        or amount <= 0
    ):
        raise InvalidValue(f"budget must be a positive number (or null for none), got {amount!r}")
    policy, _ = TeamPolicy.objects.get_or_create(team=team)
    policy.budget = amount
    if enforced is not None:
        policy.budget_enforced = enforced
    policy.save(update_fields=["budget", "budget_enforced", "updated_at"])
    audit.record(
        "budget.set", team=team, target=f"team {team.name}", amount=amount, enforced=policy.budget_enforced
    )
    return budget_of(team)


def rates_set(*, team: Team | None, values: dict[str, Any]) -> dict[str, float]:
    """Site administrators: a team's cost rates over the site's (``team`` None: the site's)."""
    values = validate_rates(values)
    with transaction.atomic():
        row: SiteDefaults | TeamPolicy
        if team is None:
            row, _ = SiteDefaults.objects.select_for_update().get_or_create(id=1)
        else:
            row, _ = TeamPolicy.objects.select_for_update().get_or_create(team=team)
        for k, v in values.items():
            if v is None:
                row.rates.pop(k, None)
            else:
                row.rates[k] = v
        row.save(update_fields=["rates", "updated_at"])
        audit.record("rates.set", team=team, target=f"team {team.name}" if team else "site", values=values)
    return site_rates() if team is None else rates_for(team)


def budgets_warn(now: datetime) -> list[str]:
    """Write one audit warning per team and month when its spend passes 80% of its budget."""
    month = now.strftime("%Y-%m")
    warned = []
    for policy in TeamPolicy.objects.filter(budget__gt=0).exclude(budget_warned=month).select_related("team"):
        assert policy.budget is not None  # budget__gt=0 above
        spent = month_cost(policy.team, now)
        if spent >= WARN_AT * policy.budget:
            TeamPolicy.objects.filter(id=policy.id).update(budget_warned=month)
            pct = round(spent / policy.budget * 100, 1)
            audit.record("budget.warning", team=policy.team, target=f"team {policy.team.name}",
                         message=f"{pct}% of the month's budget spent ({spent:.2f} of {policy.budget:.2f} "
                                 f"{settings.HANGAR_CURRENCY})", system=True, percent=pct)  # fmt: skip
            warned.append(policy.team.name)
    return warned


# -- reports ----------------------------------------------------------------------------------


def parse_range(frm: str | None, to: str | None, now: datetime | None = None) -> tuple[datetime, datetime]:
    """``from``/``to`` as ISO dates or times (UTC unless they say); default: the last 7 days."""
    now = now or timezone.now()

    def parse(value: str, name: str) -> datetime:
        try:
            t = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise InvalidValue(f"{name} must be an ISO date or time (2026-12-01 or 2026-12-01T10:00Z), "
                               f"got {value!r}") from None  # fmt: skip
        return t if t.tzinfo else t.replace(tzinfo=timezone.get_current_timezone())

    end = parse(to, "to") if to else now
    start = parse(frm, "from") if frm else end - timedelta(days=7)
    if start >= end:
        raise InvalidValue(f"from ({start.isoformat()}) must be before to ({end.isoformat()})")
    if end - start > MAX_RANGE:
        raise InvalidValue(f"a usage range is at most {MAX_RANGE.days} days")
    return start, end


def report(team: Team, start: datetime, end: datetime) -> dict[str, Any]:
    """Hourly rows from ``start`` to ``end`` (hours that used nothing are left out), totals and
    cost, with the month's budget."""
    rates = rates_for(team)
    rows = []
    totals = dict.fromkeys(METRICS, 0.0)
    for r in UsageHour.objects.filter(team=team, hour__gte=_hour(start), hour__lt=end).values(
        "hour", *METRICS
    ):
        r["cost"] = round(cost_of(r, rates), 6)
        rows.append(r)
        for m in METRICS:
            totals[m] += r[m]
    totals["sandboxes"] = int(totals["sandboxes"])
    totals["cost"] = round(cost_of(totals, rates), 6)
    return {
        "team": team.name, "from": start, "to": end, "currency": settings.HANGAR_CURRENCY, "rates": rates,
        "hours": rows, "totals": totals, "budget": budget_of(team).as_dict(),
    }  # fmt: skip


def daily(team: Team, start: datetime, end: datetime) -> list[dict[str, Any]]:
    """The report's hours summed per day (UTC), every day of the range present (for charts)."""
    days: dict[Any, dict[str, float]] = {}
    d = start.date()
    while d <= (end - timedelta(microseconds=1)).date():
        days[d] = dict.fromkeys(METRICS, 0.0)
        d += timedelta(days=1)
    for r in UsageHour.objects.filter(team=team, hour__gte=_hour(start), hour__lt=end).values(
        "hour", *METRICS
    ):
        day = days.setdefault(r["hour"].date(), dict.fromkeys(METRICS, 0.0))
        for m in METRICS:
            day[m] += r[m]
    rates = rates_for(team)
    return [{"day": d, **v, "cost": cost_of(v, rates)} for d, v in sorted(days.items())]


def report_csv(data: dict[str, Any]) -> str:
    """A report's hours as CSV (one row per hour that used something)."""
    import csv
    import io

    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["hour_utc", *METRICS, f"cost_{data['currency']}"])
    for r in data["hours"]:
        w.writerow([r["hour"].isoformat(), *(round(r[m], 6) for m in METRICS), r["cost"]])
    t = data["totals"]
    w.writerow(["total", *(round(t[m], 6) for m in METRICS), t["cost"]])
    return buf.getvalue()
