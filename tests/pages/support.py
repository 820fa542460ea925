"""What the dashboard page tests share: a member of a team, and a sandbox row."""

from __future__ import annotations

from datetime import timedelta

from django.contrib.auth import get_user_model
from django.utils import timezone

from runtime.models import Membership, Sandbox, Team

S = Sandbox.Status


def make_member(username: str, team: Team, role: str = Membership.Role.MEMBER):
    user = get_user_model().objects.create_user(username, password="pw")
    Membership.objects.create(user=user, team=team, role=role)
    return user


def make_sandbox(team: Team, status: str = S.RUNNING, **fields) -> Sandbox:
    fields.setdefault("expires_at", timezone.now() + timedelta(hours=1))
    return Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:" + "b" * 64, status=status, **fields
    )
