"""Teams and their members: who is in the caller's team, with which role."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

from django.http import HttpResponse
from django.urls import reverse
from ninja import Body, Field, Query, Router, Schema
from pydantic import StrictFloat, StrictInt

from runtime.errors import NotFound
from runtime.models import Invitation, Membership, Team
from runtime.services import auth as auth_svc
from runtime.services import quotas as quota_svc
from runtime.services import usage as usage_svc

from .auth import AuthedRequest
from .blocking import blocking
from .schemas import StrictIn, errors

router = Router(tags=["teams"])


class TeamOut(Schema):
    id: int
    name: str
    created_at: datetime


# An enum in the schema; mypy cannot build a Literal from a tuple, and reads it as a str.
if TYPE_CHECKING:
    Role = str
else:
    Role = Literal[tuple(auth_svc.ROLES)]
# Quota and rate values: numbers as JSON has them (true is not 1), null for the default.
QuotaValues = dict[str, StrictInt | StrictFloat | None]
RateValues = dict[str, StrictFloat | None]


class TeamIn(StrictIn):
    name: str = Field(min_length=1, max_length=100)
    owner: str | None = Field(None, description="user name of its owner (default: you)")


class MemberOut(Schema):
    username: str
    role: str
    created_at: datetime

    @staticmethod
    def resolve_username(obj: Membership) -> str:
        return obj.user.get_username()


class MemberIn(StrictIn):
    username: str = Field(min_length=1, max_length=150)
    role: Role = "member"


class RoleIn(StrictIn):
    role: Role


@router.get("", response=list[TeamOut])
async def list_teams(request: AuthedRequest):
    """The teams you belong to (a site administrator: every team)."""
    return await blocking(lambda: list(auth_svc.teams_visible(user=request.auth.user)))()


@router.post("", response={201: TeamOut, **errors(404, 409)})
async def create_team(request: AuthedRequest, payload: TeamIn):
    """Site administrators: a new team, owned by `owner` (default: you)."""

    def create():
        from django.contrib.auth import get_user_model

        owner = request.auth.user
        if payload.owner:
            named = get_user_model().objects.filter(username=payload.owner).first()
            if named is None:
                raise NotFound(f"no user named {payload.owner!r}")
            owner = named
        return auth_svc.team_create(name=payload.name, owner=owner)

    return 201, await blocking(create)()


@router.get("/{team_id}/members", response=list[MemberOut])
async def list_members(request: AuthedRequest, team_id: int):
    def members():
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)
        return list(Membership.objects.filter(team=team).select_related("user").order_by("user__username"))

    return await blocking(members)()


@router.post("/{team_id}/members", response={201: MemberOut, **errors(409)})
async def add_member(request: AuthedRequest, team_id: int, payload: MemberIn):
    """Admins: add a user with a role (at most admin; owners may add owners)."""

    def add():
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)
        return auth_svc.member_add(
            caller=request.auth, team=team, username=payload.username, role=payload.role
        )

    return 201, await blocking(add)()


@router.patch("/{team_id}/members/{username}", response={200: MemberOut, **errors(409)})
async def change_role(request: AuthedRequest, team_id: int, username: str, payload: RoleIn):
    """Admins: change a member's role (owners: to or from owner; the last owner stays one)."""

    def change():
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)
        return auth_svc.member_set_role(caller=request.auth, team=team, username=username, role=payload.role)

    return await blocking(change)()


@router.delete("/{team_id}/members/{username}", response={204: None, **errors(409)})
async def remove_member(request: AuthedRequest, team_id: int, username: str):
    """Admins: remove a member; anyone: leave. The last owner cannot leave."""

    def remove() -> None:
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)
        auth_svc.member_remove(caller=request.auth, team=team, username=username)

    await blocking(remove)()
    return 204, None


def _team(request: AuthedRequest, team_id: int) -> tuple[Team, str]:
    """The team (as :func:`auth_svc.team_for_caller`) and the caller's role in it."""
    caller = request.auth
    team = auth_svc.team_for_caller(caller=caller, team_id=team_id)
    return team, auth_svc.caller_role(caller, team)


# -- quotas ---------------------------------------------------------------------------------


class QuotaOut(Schema):
    label: str
    unit: str
    limit: float
    ceiling: float
    used: float | None


@router.get("/{team_id}/quotas", response=dict[str, QuotaOut])
async def get_quotas(request: AuthedRequest, team_id: int):
    """Each quota's limit, the site's ceiling for it and what the team uses now."""
    return await blocking(lambda: quota_svc.report(_team(request, team_id)[0]))()


@router.put("/{team_id}/quotas", response=dict[str, QuotaOut])
async def set_quotas(request: AuthedRequest, team_id: int, payload: Body[QuotaValues]):
    """Admins: `{"sandboxes": 10, "vcpu": 8, "memory_mb": 16384, …}` (null: back to the ceiling).
    Each at most its ceiling; site administrators may go above (the ceiling follows)."""

    def put():
        team, role = _team(request, team_id)
        return quota_svc.limits_set(team=team, values=payload, role=role, staff=request.auth.user.is_staff)

    return await blocking(put)()


@router.put("/{team_id}/quotas/ceilings", response=dict[str, QuotaOut])
async def set_ceilings(request: AuthedRequest, team_id: int, payload: Body[QuotaValues]):
    """Site administrators: the most this team's admins may set (null: the site default)."""
    return await blocking(lambda: quota_svc.ceilings_set(team=_team(request, team_id)[0], values=payload))()


