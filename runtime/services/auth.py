"""Users, teams, roles and API tokens.

Roles, lowest first: ``viewer`` (sees, changes nothing), ``member`` (creates and uses
sandboxes), ``admin`` (manages members, tokens, secrets and quotas), ``owner`` (also deletes the
team). A token carries a role no higher than its user's and optionally a list of scopes; what
it may do is the lower of that role and the user's role in the team now, within its scopes
(``dashboard/api/permissions.py`` maps every endpoint to a scope and a least role)."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import OuterRef, QuerySet, Subquery
from django.utils import timezone

from ..errors import BadRequest, Conflict, Forbidden, InvalidValue, NotFound
from ..models import ApiToken, Invitation, Membership, Team
from . import audit

TOKEN_PREFIX = "hgr_"
ROLES = ("viewer", "member", "admin", "owner")
RESOURCES = (
    "sandboxes", "volumes", "pools", "images", "tokens", "teams", "secrets", "audit", "system", "harnesses",
    "ssh_keys",
)  # fmt: skip
SCOPES = (
    tuple(f"{r}:{a}" for r in RESOURCES for a in ("read", "write"))
    + tuple(f"{r}:*" for r in RESOURCES)
    + ("admin",)
)


def role_at_least(role: str, least: str) -> bool:
    return role in ROLES and ROLES.index(role) >= ROLES.index(least)


def lower_role(a: str, b: str) -> str:
    return a if ROLES.index(a) <= ROLES.index(b) else b


def token_allows(token: ApiToken, scope: str) -> bool:
    """Whether ``scope`` (``sandboxes:write``…) is within the token's scopes. No scopes: all.
    ``sandboxes:*`` covers read and write; ``admin`` covers everything; write implies read."""
    scopes = token.scopes or []
    if not scopes or "admin" in scopes:
        return True
    resource, _, action = scope.partition(":")
    return (
        scope in scopes or f"{resource}:*" in scopes or (action == "read" and f"{resource}:write" in scopes)
    )


def validate_scopes(scopes: list[str] | None) -> list[str]:
    scopes = sorted(set(scopes or []))
    unknown = [s for s in scopes if s not in SCOPES]
    if unknown:
        raise InvalidValue(f"unknown scope(s) {', '.join(map(repr, unknown))}; known: {', '.join(SCOPES)}")
    return scopes


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass
class IssuedToken:
    token: ApiToken
    raw: str


def token_create(
    *,
    user: AbstractBaseUser,
    team: Team,
    name: str = "",
    expires_in_s: int | None = None,
    role: str | None = None,
    scopes: list[str] | None = None,
) -> IssuedToken:
    """Issue a token; the raw value is returned once and only its hash is stored. ``role``
    (default: the user's role in the team) may not be higher than the user's."""
    held = Membership.objects.filter(user=user, team=team).values_list("role", flat=True).first()
    if held is None:
        raise BadRequest(f"user {user.get_username()} is not a member of team {team.name}")
    role = role or held
    if role not in ROLES:
        raise InvalidValue(f"unknown role {role!r}; one of: {', '.join(ROLES)}")
    if not role_at_least(held, role):
        raise Forbidden(f"a token's role cannot be higher than its user's: {user.get_username()} is {held} "
                        f"in team {team.name}, asked for {role}")  # fmt: skip
    if expires_in_s is not None and not 0 < expires_in_s <= 10 * 365 * 86400:
        raise InvalidValue(f"expires_in_s must be from 1 s to 10 years, got {expires_in_s}")
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        team=team,
        name=name[:100],
        prefix=raw[:12],
        token_hash=_hash(raw),
        role=role,
        scopes=validate_scopes(scopes),
        expires_at=timezone.now() + timedelta(seconds=expires_in_s) if expires_in_s else None,
    )
    audit.record("token.create", team=team, target=f"token {token.id} ({token.prefix}…) of {user.get_username()}",
                 name=token.name, role=role, scopes=token.scopes, expires_at=token.expires_at)  # fmt: skip
    return IssuedToken(token=token, raw=raw)


def tokens_visible(*, caller: ApiToken) -> QuerySet[ApiToken]:
    """The caller's own tokens in its team; an admin sees every token of the team."""
    tokens = ApiToken.objects.filter(team=caller.team).select_related("user").order_by("-created_at")
    if role_at_least(caller.effective_role, "admin"):
        return tokens
    return tokens.filter(user=caller.user)


def token_revoke(*, caller: ApiToken, token_id: int) -> ApiToken:
    """Revoke a token of the caller's (an admin: any of the team's). Idempotent."""
    token = tokens_visible(caller=caller).filter(id=token_id).first()
    if token is None:
        raise NotFound(f"no token {token_id} that you can see in team {caller.team.name}")
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        ApiToken.objects.filter(id=token.id, revoked_at__isnull=True).update(revoked_at=token.revoked_at)
        audit.record("token.revoke", team=token.team,
                     target=f"token {token.id} ({token.prefix}…) of {token.user.get_username()}")  # fmt: skip
    return token


def token_revoke_row(token: ApiToken) -> None:
    """Revoke a token Hangar issued for something of its own (a harness's). Idempotent."""
    if ApiToken.objects.filter(id=token.id, revoked_at__isnull=True).update(revoked_at=timezone.now()):
        audit.record("token.revoke", team=token.team, target=f"token {token.id} ({token.prefix}…)")


def role_of(user: AbstractBaseUser, team: Team) -> str | None:
    return Membership.objects.filter(user=user, team=team).values_list("role", flat=True).first()


def token_authenticate(raw: str) -> ApiToken | None:
    """The live token for ``raw``, or None; records last use at most once a minute."""
    if not raw.startswith(TOKEN_PREFIX):
        return None
    held = Membership.objects.filter(user=OuterRef("user_id"), team=OuterRef("team_id")).values("role")[:1]
    try:
        # get(), not first(): no ORDER BY to build on every authenticated request. The user's
        # role in the team now comes in the same query.
        token = (
            ApiToken.objects.select_related("user", "team")
            .annotate(member_role=Subquery(held))
            .get(token_hash=_hash(raw))
        )
    except ApiToken.DoesNotExist:
        return None
    now = timezone.now()
    if token.revoked_at is not None or (token.expires_at and token.expires_at <= now):
        return None
    if not token.user.is_active or token.member_role is None:  # left the team: the token is dead
        return None
    token.effective_role = lower_role(token.role or token.member_role, token.member_role)
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


# -- users and teams (the CLI's, and the site administrator's) --------------------------------

USERNAME_RE = r"^[A-Za-z0-9_.@+-]{1,150}$"


def user_create(
    *, username: str, password: str | None = None, staff: bool = False
) -> tuple[AbstractBaseUser, str]:
    """A user; returns it with its password (generated when not given)."""
    import re

    if not re.fullmatch(USERNAME_RE, username or ""):
        raise InvalidValue(f"invalid user name {username!r}: 1-150 of letters, digits and _ . @ + -")
    User = get_user_model()
    if User.objects.filter(username=username).exists():
        raise Conflict(f"a user named {username!r} exists already")
    password = password or secrets.token_urlsafe(12)
    user = User.objects.create_user(username=username, password=password, is_staff=staff, is_superuser=staff)
    return user, password


def team_create(*, name: str, owner: AbstractBaseUser) -> Team:
    name = (name or "").strip()
    if not 1 <= len(name) <= 100:
        raise InvalidValue("a team name is 1 to 100 characters")
    try:
        with transaction.atomic():
            team = Team.objects.create(name=name)
            Membership.objects.create(user=owner, team=team, role=Membership.Role.OWNER)
            audit.record("team.create", team=team, target=f"team {name}", owner=owner.get_username())
    except IntegrityError:
        raise Conflict(f"a team named {name!r} exists already") from None
    return team


# -- members --------------------------------------------------------------------------------


def teams_visible(*, user: AbstractBaseUser) -> QuerySet[Team]:
    """The teams a user belongs to; a site administrator's: every team."""
    if getattr(user, "is_staff", False):
        return Team.objects.order_by("name")
    return Team.objects.filter(memberships__user=user).order_by("name")


def team_for_caller(*, caller: ApiToken, team_id: int) -> Team:
    """The team ``team_id`` if the caller's token is for it (staff: any); else 404."""
    if team_id == caller.team_id or (caller.user.is_staff and Team.objects.filter(id=team_id).exists()):
        return Team.objects.get(id=team_id)
    raise NotFound(f"no team {team_id} that this token can see (it is for team {caller.team.name})")


def caller_role(caller: ApiToken, team: Team) -> str:
    if team.id == caller.team_id:
        return caller.effective_role
    return "owner" if caller.user.is_staff else "viewer"


def _check_role_value(role: str) -> None:
    if role not in ROLES:
        raise InvalidValue(f"unknown role {role!r}; one of: {', '.join(ROLES)}")


def _owners(team: Team) -> int:
    return Membership.objects.filter(team=team, role=Membership.Role.OWNER).count()


def member_add(*, caller: ApiToken, team: Team, username: str, role: str) -> Membership:
    """Add a user to the team; an admin may give up to admin, only an owner may make owners."""
    _check_role_value(role)
    mine = caller_role(caller, team)
    if not role_at_least(mine, "admin"):
        raise Forbidden(f"only admins and owners manage members; you are {mine}")
    if not role_at_least(mine, role) or (role == "owner" and mine != "owner"):
        raise Forbidden(f"you are {mine} in team {team.name}: you cannot make someone {role}")
    user = get_user_model().objects.filter(username=username).first()
    if user is None:
        raise NotFound(f"no user named {username!r}")
    try:
        with transaction.atomic():
            m = Membership.objects.create(user=user, team=team, role=role)
            audit.record("member.add", team=team, target=username, role=role)
            return m
    except IntegrityError:
        raise Conflict(f"{username} is already in team {team.name}") from None


@transaction.atomic
def member_set_role(*, caller: ApiToken, team: Team, username: str, role: str) -> Membership:
    _check_role_value(role)
    mine = caller_role(caller, team)
    m = Membership.objects.select_for_update().filter(team=team, user__username=username).first()
    if m is None:
        raise NotFound(f"{username} is not in team {team.name}")
    if not role_at_least(mine, "admin"):
        raise Forbidden(f"only admins and owners change roles; you are {mine}")
    if mine != "owner" and (m.role == "owner" or role == "owner"):
        raise Forbidden("only an owner can make an owner or change an owner's role")
    if m.role == "owner" and role != "owner" and _owners(team) == 1:
        raise Conflict(f"{username} is the last owner of team {team.name}: make someone else owner first")
    audit.record("member.role", team=team, target=username, role_from=m.role, role=role)
    m.role = role
    m.save(update_fields=["role"])
    m.user  # noqa: B018 - loaded here, where the database may be used, for the answer
    return m


@transaction.atomic
def member_remove(*, caller: ApiToken, team: Team, username: str) -> None:
    """Remove a member (admins; owners for owners); anyone may leave. The last owner stays."""
    mine = caller_role(caller, team)
    m = Membership.objects.select_for_update().filter(team=team, user__username=username).first()
    if m is None:
        raise NotFound(f"{username} is not in team {team.name}")
    leaving = m.user_id == caller.user_id and team.id == caller.team_id
    if not leaving:
        if not role_at_least(mine, "admin"):
            raise Forbidden(f"only admins and owners remove members; you are {mine}")
        if m.role == "owner" and mine != "owner":
            raise Forbidden("only an owner can remove an owner")
    if m.role == "owner" and _owners(team) == 1:
        raise Conflict(f"{username} is the last owner of team {team.name}: make someone else owner first")
    audit.record("member.leave" if leaving else "member.remove", team=team, target=username, role=m.role)
    m.delete()


# -- invitations ----------------------------------------------------------------------------

INVITE_PREFIX = "inv_"


@dataclass
class IssuedInvitation:
    invitation: Invitation
    raw: str


def invitation_create(*, inviter_role: str, user: AbstractBaseUser, team: Team, role: str = "member",
                      expires_in_s: int | None = None) -> IssuedInvitation:  # fmt: skip
    """A link that adds whoever accepts it to ``team`` as ``role`` (admins: up to admin;
    owners: owner too). The raw code is returned once; only its hash is kept."""
    _check_role_value(role)
    if not role_at_least(inviter_role, "admin"):
        raise Forbidden(f"only admins and owners invite; you are {inviter_role}")
    if role == "owner" and inviter_role != "owner":
        raise Forbidden("only an owner can invite an owner")
    ttl = expires_in_s if expires_in_s is not None else settings.HANGAR_INVITATION_TTL_S
    if not 60 <= ttl <= 90 * 86400:
        raise InvalidValue(f"expires_in_s must be between 60 and {90 * 86400} (90 days), got {ttl}")
    raw = INVITE_PREFIX + secrets.token_urlsafe(24)
    inv = Invitation.objects.create(
        team=team, role=role, token_hash=_hash(raw), expires_at=timezone.now() + timedelta(seconds=ttl),
        created_by=user if getattr(user, "is_authenticated", False) else None,
    )  # fmt: skip
    audit.record(
        "invitation.create", team=team, target=f"invitation {inv.id}", role=role, expires_at=inv.expires_at
    )
    return IssuedInvitation(invitation=inv, raw=raw)


def invitations_open(*, team: Team) -> QuerySet[Invitation]:
    return Invitation.objects.filter(
        team=team, accepted_at__isnull=True, revoked_at__isnull=True, expires_at__gt=timezone.now()
    ).select_related("created_by")


def invitation_revoke(*, team: Team, invitation_id: int) -> Invitation:
    inv = Invitation.objects.filter(team=team, id=invitation_id).first()
    if inv is None:
        raise NotFound(f"no invitation {invitation_id} in team {team.name}")
    if inv.revoked_at is None and inv.accepted_at is None:
        inv.revoked_at = timezone.now()
        inv.save(update_fields=["revoked_at"])
        audit.record("invitation.revoke", team=team, target=f"invitation {inv.id}")
    return inv


def invitation_lookup(raw: str) -> Invitation:
    """The open invitation for a link's code, or a NotFound that says why it cannot be used."""
    inv = Invitation.objects.select_related("team").filter(token_hash=_hash(raw or "")).first()
    if inv is None:
        raise NotFound("this invitation link is not valid; ask for a new one")
    if inv.revoked_at is not None:
        raise NotFound("this invitation was revoked; ask for a new one")
    if inv.accepted_at is not None:
        raise NotFound("this invitation was already used; ask for a new one")
    if inv.expires_at <= timezone.now():
        raise NotFound("this invitation expired; ask for a new one")
    return inv


@transaction.atomic
def invitation_accept(*, raw: str, user: AbstractBaseUser) -> Membership:
    """Join the invitation's team (once: the row is locked and marked used). Someone already
    in the team keeps their role; the invitation is still used up."""
    inv = invitation_lookup(raw)
    inv = Invitation.objects.select_for_update().get(id=inv.id)
    if inv.accepted_at is not None or inv.revoked_at is not None:
        raise NotFound("this invitation was already used; ask for a new one")
    m, _ = Membership.objects.get_or_create(user=user, team=inv.team, defaults={"role": inv.role})
    inv.accepted_at, inv.accepted_by = timezone.now(), user
    inv.save(update_fields=["accepted_at", "accepted_by"])
    audit.record(
        "invitation.accept", team=inv.team, target=user.get_username(), invitation=inv.id, role=m.role
    )
    return m
