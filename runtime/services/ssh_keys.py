"""Users' SSH public keys, and who may open which harness over the SSH gateway."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth.models import User
from django.db import IntegrityError
from django.db.models import Q, QuerySet
from django.utils import timezone

from .. import notify
from ..errors import Conflict, Forbidden, InvalidValue, NotFound, ServiceError
from ..models import Harness, Membership, SshKey, Team
from . import audit
from .auth import lower_role, role_at_least

MAX_KEYS_PER_USER = 50


def parse_public_key(text: str) -> tuple[str, str, str]:
    """(normalised OpenSSH line, SHA256 fingerprint, comment) of one public key line."""
    import asyncssh

    text = (text or "").strip()
    if "PRIVATE KEY" in text:
        raise InvalidValue("that is a private key: paste the public one (the .pub file), and keep the private "
                           "key to yourself")  # fmt: skip
    if not text or "\n" in text or len(text) > 16384:
        raise InvalidValue(
            "public_key must be one line in OpenSSH format, e.g. the contents of ~/.ssh/id_ed25519.pub"
        )
    try:
        key = asyncssh.import_public_key(text)
    except (asyncssh.KeyImportError, ValueError) as exc:
        raise InvalidValue(f"public_key is not an OpenSSH public key: {exc}") from None
    if key.algorithm.startswith(b"ssh-dss"):
        raise InvalidValue("DSA keys are not accepted; use ed25519, ECDSA or RSA")
    parts = text.split(None, 2)
    comment = parts[2] if len(parts) > 2 else ""
    line = key.export_public_key("openssh").decode().strip().split(None, 2)
    return f"{line[0]} {line[1]}", key.get_fingerprint("sha256"), comment


def ssh_keys_for_user(*, user: User) -> QuerySet[SshKey]:
    return SshKey.objects.filter(user=user).order_by("created_at")


def ssh_key_add(
    *, user: User, name: str, public_key: str, team: Team | None = None, role: str = ""
) -> SshKey:
    """``team``: the key opens only that team's harnesses (keys registered with an API token,
    which is one team's, are; keys added in the dashboard open all of the user's teams).
    ``role``: the most the key acts as there (a key registered with a token: what the token
    could do, so a viewer's or a narrowly scoped token cannot make itself a member's shell)."""
    line, fingerprint, comment = parse_public_key(public_key)
    name = (name or comment or "key").strip()[:100]
    if SshKey.objects.filter(user=user).count() >= MAX_KEYS_PER_USER:
        raise InvalidValue(f"a user may register at most {MAX_KEYS_PER_USER} keys; delete one first")
    if SshKey.objects.filter(fingerprint=fingerprint).exists():
        raise Conflict(f"the key {fingerprint} is already registered (a key belongs to one user)")
    try:
        key = SshKey.objects.create(
            user=user, name=name, public_key=line, fingerprint=fingerprint, team=team, role=role
        )
    except IntegrityError:
        raise Conflict(f"you already have a key named {name!r}, or this key is already registered") from None
    audit.record("ssh_key.add", target=f"{fingerprint} of {user.get_username()}", name=name)
    return key


def ssh_key_delete(*, user: User, key_id: int | str) -> None:
    key = (
        SshKey.objects.filter(user=user)
        .filter(Q(id=int(key_id)) if str(key_id).isascii() and str(key_id).isdigit() else Q(name=str(key_id)))
        .first()
    )
    if key is None:
        raise NotFound(f"you have no SSH key {key_id!r}")
    key.delete()
    audit.record("ssh_key.delete", target=f"{key.fingerprint} of {user.get_username()}", name=key.name)
    notify.auth_changed([user.pk])  # SSH connections made with it end


def ssh_key_user(*, fingerprint: str) -> User | None:
    """The active user a key (by SHA256 fingerprint) belongs to, or None; notes its use."""
    key = SshKey.objects.select_related("user").filter(fingerprint=fingerprint).first()
    if key is None or not key.user.is_active:
        return None
    now = timezone.now()
    if key.last_used_at is None or now - key.last_used_at > timedelta(minutes=1):
        SshKey.objects.filter(id=key.id).update(last_used_at=now)
    return key.user


def harness_for_ssh(*, user: User, target: str, fingerprint: str = "") -> Harness:
    """The harness ``target`` (its name, or its id) names among the user's teams. A shell is
    a member's right: viewers are refused. A name held in two of the user's teams is refused
    with the ids to use instead."""
    teams = Membership.objects.filter(user=user).values_list("team_id", "role")
    roles = dict(teams)
    if fingerprint:
        only, most = SshKey.objects.filter(fingerprint=fingerprint, user=user).values_list(
            "team_id", "role"
        ).first() or (None, "")
        if only is not None:  # a key registered with a team's token opens that team's only
            roles = {k: v for k, v in roles.items() if k == only}
        if most:  # and acts at most as that token could
            roles = {k: lower_role(v, most) for k, v in roles.items()}
    rows = list(
        Harness.objects.filter(team_id__in=roles.keys(), deleted_at__isnull=True)
        .filter(Q(name=target) | Q(id=target))
        .select_related("team", "sandbox", "sandbox__node")
    )
    if not rows:
        raise NotFound(f"no harness {target!r} in your teams")
    if len(rows) > 1:
        ids = ", ".join(f"{h.id} ({h.team.name})" for h in rows)
        raise Conflict(f"harness name {target!r} is in several of your teams; connect as its id: {ids}")
    h = rows[0]
    if not role_at_least(roles[h.team_id], "member"):
        raise Forbidden(
            f"your role in team {h.team.name} is {roles[h.team_id]}; a shell needs member or above"
        )
    return h


def ssh_access_ended(*, fingerprint: str, user_id: int, target: str, harness_id: str) -> str:
    """Why an open SSH connection may no longer go on, or "" while it may: its key deleted, its
    user deactivated, out of the harness's team or below member there, the harness gone."""
    key = SshKey.objects.select_related("user").filter(fingerprint=fingerprint, user_id=user_id).first()
    if key is None:
        return "the SSH key of this connection was removed"
    if not key.user.is_active:
        return "your account is no longer active"
    try:
        h = harness_for_ssh(user=key.user, target=target, fingerprint=fingerprint)
    except ServiceError as exc:
        return exc.message
    return "" if h.id == harness_id else f"harness {target!r} changed since you connected"