# -- usage, cost and budget -----------------------------------------------------------------


class UsageQuery(Schema):
    from_: str | None = Field(None, alias="from", description="ISO date or time (default: 7 days ago)")
    to: str | None = Field(None, description="ISO date or time (default: now)")
    format: Literal["json", "csv"] = "json"


class BudgetIn(StrictIn):
    amount: float | None = Field(
        gt=0, description="per calendar month (UTC), in the rates' currency; null: none"
    )
    enforced: bool | None = Field(None, description="at 100%: refuse new sandboxes")


class BudgetOut(Schema):
    amount: float | None
    enforced: bool
    spent: float
    percent: float | None
    state: Literal["none", "ok", "warning", "exceeded"]
    currency: str


class UsageOut(Schema):
    team: str
    from_: datetime = Field(alias="from")
    to: datetime
    currency: str
    rates: dict[str, float]
    hours: list[dict[str, Any]]
    totals: dict[str, float]
    budget: BudgetOut


@router.get(
    "/{team_id}/usage",
    response={200: UsageOut},
    by_alias=True,
    openapi_extra={"responses": {200: {"content": {"text/csv": {"schema": {"type": "string"}}}}}},
)
async def get_usage(request: AuthedRequest, team_id: int, q: Query[UsageQuery]):
    """Admins: hourly usage (vCPU-seconds, memory GB-seconds, storage GB-hours, GPU-seconds,
    sandboxes started) with cost at the team's rates, totals and the month's budget."""

    def read():
        team = _team(request, team_id)[0]
        start, end = usage_svc.parse_range(q.from_, q.to)
        return usage_svc.report(team, start, end)

    data = await blocking(read)()
    if q.format == "csv":
        response = HttpResponse(usage_svc.report_csv(data), content_type="text/csv; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="hangar-usage-{data["team"]}.csv"'
        return response
    return data


@router.get("/{team_id}/budget", response=BudgetOut)
async def get_budget(request: AuthedRequest, team_id: int):
    return await blocking(lambda: usage_svc.budget_of(_team(request, team_id)[0]).as_dict())()


@router.put("/{team_id}/budget", response=BudgetOut)
async def set_budget(request: AuthedRequest, team_id: int, payload: BudgetIn):
    """Admins: the team's monthly budget; warned at 80%, new sandboxes refused at 100% if enforced."""
    return await blocking(
        lambda: usage_svc.budget_set(team=_team(request, team_id)[0], amount=payload.amount,
                                     enforced=payload.enforced).as_dict()
    )()  # fmt: skip


@router.get("/{team_id}/rates", response=dict[str, float])
async def get_rates(request: AuthedRequest, team_id: int):
    """The team's cost rates (per vCPU-hour, memory GB-hour, storage GB-hour, GPU-hour)."""
    return await blocking(lambda: usage_svc.rates_for(_team(request, team_id)[0]))()


@router.put("/{team_id}/rates", response=dict[str, float])
async def set_rates(request: AuthedRequest, team_id: int, payload: Body[RateValues]):
    """Site administrators: this team's rates over the site's (null: the site's)."""
    return await blocking(lambda: usage_svc.rates_set(team=_team(request, team_id)[0], values=payload))()


# -- invitations ----------------------------------------------------------------------------


class InvitationIn(StrictIn):
    role: Role = "member"
    expires_in_s: int | None = Field(
        None, ge=60, le=90 * 86400, description="default: HANGAR_INVITATION_TTL_S (7 days); at most 90 days"
    )


class InvitationOut(Schema):
    id: int
    role: str
    created_by: str | None
    created_at: datetime
    expires_at: datetime

    @staticmethod
    def resolve_created_by(obj: Invitation | dict) -> str | None:
        user = obj["created_by"] if isinstance(obj, dict) else obj.created_by
        return user if user is None or isinstance(user, str) else user.get_username()


class InvitationCreatedOut(InvitationOut):
    url: str = Field(description="the link to give the person invited: shown this once")


@router.get("/{team_id}/invitations", response=list[InvitationOut])
async def list_invitations(request: AuthedRequest, team_id: int):
    """Admins: invitations not yet used, revoked or expired."""
    return await blocking(lambda: list(auth_svc.invitations_open(team=_team(request, team_id)[0])))()


@router.post("/{team_id}/invitations", response={201: InvitationCreatedOut})
async def create_invitation(request: AuthedRequest, team_id: int, payload: InvitationIn):
    """Admins: a link that adds whoever opens it (signed in, or signing up) with `role`."""

    def create() -> dict:
        team, role = _team(request, team_id)
        issued = auth_svc.invitation_create(inviter_role=role, user=request.auth.user, team=team,
                                            role=payload.role, expires_in_s=payload.expires_in_s)  # fmt: skip
        inv = issued.invitation
        return {"id": inv.id, "role": inv.role, "created_by": request.auth.user.get_username(),
                "created_at": inv.created_at, "expires_at": inv.expires_at,
                "url": request.build_absolute_uri(reverse("invitation", args=[issued.raw]))}  # fmt: skip

    return 201, await blocking(create)()


@router.delete("/{team_id}/invitations/{invitation_id}", response={204: None})
async def revoke_invitation(request: AuthedRequest, team_id: int, invitation_id: int):
    await blocking(
        lambda: auth_svc.invitation_revoke(team=_team(request, team_id)[0], invitation_id=invitation_id)
    )()
    return 204, None
