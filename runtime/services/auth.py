"""Users, teams, roles and API tokens.

Roles, lowest first: ``viewer`` (sees, changes nothing), ``member`` (creates and uses
sandboxes), ``admin`` (manages members, tokens, secrets and quotas), ``owner`` (also deletes the
team). A token carries a role no higher than its user's and optionally a list of scopes; what
it may do is the lower of that role and the user's role in the team now, within its scopes
(``dashboard/api/permissions.py`` maps every endpoint to a scope and a least role). A token
made by another token is no stronger than it. Whatever ends or lowers an identity (a token
revoked, a member removed or lowered, a user deactivated) says so through
:func:`runtime.notify.auth_changed`, so that open sockets and SSH sessions check again."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Protocol

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.db.models import OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from .. import notify
from ..errors import BadRequest, Conflict, Forbidden, InvalidValue, NotFound
from ..models import ApiToken, Harness, Invitation, Membership, Sandbox, Team
from . import audit

if TYPE_CHECKING:
    from typing import TypedDict

    from django_stubs_ext import WithAnnotations

    class _MemberRole(TypedDict):
        member_role: str | None


TOKEN_PREFIX = "hgr_"
ROLES = ("viewer", "member", "admin", "owner")
RESOURCES = (
    "sandboxes", "volumes", "pools", "images", "tokens", "teams", "secrets", "audit", "system", "harnesses",
    "ssh_keys", "traces",
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


def scopes_beyond(caller: ApiToken, scopes: list[str]) -> list[str]:
    """What of ``scopes`` (none: all) the caller's token does not hold itself, under
    :func:`token_allows`: a scoped token cannot grant all scopes or ``admin``; ``sandboxes:*``
    is within a token that may read and write sandboxes."""
    held = caller.scopes or []
    if not held or "admin" in held:
        return []
    if not scopes:
        return ["all scopes (a token without scopes)"]
    beyond = []
    for scope in scopes:
        resource, _, action = scope.partition(":")
        if scope == "admin":
            beyond.append(scope)
        elif action == "*":
            if not (token_allows(caller, f"{resource}:read") and token_allows(caller, f"{resource}:write")):
                beyond.append(scope)
        elif not token_allows(caller, scope):
            beyond.append(scope)
    return beyond


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


def _within_caller(caller: ApiToken, *, role: str, scopes: list[str], expires_at: datetime | None) -> None:
    """A token mints no token stronger than itself: role, scopes and lifetime at most its own."""
    if caller.harness_id is not None:
        raise Forbidden("a harness's token cannot make tokens")
    beyond = []
    if not role_at_least(caller.effective_role, role):
        beyond.append(f"role {role} (this token acts as {caller.effective_role})")
    if extra := scopes_beyond(caller, scopes):
        beyond.append(f"scope(s) {', '.join(extra)} (this token has: {', '.join(caller.scopes)})")
    if caller.expires_at is not None and (expires_at is None or expires_at > caller.expires_at):
        beyond.append(f"a life past this token's own (it expires at {caller.expires_at.isoformat()})")
    if beyond:
        raise Forbidden("a token cannot make a token stronger than itself; asked for " + "; ".join(beyond))


def token_create(
    *,
    user: User,
    team: Team,
    name: str = "",
    expires_in_s: int | None = None,
    role: str | None = None,
    scopes: list[str] | None = None,
    caller: ApiToken | None = None,
    harness: Harness | None = None,
) -> IssuedToken:
    """Issue a token; the raw value is returned once and only its hash is stored. ``role``
    (default: the user's role in the team) may not be higher than the user's. Made by a token
    (``caller``), it is at most that token: its role, its scopes, its expiry (which it takes by
    default). ``harness``: the harness's own token, which reaches only what that harness made."""
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
    scopes = validate_scopes(scopes)
    expires_at = timezone.now() + timedelta(seconds=expires_in_s) if expires_in_s else None
    if caller is not None:
        expires_at = expires_at or caller.expires_at
        _within_caller(caller, role=role, scopes=scopes, expires_at=expires_at)
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    token = ApiToken.objects.create(
        user=user,
        team=team,
        name=name[:100],
        prefix=raw[:12],
        token_hash=_hash(raw),
        role=role,
        scopes=scopes,
        expires_at=expires_at,
        harness=harness,
    )
    audit.record("token.create", team=team, target=f"token {token.id} ({token.prefix}…) of {user.get_username()}",
                 name=token.name, role=role, scopes=token.scopes, expires_at=token.expires_at)  # fmt: skip
    return IssuedToken(token=token, raw=raw)


def tokens_visible(*, caller: Caller) -> QuerySet[ApiToken]:
    """The caller's own tokens in its team; an admin sees every token of the team."""
    tokens = ApiToken.objects.filter(team=caller.team).select_related("user").order_by("-created_at")
    if role_at_least(caller.effective_role, "admin"):
        return tokens
    return tokens.filter(user=caller.user)


def token_revoke(*, caller: Caller, token_id: int) -> ApiToken:
    """Revoke a token of the caller's (an admin: any of the team's). Idempotent."""
    token = tokens_visible(caller=caller).filter(id=token_id).first()
    if token is None:
        raise NotFound(f"no token {token_id} that you can see in team {caller.team.name}")
    if token.revoked_at is None:
        token.revoked_at = timezone.now()
        ApiToken.objects.filter(id=token.id, revoked_at__isnull=True).update(revoked_at=token.revoked_at)
        audit.record("token.revoke", team=token.team,
                     target=f"token {token.id} ({token.prefix}…) of {token.user.get_username()}")  # fmt: skip
        notify.auth_changed([token.user_id])
    return token


def token_revoke_row(token: ApiToken) -> None:
    """Revoke a token Hangar issued for something of its own (a harness's). Idempotent."""
    if ApiToken.objects.filter(id=token.id, revoked_at__isnull=True).update(revoked_at=timezone.now()):
        audit.record("token.revoke", team=token.team, target=f"token {token.id} ({token.prefix}…)")
        notify.auth_changed([token.user_id])


def _revoke_member_tokens(team: Team, user: User, why: str) -> None:
    """Revoke every token of ``user`` in ``team`` (they must not come back if the user does)."""
    now = timezone.now()
    for token in ApiToken.objects.filter(team=team, user=user, revoked_at__isnull=True):
        if ApiToken.objects.filter(id=token.id, revoked_at__isnull=True).update(revoked_at=now):
            audit.record("token.revoke", team=team, reason=why,
                         target=f"token {token.id} ({token.prefix}…) of {user.get_username()}")  # fmt: skip


def role_of(user: User, team: Team) -> str | None:
    return Membership.objects.filter(user=user, team=team).values_list("role", flat=True).first()


def _with_member_role() -> QuerySet[WithAnnotations[ApiToken, _MemberRole]]:
    # The user's role in the team now comes in the same query as the token.
    held = Membership.objects.filter(user=OuterRef("user_id"), team=OuterRef("team_id")).values("role")[:1]
    return ApiToken.objects.select_related("user", "team").annotate(member_role=Subquery(held))


def token_alive(token: WithAnnotations[ApiToken, _MemberRole], now: datetime) -> ApiToken | None:
    """``token`` (its ``member_role``: its user's role in its team now, None when out of it) if
    it is live at ``now``, with its ``effective_role`` set; None if it is dead."""
    if token.revoked_at is not None or (token.expires_at and token.expires_at <= now):
        return None
    if not token.user.is_active or token.member_role is None:  # left the team: the token is dead
        return None
    token.effective_role = lower_role(token.role or token.member_role, token.member_role)
    return token


def token_authenticate(raw: str) -> ApiToken | None:
    """The live token for ``raw``, or None; records last use at most once a minute."""
    if not raw.startswith(TOKEN_PREFIX):
        return None
    try:
        # get(), not first(): no ORDER BY to build on every authenticated request.
        token = _with_member_role().get(token_hash=_hash(raw))
    except ApiToken.DoesNotExist:
        return None
    now = timezone.now()
    if token_alive(token, now) is None:
        return None
    if token.last_used_at is None or now - token.last_used_at > timedelta(seconds=60):
        ApiToken.objects.filter(id=token.id).update(last_used_at=now)
    return token


def token_current(*, token_id: int) -> ApiToken | None:
    """The token ``token_id`` as it stands now, with its effective role; None once it is
    revoked or expired, or its user is deactivated or out of its team (what an open socket
    or stream checks again)."""
    token = _with_member_role().filter(id=token_id).first()
    return token_alive(token, timezone.now()) if token is not None else None


def sandbox_reach(caller: Any) -> Q | None:
    """The sandboxes a harness's own token reaches, as a filter on sandboxes: its harness's
    and those it created. None (every other token, a signed-in user): all of its team's."""
    harness_id = getattr(caller, "harness_id", None)
    if harness_id is None:
        return None
    own = Harness.objects.filter(id=harness_id).values("sandbox_id")
    return Q(id__in=own) | Q(created_by_token_id=caller.id)


def sandbox_reached(*, caller: Any, sandbox_id: str) -> bool:
    """Whether the caller reaches this sandbox of its team (see :func:`sandbox_reach`)."""
    reach = sandbox_reach(caller)
    return reach is None or Sandbox.objects.filter(reach, id=sandbox_id).exists()


def user_changed(sender: Any, instance: Any, **kwargs: Any) -> None:
    """``post_save`` of a user: a deactivated one's open sockets and SSH sessions end."""
    if not instance.is_active:
        notify.auth_changed([instance.pk])


def team_for_user(*, user: User, team_name: str | None) -> Team:
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
def bootstrap_admin(*, username: str = "admin", team_name: str = "default") -> tuple[User, Team, str | None]:
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


def user_create(*, username: str, password: str | None = None, staff: bool = False) -> tuple[User, str]:
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


def team_create(*, name: str, owner: User) -> Team:
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


def teams_visible(*, user: User) -> QuerySet[Team]:
    """The teams a user belongs to; a site administrator's: every team."""
    if getattr(user, "is_staff", False):
        return Team.objects.order_by("name")
    return Team.objects.filter(memberships__user=user).order_by("name")


def team_for_caller(*, caller: ApiToken, team_id: int) -> Team:
    """The team ``team_id`` if the caller's token is for it (staff: any); else 404."""
    if team_id == caller.team_id or (caller.user.is_staff and Team.objects.filter(id=team_id).exists()):
        return Team.objects.get(id=team_id)
    raise NotFound(f"no team {team_id} that this token can see (it is for team {caller.team.name})")


class Caller(Protocol):
    """Who manages a team's members: an API token, or a signed-in user in their current team
    (the pages' ``SessionCaller``); both answer these the same way."""

    @property
    def user(self) -> User: ...
    @property
    def user_id(self) -> int: ...
    @property
    def team(self) -> Team: ...
    @property
    def team_id(self) -> int: ...
    @property
    def effective_role(self) -> str: ...


def caller_role(caller: Caller, team: Team) -> str:
    if team.id == caller.team_id:
        return caller.effective_role
    if not caller.user.is_staff:
        return "viewer"
    # A site administrator acts as an owner in any team, but a token issued with a lower role
    # stays within it there too.
    issued = getattr(caller, "role", "")
    return issued if issued in ROLES else "owner"


def _check_role_value(role: str) -> None:
    if role not in ROLES:
        raise InvalidValue(f"unknown role {role!r}; one of: {', '.join(ROLES)}")


def _owners(team: Team) -> int:
    return Membership.objects.filter(team=team, role=Membership.Role.OWNER).count()


def member_add(*, caller: Caller, team: Team, username: str, role: str) -> Membership:
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
def member_set_role(*, caller: Caller, team: Team, username: str, role: str) -> Membership:
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
    notify.auth_changed([m.user_id])  # open sockets and SSH sessions take the new role
    m.user  # noqa: B018 - loaded here, where the database may be used, for the answer
    return m


@transaction.atomic
def member_remove(*, caller: Caller, team: Team, username: str) -> None:
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
    # Their tokens die with the membership, for good: joining again does not bring them back.
    _revoke_member_tokens(team, m.user, "left the team" if leaving else "removed from the team")
    m.delete()
    notify.auth_changed([m.user_id])


# -- invitations ----------------------------------------------------------------------------

INVITE_PREFIX = "inv_"


@dataclass
class IssuedInvitation:
    invitation: Invitation
    raw: str


def invitation_create(*, inviter_role: str, user: User, team: Team, role: str = "member",
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
def invitation_accept(*, raw: str, user: User) -> Membership:
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
