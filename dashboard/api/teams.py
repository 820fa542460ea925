"""Teams and their members: who is in the caller's team, with which role."""

from __future__ import annotations

from datetime import datetime

from django.http import HttpRequest
from ninja import Field, Router, Schema

from runtime.errors import Forbidden
from runtime.models import Membership
from runtime.services import auth as auth_svc

from .blocking import blocking

router = Router(tags=["teams"])


class TeamOut(Schema):
    id: int
    name: str
    created_at: datetime


class TeamIn(Schema):
    name: str = Field(min_length=1, max_length=100)
    owner: str | None = Field(None, description="user name of its owner (default: you)")


class MemberOut(Schema):
    username: str
    role: str
    created_at: datetime

    @staticmethod
    def resolve_username(obj: Membership) -> str:
        return obj.user.get_username()


class MemberIn(Schema):
    username: str
    role: str = "member"


class RoleIn(Schema):
    role: str


@router.get("", response=list[TeamOut])
async def list_teams(request: HttpRequest):
    """The teams you belong to (a site administrator: every team)."""
    return await blocking(lambda: list(auth_svc.teams_visible(user=request.auth.user)))()  # type: ignore[attr-defined]


@router.post("", response={201: TeamOut})
async def create_team(request: HttpRequest, payload: TeamIn):
    """Site administrators: a new team, owned by `owner` (default: you)."""

    def create():
        from django.contrib.auth import get_user_model

        owner = request.auth.user  # type: ignore[attr-defined]
        if payload.owner:
            owner = get_user_model().objects.filter(username=payload.owner).first()
            if owner is None:
                raise Forbidden(f"no user named {payload.owner!r}")
        return auth_svc.team_create(name=payload.name, owner=owner)

    return 201, await blocking(create)()


@router.get("/{team_id}/members", response=list[MemberOut])
async def list_members(request: HttpRequest, team_id: int):
    def members():
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)  # type: ignore[arg-type]
        return list(Membership.objects.filter(team=team).select_related("user").order_by("user__username"))

    return await blocking(members)()


@router.post("/{team_id}/members", response={201: MemberOut})
async def add_member(request: HttpRequest, team_id: int, payload: MemberIn):
    """Admins: add a user with a role (at most admin; owners may add owners)."""

    def add():
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)  # type: ignore[arg-type]
        return auth_svc.member_add(
            caller=request.auth, team=team, username=payload.username, role=payload.role
        )  # type: ignore[arg-type]

    return 201, await blocking(add)()


@router.patch("/{team_id}/members/{username}", response=MemberOut)
async def change_role(request: HttpRequest, team_id: int, username: str, payload: RoleIn):
    """Admins: change a member's role (owners: to or from owner; the last owner stays one)."""

    def change():
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)  # type: ignore[arg-type]
        return auth_svc.member_set_role(caller=request.auth, team=team, username=username, role=payload.role)  # type: ignore[arg-type]

    return await blocking(change)()


@router.delete("/{team_id}/members/{username}", response={204: None})
async def remove_member(request: HttpRequest, team_id: int, username: str):
    """Admins: remove a member; anyone: leave. The last owner cannot leave."""

    def remove() -> None:
        team = auth_svc.team_for_caller(caller=request.auth, team_id=team_id)  # type: ignore[arg-type]
        auth_svc.member_remove(caller=request.auth, team=team, username=username)  # type: ignore[arg-type]

    await blocking(remove)()
    return 204, None
