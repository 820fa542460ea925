"""Users, teams and API tokens (roles and scopes grow with the teams issue)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from ..errors import BadRequest, NotFound
from ..models import ApiToken, Membership, Team

TOKEN_PREFIX = "hgr_"


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass
class IssuedToken:
    token: ApiToken
    raw: str


def token_create(
    *, user: AbstractBaseUser, team: Team, name: str = "", expires_in_s: int | None = None
) -> IssuedToken:
    """Issue a token; the raw value is returned once and only its hash is stored."""
    if not Membership.objects.filter(user=user, team=team).exists():
        raise BadRequest(f"user {user.get_username()} is not a member of team {team.name}")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        team=team,
        name=name,
        prefix=raw[:12],
        token_hash=_hash(raw),
        expires_at=timezone.now() + timedelta(seconds=expires_in_s) if expires_in_s else None,
    )
    return IssuedToken(token=token, raw=raw)


def token_authenticate(raw: str) -> ApiToken | None:
    """The live token for ``raw``, or None; records last use at most once a minute."""
    if not raw.startswith(TOKEN_PREFIX):
        return None
    try:
        # get(), not first(): no ORDER BY to build on every authenticated request.
        token = ApiToken.objects.select_related("user", "team").get(token_hash=_hash(raw))
    except ApiToken.DoesNotExist:
        return None
    now = timezone.now()
    if token.revoked_at is not None or (token.expires_at and token.expires_at <= now):
        return None
    if not token.user.is_active:
        return None
    if token.last_used_at is None or now - token.last_used_at > timedelta(seconds=60):
        ApiToken.objects.filter(id=token.id).update(last_used_at=now)
    return token


def team_for_user(*, user: AbstractBaseUser, team_name: str | None) -> Team:
    memberships = Membership.objects.filter(user=user).select_related("team").order_by("created_at")
    if team_name:
        m = memberships.filter(team__name=team_name).first()
        if m is None:
            raise NotFound(f"user {user.get_username()} is not in a team named {team_name!r}")
        return m.team
    m = memberships.first()
    if m is None:
        raise NotFound(f"user {user.get_username()} belongs to no team")
    return m.team


@transaction.atomic
def bootstrap_admin(
    *, username: str = "admin", team_name: str = "default"
) -> tuple[AbstractBaseUser, Team, str | None]:
    """First start: an admin user and a default team. Returns the password if one was created."""
    User = get_user_model()
    team, _ = Team.objects.get_or_create(name=team_name)
    user = User.objects.filter(username=username).first()
    password = None
    if user is None:
        password = secrets.token_urlsafe(12)
        user = User.objects.create_superuser(username=username, email="", password=password)
    Membership.objects.get_or_create(user=user, team=team, defaults={"role": Membership.Role.OWNER})
    return user, team, password
