"""Who may call what: every endpoint of the API (read from its URL conf, so a new endpoint
without a permission rule fails here) against every kind of caller."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from dashboard.api import api
from dashboard.api.permissions import ANY_SCOPE, RULES
from runtime.models import ApiToken, Membership, Team
from runtime.services import auth as auth_svc

ROLES = ("viewer", "member", "admin", "owner")


def operations() -> list[tuple[str, str]]:
    ops = []
    for prefix, router in api._routers:
        for path, path_view in router.path_operations.items():
            for op in path_view.operations:
                for method in op.methods:
                    ops.append((method, f"{prefix}{path}" or "/"))
    return sorted(ops)


def test_every_endpoint_has_a_permission_rule():
    missing = [f"{m} {p}" for m, p in operations() if (m, p) not in RULES]
    assert not missing, f"endpoints without a rule in dashboard/api/permissions.py: {missing}"
    stale = [f"{m} {p}" for m, p in RULES if (m, p) not in operations()]
    assert not stale, f"rules for endpoints that do not exist: {stale}"


@pytest.fixture
def callers(transactional_db):
    User = get_user_model()
    team = Team.objects.create(name="matrix")
    other = Team.objects.create(name="elsewhere")
    tokens: dict[str, str | None] = {"no token": None, "garbage": "hgr_not-a-real-token"}
    for role in ROLES:
        user = User.objects.create_user(username=f"u-{role}", password="x")
        Membership.objects.create(user=user, team=team, role=role)
        tokens[role] = auth_svc.token_create(user=user, team=team, name=role).raw
    staff = User.objects.create_user(username="u-staff", password="x", is_staff=True)
    Membership.objects.create(user=staff, team=team, role="member")
    tokens["staff member"] = auth_svc.token_create(user=staff, team=team).raw
    owner = User.objects.get(username="u-owner")
    # An owner's token issued as a viewer can do what a viewer can, no more.
    tokens["owner's viewer token"] = auth_svc.token_create(user=owner, team=team, role="viewer").raw
    # A token limited to reading sandboxes.
    tokens["read-only scope"] = auth_svc.token_create(user=owner, team=team, scopes=["sandboxes:read"]).raw
    expired = auth_svc.token_create(user=owner, team=team, expires_in_s=60)
    ApiToken.objects.filter(id=expired.token.id).update(expires_at=timezone.now() - timedelta(seconds=1))
    tokens["expired"] = expired.raw
    revoked = auth_svc.token_create(user=owner, team=team)
    ApiToken.objects.filter(id=revoked.token.id).update(revoked_at=timezone.now())
    tokens["revoked"] = revoked.raw
    outsider = User.objects.create_user(username="u-outsider", password="x")
    Membership.objects.create(user=outsider, team=other, role="owner")
    tokens["another team's owner"] = auth_svc.token_create(user=outsider, team=other).raw
    gone = User.objects.create_user(username="u-left", password="x")
    Membership.objects.create(user=gone, team=team, role="admin")
    tokens["a member who left"] = auth_svc.token_create(user=gone, team=team).raw
    Membership.objects.filter(user=gone).delete()
    return tokens


def expected(caller: str, method: str, path: str) -> str:
    rule = RULES[(method, path)]
    if rule.public:
        return "allowed"
    if caller in ("no token", "garbage", "expired", "revoked", "a member who left"):
        return "401"
    if caller == "read-only scope":
        return "allowed" if rule.scope in ("sandboxes:read", ANY_SCOPE) else "403"
    role = {"staff member": "member", "owner's viewer token": "viewer", "another team's owner": "owner"}.get(
        caller, caller
    )
    if rule.staff and caller != "staff member":
        return "403"
    return "allowed" if ROLES.index(role) >= ROLES.index(rule.role) else "403"


def test_the_authorization_matrix(callers):
    client = Client()
    failures = []
    for method, path in operations():
        # Ids that name nothing: an allowed caller gets 404 (or 422), never a change made.
        url = "/api/v1" + re.sub(r"\{(\w+)\}", lambda m: "999999" if m.group(1) in (
            "process_id", "terminal_id", "job_id", "token_id", "team_id") else "nosuch", path)  # fmt: skip
        for caller, raw in callers.items():
            headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"} if raw else {}
            r = client.generic(method, url, data="{}", content_type="application/json", **headers)
            want = expected(caller, method, path)
            got = str(r.status_code)
            ok = got == want if want in ("401", "403") else got not in ("401", "403") and r.status_code < 500
            if not ok:
                failures.append(f"{caller:>22}  {method:6} {path}: {got} (want {want}) {r.content[:120]!r}")
    assert not failures, "\n" + "\n".join(failures)
