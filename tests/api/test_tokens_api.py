"""API tokens: a role no higher than the user's, scopes, shown once, listed with last use,
revocable; and the CLI that makes users, teams and tokens."""

from __future__ import annotations

import json

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from dashboard.cli import main as cli_main
from runtime.models import ApiToken, Membership, Team
from runtime.services import auth as auth_svc


def call(method: str, path: str, raw: str, body: dict | None = None):
    r = Client().generic(method, f"/api/v1{path}", data=json.dumps(body or {}), content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {raw}")  # fmt: skip
    return r.status_code, (r.json() if r.content else None)


@pytest.fixture
def team(transactional_db):
    User = get_user_model()
    team = Team.objects.create(name="toks")
    for role in ("member", "admin"):
        u = User.objects.create_user(username=f"t-{role}", password="x")
        Membership.objects.create(user=u, team=team, role=role)
    return team


def raw_for(team: Team, username: str, **kw) -> str:
    user = get_user_model().objects.get(username=username)
    return auth_svc.token_create(user=user, team=team, **kw).raw


def test_tokens_are_shown_once_listed_with_last_use_and_revocable(team):
    member = raw_for(team, "t-member")
    status, made = call(
        "POST", "/tokens", member, {"name": "ci", "scopes": ["sandboxes:read"], "expires_in_s": 3600}
    )
    assert status == 201 and made["token"].startswith("hgr_") and made["role"] == "member", made
    assert made["scopes"] == ["sandboxes:read"] and made["expires_at"]
    stored = ApiToken.objects.get(id=made["id"])
    assert made["token"] not in (stored.token_hash, stored.prefix) and stored.prefix == made["token"][:12]
    # The new token works, within its scope: it reads sandboxes and may not create one.
    assert call("GET", "/sandboxes", made["token"])[0] == 200
    status, body = call("POST", "/sandboxes", made["token"], {"image": "busybox"})
    assert status == 403 and "sandboxes:write" in body["detail"]
    listed = call("GET", "/tokens", member)[1]
    assert {t["id"] for t in listed} == {
        stored.id,
        ApiToken.objects.get(user__username="t-member", name="").id,
    }
    assert all("token" not in t for t in listed)  # never shown again
    assert next(t for t in listed if t["id"] == made["id"])["last_used_at"] is not None
    assert call("DELETE", f"/tokens/{made['id']}", member)[0] == 204
    assert call("GET", "/sandboxes", made["token"])[0] == 401  # revoked: at once
    assert call("DELETE", f"/tokens/{made['id']}", member)[0] == 204  # twice is harmless


def test_a_token_cannot_outrank_its_user_and_scopes_are_checked(team):
    member = raw_for(team, "t-member")
    status, body = call("POST", "/tokens", member, {"role": "admin"})
    assert status == 403 and "cannot be higher" in body["detail"]
    status, body = call("POST", "/tokens", member, {"scopes": ["sandboxes:destroy"]})
    assert status == 422 and body["detail"].startswith("scopes.0: Input should be 'sandboxes:read'")
    status, body = call("POST", "/tokens", member, {"role": "emperor"})
    assert status == 422 and body["detail"] == "role: Input should be 'viewer', 'member', 'admin' or 'owner'"
    # An admin's token issued as a viewer is a viewer's.
    viewer_of_admin = raw_for(team, "t-admin", role="viewer")
    status, body = call("POST", "/volumes", viewer_of_admin, {"name": "v", "size_mb": 16})
    assert status == 403 and "viewer" in body["detail"]
    # A role taken away takes effect on the user's tokens at once.
    admin = raw_for(team, "t-admin")
    Membership.objects.filter(user__username="t-admin").update(role="viewer")
    assert call("POST", "/volumes", admin, {"name": "v", "size_mb": 16})[0] == 403


def test_a_token_cannot_mint_a_stronger_token(team):
    owner = get_user_model().objects.create_user(username="t-owner", password="x")
    Membership.objects.create(user=owner, team=team, role="owner")
    # An owner's token issued as a viewer makes no owner (nor admin) token, and so no owner
    # invitation; by default it makes one like itself.
    viewer_of_owner = raw_for(team, "t-owner", role="viewer", scopes=["tokens:write", "teams:*"])
    for role in ("owner", "admin", "member"):
        status, body = call("POST", "/tokens", viewer_of_owner, {"role": role, "scopes": ["teams:*"]})
        assert status == 403 and f"role {role} (this token acts as viewer)" in body["detail"], body
    status, made = call("POST", "/tokens", viewer_of_owner, {"scopes": ["teams:*"]})
    assert status == 201 and made["role"] == "viewer", made
    status, _ = call("POST", f"/teams/{team.id}/invitations", made["token"], {"role": "owner"})
    assert status == 403
    # A scoped token makes no unscoped token (no scopes: all), nor one with scopes it lacks.
    scoped = raw_for(team, "t-member", scopes=["sandboxes:read", "tokens:write"])
    status, body = call("POST", "/tokens", scoped, {})
    assert (
        status == 403 and "all scopes" in body["detail"] and "sandboxes:read, tokens:write" in body["detail"]
    )
    for scopes in (["sandboxes:write"], ["sandboxes:*"], ["admin"], ["sandboxes:read", "volumes:read"]):
        status, body = call("POST", "/tokens", scoped, {"scopes": scopes})
        assert status == 403 and scopes[-1] in body["detail"], (scopes, body)
    status, made = call("POST", "/tokens", scoped, {"scopes": ["sandboxes:read"]})
    assert status == 201 and made["scopes"] == ["sandboxes:read"]
    assert call("POST", f"/sandboxes/{'sb' + 'x' * 16}/exec", made["token"], {"cmd": "id"})[0] == 403
    # Within its scopes it may narrow them: sandboxes:* (or write) covers sandboxes:read and *.
    for held in (["sandboxes:*", "tokens:write"], ["sandboxes:write", "tokens:*"]):
        caller = raw_for(team, "t-member", scopes=held)
        for scopes in (["sandboxes:read"], ["sandboxes:*"], ["sandboxes:write", "tokens:write"]):
            assert call("POST", "/tokens", caller, {"scopes": scopes})[0] == 201, (held, scopes)
    # admin (or no scopes) covers everything.
    assert call("POST", "/tokens", raw_for(team, "t-member", scopes=["admin"]), {})[0] == 201
    # A token that expires makes none that outlives it; by default its own expiry is taken.
    short = raw_for(team, "t-member", expires_in_s=600)
    short_expiry = ApiToken.objects.get(prefix=short[:12]).expires_at
    status, body = call("POST", "/tokens", short, {"expires_in_s": 3600})
    assert status == 403 and "a life past this token's own" in body["detail"]
    status, made = call("POST", "/tokens", short, {})
    assert status == 201 and ApiToken.objects.get(id=made["id"]).expires_at == short_expiry
    assert call("POST", "/tokens", short, {"expires_in_s": 60})[0] == 201
    # The dashboard's token form is bounded by the user's membership, as before.
    with pytest.raises(auth_svc.Forbidden):
        auth_svc.token_create(user=get_user_model().objects.get(username="t-member"), team=team, role="admin")


def test_a_site_administrators_token_acts_in_other_teams_within_its_own_role(team):
    staff = get_user_model().objects.create_user(username="t-staff", password="x", is_staff=True)
    Membership.objects.create(user=staff, team=team, role="owner")
    other = Team.objects.create(name="elsewhere")
    as_admin = raw_for(team, "t-staff", role="admin")
    status, body = call("POST", f"/teams/{other.id}/invitations", as_admin, {"role": "owner"})
    assert status == 403 and "only an owner can invite an owner" in body["detail"], body
    assert call("POST", f"/teams/{other.id}/invitations", as_admin, {"role": "admin"})[0] == 201
    assert (
        call("POST", f"/teams/{other.id}/invitations", raw_for(team, "t-staff"), {"role": "owner"})[0] == 201
    )


def test_members_see_and_revoke_their_own_tokens_admins_all(team):
    member = raw_for(team, "t-member")
    admin = raw_for(team, "t-admin")
    member_token_id = ApiToken.objects.get(user__username="t-member").id
    admin_token_id = ApiToken.objects.get(user__username="t-admin").id
    assert {t["user"] for t in call("GET", "/tokens", member)[1]} == {"t-member"}
    assert {t["user"] for t in call("GET", "/tokens", admin)[1]} == {"t-member", "t-admin"}
    assert call("DELETE", f"/tokens/{admin_token_id}", member)[0] == 404
    assert call("DELETE", f"/tokens/{member_token_id}", admin)[0] == 204
    assert call("GET", "/sandboxes", member)[0] == 401


def test_cli_creates_users_teams_and_tokens_with_roles(transactional_db, capsys):
    assert cli_main(["user", "create", "ada", "--password", "pw-ada"]) == 0
    assert cli_main(["user", "create", "root2", "--staff"]) == 0
    assert "password: " in capsys.readouterr().out  # generated and shown once
    assert get_user_model().objects.get(username="root2").is_staff
    assert cli_main(["user", "create", "ada"]) == 2
    assert "exists already" in capsys.readouterr().err
    assert cli_main(["team", "create", "research", "--owner", "ada"]) == 0
    assert Membership.objects.get(user__username="ada", team__name="research").role == "owner"
    assert cli_main(["team", "create", "research", "--owner", "ada"]) == 2
    assert cli_main(["token", "create", "--user", "ada", "--team", "research", "--role", "viewer"]) == 0
    raw = capsys.readouterr().out.strip().splitlines()[-1]
    token = auth_svc.token_authenticate(raw)
    assert token is not None and token.role == "viewer" and token.effective_role == "viewer"
    # What the CLI changed is in the audit log as the CLI's.
    from runtime.models import AuditEvent

    made = AuditEvent.objects.get(action="token.create", team_name="research")
    assert made.via == "cli" and made.actor.startswith("cli:") and raw not in str(made.data) + made.target
    assert AuditEvent.objects.get(action="team.create").via == "cli"


# -- teams and members -----------------------------------------------------------------------


def test_members_roles_and_the_last_owner(team):
    User = get_user_model()
    owner = User.objects.create_user(username="t-owner", password="x")
    Membership.objects.create(user=owner, team=team, role="owner")
    User.objects.create_user(username="newbie", password="x")
    own, adm, mem = (raw_for(team, f"t-{r}") for r in ("owner", "admin", "member"))
    url = f"/teams/{team.id}/members"
    assert [t["name"] for t in call("GET", "/teams", mem)[1]] == ["toks"]
    assert {m["username"]: m["role"] for m in call("GET", url, mem)[1]} == {
        "t-owner": "owner", "t-admin": "admin", "t-member": "member"}  # fmt: skip
    # Members do not manage members; admins do, up to admin; only owners make owners.
    assert call("POST", url, mem, {"username": "newbie"})[0] == 403
    assert call("POST", url, adm, {"username": "newbie", "role": "owner"})[0] == 403
    status, body = call("POST", url, adm, {"username": "newbie", "role": "viewer"})
    assert status == 201 and body == {**body, "username": "newbie", "role": "viewer"}
    assert call("POST", url, adm, {"username": "newbie"})[0] == 409  # already in
    assert call("POST", url, adm, {"username": "nobody"})[0] == 404
    assert call("PATCH", f"{url}/newbie", adm, {"role": "member"})[1]["role"] == "member"
    assert call("PATCH", f"{url}/t-owner", adm, {"role": "member"})[0] == 403
    # The last owner can neither leave nor be demoted; with a second owner, both can.
    status, body = call("DELETE", f"{url}/t-owner", own)
    assert status == 409 and "last owner" in body["detail"]
    assert call("PATCH", f"{url}/t-owner", own, {"role": "admin"})[0] == 409
    assert call("PATCH", f"{url}/t-admin", own, {"role": "owner"})[1]["role"] == "owner"
    assert call("DELETE", f"{url}/t-owner", own)[0] == 204  # leaving
    # Anyone may leave; a member may not remove someone else.
    assert call("DELETE", f"{url}/newbie", mem)[0] == 403
    assert call("DELETE", f"{url}/t-member", mem)[0] == 204
    assert call("GET", "/sandboxes", mem)[0] == 401  # out of the team: its tokens are dead
    # Another team's members are not this token's business.
    other = Team.objects.create(name="other")
    assert call("GET", f"/teams/{other.id}/members", adm)[0] == 404


def test_a_removed_member_s_tokens_are_revoked_and_stay_revoked_if_they_come_back(team):
    from runtime.models import AuditEvent

    admin = raw_for(team, "t-admin")
    member = raw_for(team, "t-member")
    member_id = ApiToken.objects.get(prefix=member[:12]).id
    url = f"/teams/{team.id}/members"
    assert call("DELETE", f"{url}/t-member", admin)[0] == 204
    listed = {t["id"]: t for t in call("GET", "/tokens", admin)[1]}
    assert listed[member_id]["revoked_at"] is not None, listed
    assert AuditEvent.objects.filter(action="token.revoke", target__startswith=f"token {member_id} ").exists()
    # Added again: the old token stays dead (a new one must be made).
    assert call("POST", url, admin, {"username": "t-member", "role": "member"})[0] == 201
    assert call("GET", "/sandboxes", member)[0] == 401
    # Leaving the team does the same.
    again = raw_for(team, "t-member")
    assert call("DELETE", f"{url}/t-member", again)[0] == 204
    assert call("POST", url, admin, {"username": "t-member", "role": "member"})[0] == 201
    assert call("GET", "/sandboxes", again)[0] == 401
    assert ApiToken.objects.get(prefix=again[:12]).revoked_at is not None
    # Tokens of the member in other teams are theirs to keep.
    other = Team.objects.create(name="other")
    Membership.objects.create(
        user=get_user_model().objects.get(username="t-member"), team=other, role="member"
    )
    elsewhere = raw_for(other, "t-member")
    assert call("DELETE", f"{url}/t-member", admin)[0] == 204
    assert call("GET", "/sandboxes", elsewhere)[0] == 200


def test_websockets_obey_token_roles_and_scopes(team):
    from dashboard.websockets.consumers import _identity

    def who(raw: str):
        return _identity({"api_token": auth_svc.token_authenticate(raw), "token_presented": True})

    assert who(raw_for(team, "t-member"))[2] is True  # may type
    assert who(raw_for(team, "t-admin", role="viewer"))[2] is False  # watches only
    assert who(raw_for(team, "t-member", scopes=["sandboxes:read"]))[2] is False
    # Not its business at all: refused (a 4403) saying which scope it lacks.
    assert who(raw_for(team, "t-member", scopes=["volumes:*"])) == (
        "this token lacks the scope 'sandboxes:read' (it has: volumes:*)"
    )


def test_a_key_registered_with_a_token_opens_no_more_than_the_token_could(team, tmp_path):
    """An SSH key registered through the API acts at most as the token that registered it: a
    viewer-issued token of an admin, or a token scoped to SSH keys alone, cannot make itself a
    member's shell through a key; the admin's full token can."""
    import subprocess

    from runtime.errors import Forbidden
    from runtime.models import Harness, Sandbox
    from runtime.services.ssh_keys import harness_for_ssh

    sb = Sandbox.objects.create(
        team=team, image="busybox", image_digest="sha256:" + "a" * 64, status="stopped"
    )
    Harness.objects.create(team=team, name="work", agent="custom", image="busybox", sandbox=sb, setup="done")
    admin = get_user_model().objects.get(username="t-admin")
    cases = {
        "viewer-issued": (raw_for(team, "t-admin", role="viewer"), "viewer"),
        "ssh_keys:write only": (raw_for(team, "t-admin", scopes=["ssh_keys:write"]), "viewer"),
        "harnesses:write and ssh_keys:write": (
            raw_for(team, "t-admin", scopes=["harnesses:write", "ssh_keys:write"]), "admin"),
        "full": (raw_for(team, "t-admin"), "admin"),
    }  # fmt: skip
    for i, (what, (raw, role)) in enumerate(cases.items()):
        path = tmp_path / f"k{i}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
        status, key = call(
            "POST", "/ssh-keys", raw, {"name": f"k{i}", "public_key": path.with_suffix(".pub").read_text()}
        )
        assert status == 201, (what, key)
        assert key["team"] == "toks" and key["role"] == role, (what, key)
        if role == "viewer":
            with pytest.raises(Forbidden, match="a shell needs member or above"):
                harness_for_ssh(user=admin, target="work", fingerprint=key["fingerprint"])
        else:
            assert harness_for_ssh(user=admin, target="work", fingerprint=key["fingerprint"]).name == "work"
