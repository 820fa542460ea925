"""The signed-in user's current team: the one chosen with the team switcher (kept in the
session), else their first. Pages and page websockets are scoped to it."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.http import HttpRequest

from runtime.models import Membership, Team

SESSION_KEY = "hangar_team_id"


class SignedInRequest(HttpRequest):
    """The request a ``@login_required`` page is handed: its ``user`` is a signed-in user,
    never the anonymous one. Only a type for the pages' signatures: Django passes its own."""

    user: User


def user_memberships(*, user: Any) -> list[Membership]:
    return list(Membership.objects.filter(user=user).select_related("team").order_by("team__name"))


def session_team(*, user: Any, session: Any) -> Team | None:
    """The team this session works in, if the user still belongs to it; else their first."""
    memberships = Membership.objects.filter(user=user).select_related("team")
    team_id = session.get(SESSION_KEY) if session is not None else None
    if team_id is not None:
        m = memberships.filter(team_id=team_id).first()
        if m is not None:
            return m.team
    m = memberships.order_by("team__name").first()
    return m.team if m is not None else None


def session_membership(*, user: Any, session: Any) -> Membership | None:
    team = session_team(user=user, session=session)
    if team is None:
        return None
    return Membership.objects.select_related("team").get(user=user, team=team)
