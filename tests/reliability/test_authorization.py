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


def test_the_authorization_matrix(callers, report):
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
    report.held(
        "authorization",
        "endpoint x caller (4 roles, staff, scoped, viewer-issued, expired, revoked, "
        "removed member, another team, no token, garbage)",
        cells=len(operations()) * len(callers),
    )


# -- objects: own team's, another team's, nonexistent ---------------------------------------------

# The path parameters that name a team's object, and the least of it the matrix makes.
OBJECT_PARAMS = ("sandbox_id", "volume", "harness_id", "name")
SUB_IDS = {"process_id": "999999", "terminal_id": "999999", "port": "8000"}


def _objects(team: Team, tag: str) -> dict[str, str]:
    from runtime.models import Harness, Sandbox, Secret, Volume

    sb = Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:" + "a" * 64, status="stopped"
    )
    vol = Volume.objects.create(team=team, name=f"vol-{tag}", size_mb=64)
    h = Harness.objects.create(team=team, name=f"h-{tag}", agent="custom", image="busybox", sandbox=sb,
                               setup="done")  # fmt: skip
    Secret.objects.create(team=team, name=f"S_{tag.upper()}", ciphertext=b"x")
    return {"sandbox_id": sb.id, "volume": vol.name, "harness_id": h.name, "name": f"S_{tag.upper()}"}


def test_another_teams_objects_are_a_404_to_everyone_and_own_ones_are_reached(callers, report):
    """For every endpoint naming a team's object (a sandbox and what is under it, a volume, a
    harness, a secret): the caller's own team's object is reached (whatever the operation then
    says: never a 404 for the object itself, never a 5xx), another team's is a 404 exactly as a
    name that does not exist (never a 409 or a 2xx that would tell it exists), for every caller
    that may call it; those that may not get their 401 or 403 first."""
    matrix, elsewhere = Team.objects.get(name="matrix"), Team.objects.get(name="elsewhere")
    missing = {
        "sandbox_id": "sbnosuch00000000000",
        "volume": "nosuch",
        "harness_id": "nosuch",
        "name": "NOSUCH",
    }
    client = Client()
    failures = []
    cells = 0
    n = 0
    for method, path in operations():
        params = re.findall(r"\{(\w+)\}", path)
        named = [p for p in params if p in OBJECT_PARAMS]
        if not named or any(p not in OBJECT_PARAMS and p not in SUB_IDS for p in params):
            continue
        for caller in callers:  # every role and token state, each at the three objects
            n += 1  # objects of their own for each caller: an earlier DELETE leaves the next nothing
            mine, theirs = _objects(matrix, f"m{n}"), _objects(elsewhere, f"t{n}")
            if caller == "another team's owner":  # the matrix team's objects are another team's to it
                mine, theirs = theirs, mine
            answers = {}
            for whose, ids in (("another team's", theirs), ("nonexistent", missing), ("own", mine)):
                url = "/api/v1" + re.sub(
                    r"\{(\w+)\}", lambda m, ids=ids: ids.get(m.group(1)) or SUB_IDS[m.group(1)], path
                )
                raw = callers[caller]
                headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"} if raw else {}
                r = client.generic(method, url, data="{}", content_type="application/json", **headers)
                cells += 1
                got, detail = r.status_code, r.content.decode(errors="replace")
                answers[whose] = got
                if (want := expected(caller, method, path)) != "allowed":
                    ok = str(got) == want  # refused (401, 403) before any object is looked up
                elif whose == "own":
                    # Reached: anything the operation says but "no such sandbox/volume/harness/secret"
                    # (a 404 for a sub-object, a process 999999, is the operation's own answer);
                    # a 502 only for an object whose node this matrix never made.
                    own_missing = got == 404 and re.search(r"no (sandbox|volume|harness|secret)\b", detail)
                    ok = (
                        not own_missing
                        and got not in (401, 403)
                        and (got < 500 or (got == 502 and "node" in detail))
                    )
                else:
                    # Another team's object answers exactly as a name that does not exist: a 404
                    # (or the 422 of a body checked before any lookup), never a 2xx or a 409.
                    ok = got in (404, 422)
                if not ok:
                    failures.append(f"{caller:>22} {whose:>15}  {method:6} {path}: {got} {r.content[:140]!r}")
            theirs_got, missing_got = answers["another team's"], answers["nonexistent"]
            if theirs_got != missing_got:
                failures.append(f"{caller:>22} {method:6} {path}: another team's object answers {theirs_got}, "
                                f"a missing one {missing_got}")  # fmt: skip
    assert cells > 1000, cells
    assert not failures, f"{len(failures)} of {cells} cells:\n" + "\n".join(failures)
    report.held(
        "authorization",
        "endpoint x caller (every role and token state) x object (own team's, another team's, nonexistent)",
        cells=cells,
    )
