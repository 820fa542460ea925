"""The Team page (members, invitations, tokens, secrets, quotas, budget), the Usage page's
charts and the Audit page, through Django's test client."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from runtime.models import ApiToken, AuditEvent, Membership, Secret, Team, TeamPolicy, UsageHour
from runtime.services import secrets as secret_svc
from tests.support import GVISOR


def _member(username: str, team: Team, role: str, **kw):
    user = get_user_model().objects.create_user(username, password="pw", **kw)
    Membership.objects.create(user=user, team=team, role=role)
    return user


@pytest.fixture
def crew(db) -> Team:
    return Team.objects.create(name="crew")


def test_admins_manage_secrets_on_the_team_page_and_values_never_come_back(client, crew):
    client.force_login(_member("ada", crew, "admin"))
    r = client.post(
        "/team/settings/", {"action": "secret_create", "name": "GH_TOKEN", "value": "ghp_verysecret123"}
    )
    assert r.status_code == 302
    page = client.get("/team/settings/")
    assert (
        page.status_code == 200 and b"GH_TOKEN" in page.content and b"ghp_verysecret123" not in page.content
    )
    assert secret_svc.decrypt(Secret.objects.get(name="GH_TOKEN").ciphertext) == "ghp_verysecret123"
    # The change is in the audit log as the dashboard session's, without the value.
    e = AuditEvent.objects.get(action="secret.create")
    assert (e.actor, e.via, e.target) == ("ada", "dashboard", "GH_TOKEN") and len(e.session) == 12
    assert "ghp_" not in str(e.data) + e.message
    # A bad name is a message on the page, not an error page.
    r = client.post("/team/settings/", {"action": "secret_create", "name": "no spaces", "value": "x"})
    assert r.status_code == 422 and b"invalid secret name" in r.content


def test_members_see_the_team_but_cannot_manage_it(client, crew):
    _member("owner", crew, "owner")
    client.force_login(_member("mel", crew, "member"))
    page = client.get("/team/settings/")
    assert page.status_code == 200 and b"owner" in page.content
    assert b'id="secret-form"' not in page.content and b'id="invite-form"' not in page.content
    r = client.post("/team/settings/", {"action": "secret_create", "name": "X", "value": "y"})
    assert r.status_code == 403 and not Secret.objects.exists()
    r = client.post("/team/settings/", {"action": "member_role", "username": "owner", "role": "viewer"})
    assert r.status_code == 403 and Membership.objects.get(user__username="owner").role == "owner"
    # A member makes tokens of their own, shown once.
    r = client.post(
        "/team/settings/", {"action": "token_create", "name": "laptop", "scopes": "sandboxes:read"}
    )
    assert r.status_code == 302
    page = client.get("/team/settings/").content.decode()
    raw = re.search(r'id="token-value" readonly value="(hgr_[^"]+)"', page).group(1)
    assert ApiToken.objects.get(name="laptop").scopes == ["sandboxes:read"]
    assert raw not in client.get("/team/settings/").content.decode()  # shown once
    # Usage and audit are for admins.
    assert client.get("/usage/").status_code == 403 and client.get("/audit/").status_code == 403


def test_admins_invite_change_roles_and_set_quotas_and_budget(client, crew):
    _member("owner", crew, "owner")
    _member("vic", crew, "viewer")
    client.force_login(_member("ada", crew, "admin"))
    assert (
        client.post("/team/settings/", {"action": "invite", "role": "member", "days": "3"}).status_code == 302
    )
    page = client.get("/team/settings/").content.decode()
    assert re.search(r'id="invite-url" readonly value="http://testserver/invite/inv_[^"]+/"', page)
    client.post("/team/settings/", {"action": "member_role", "username": "vic", "role": "member"})
    assert Membership.objects.get(user__username="vic").role == "member"
    r = client.post("/team/settings/", {"action": "member_role", "username": "owner", "role": "admin"})
    assert r.status_code == 403 and b"only an owner" in r.content
    r = client.post("/team/settings/", {"action": "quotas", "sandboxes": "4", "vcpu": "2.5", "memory_mb": ""})
    assert r.status_code == 302
    assert TeamPolicy.objects.get(team=crew).limits == {"sandboxes": 4, "vcpu": 2.5}
    r = client.post("/team/settings/", {"action": "quotas", "sandboxes": "100000"})
    assert r.status_code == 403 and b"ceiling" in r.content
    client.post("/team/settings/", {"action": "budget", "amount": "50", "enforced": "on"})
    policy = TeamPolicy.objects.get(team=crew)
    assert policy.budget == 50 and policy.budget_enforced


def test_the_usage_page_draws_a_chart_per_team_and_exports_csv(client, crew):
    other = Team.objects.create(name="other")
    now = timezone.now().replace(minute=0, second=0, microsecond=0)
    UsageHour.objects.create(
        team=crew, hour=now - timedelta(days=1), vcpu_seconds=7200, memory_gb_seconds=3600
    )
    UsageHour.objects.create(team=other, hour=now, vcpu_seconds=3600)
    client.force_login(_member("ada", crew, "admin"))
    page = client.get("/usage/?days=7").content.decode()
    assert page.count("<svg") == 2  # compute and storage, for this team only
    assert "other" not in re.sub(r"<[^>]+>", "", page).split("Usage", 1)[1].split("crew")[0]
    bars = re.findall(r'<rect class="bar s-cpu"[^>]*height="([\d.]+)"><title>([^<]+)</title>', page)
    assert len(bars) == 7 and any("2 vCPU-hours" in title for _, title in bars)
    assert sum(float(h) > 0 for h, _ in bars) == 1
    csv_text = client.get(f"/usage/{crew.id}.csv").content.decode()
    assert csv_text.splitlines()[-1].startswith("total,7200")
    assert client.get(f"/usage/{other.id}.csv").status_code == 404
    # A site administrator sees every team.
    client.force_login(get_user_model().objects.create_user("root", password="x", is_staff=True))
    assert client.get("/usage/").content.decode().count("<svg") == 4


def test_the_audit_page_filters_and_pages_and_exports(client, crew, transactional_db):
    # transactional: the export reads its pages on the blocking pool, on connections of its own
    from runtime.services import audit

    for i in range(105):
        audit.record("sandbox.create", team=crew, target=f"sb{i:03d}")
    audit.record("member.add", team=crew, target="zed")
    audit.record("member.add", team=Team.objects.create(name="else"), target="not-ours")
    client.force_login(_member("ada", crew, "admin"))
    page = client.get("/audit/").content.decode()
    assert page.count('data-action="') == 100 and "not-ours" not in page and 'id="audit-older"' in page
    older = (
        re.search(r'href="\?([^"]*before=\d+[^"]*)" id="audit-older"', page).group(1).replace("&amp;", "&")
    )
    assert client.get(f"/audit/?{older}").content.decode().count('data-action="') == 6
    page = client.get("/audit/?action=member.").content.decode()
    assert page.count('data-action="') == 1 and "zed" in page
    body = b"".join(client.get("/audit.csv?action=sandbox.")).decode()
    assert len(body.strip().splitlines()) == 1 + 105


def test_the_create_form_offers_the_teams_secrets_and_gives_the_chosen_ones(client, crew):
    from runtime.models import Image, Sandbox
    from runtime.services.nodes import node_register

    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64).nodes.add(node)
    secret_svc.secret_create(team=crew, name="API_KEY", value="v1")
    secret_svc.secret_create(team=crew, name="OTHER", value="v2")
    secret_svc.secret_create(team=Team.objects.create(name="else"), name="NOT_OURS", value="v3")
    client.force_login(_member("mel", crew, "member"))
    page = client.get("/sandboxes/").content.decode()
    assert 'value="API_KEY"' in page and 'value="OTHER"' in page and "NOT_OURS" not in page
    r = client.post("/sandboxes/", {"image": "busybox", "runtime": "gvisor", "cpu": "0.5", "memory_mb": "256",
                                    "timeout_s": "600", "secrets": ["API_KEY"]})  # fmt: skip
    assert r.status_code == 302, r.content[:300]
    assert Sandbox.objects.get(team=crew).secrets == ["API_KEY"]


def test_the_sandbox_page_links_its_previews(client, crew):
    from runtime.models import Sandbox

    sb = Sandbox.objects.create(team=crew, image="busybox", image_digest="x", status="running",
                                ports=[{"port": 8000, "public": False}, {"port": 3000, "public": True}])  # fmt: skip
    client.force_login(_member("mel", crew, "member"))
    page = client.get(f"/sandboxes/{sb.id}/").content.decode()
    assert f'href="http://8000-{sb.id}.localhost:8000/?hangar_token=' in page
    assert f'href="http://3000-{sb.id}.localhost:8000/"' in page and "(public)" in page


def test_the_create_form_sets_the_network_and_explains_a_bad_one(client, crew):
    from runtime.models import Image, Sandbox
    from runtime.services.nodes import node_register

    node = node_register(name="node-a", launchers=GVISOR, cpu=4, memory_mb=8192)
    Image.objects.create(name="busybox", digest="sha256:" + "a" * 64).nodes.add(node)
    client.force_login(_member("mel", crew, "member"))
    form = {"image": "busybox", "runtime": "gvisor", "cpu": "0.5", "memory_mb": "256", "timeout_s": "600"}
    r = client.post("/sandboxes/", {**form, "egress": "allowlist", "allow": ""})
    assert r.status_code == 422 and "needs at least one entry" in r.content.decode()
    r = client.post("/sandboxes/", {**form, "egress": "allowlist", "allow": "github.com, 10.20.0.0/16"})
    assert r.status_code == 302, r.content[:300]
    assert Sandbox.objects.get(team=crew).network == {
        "egress": "allowlist",
        "allow": ["github.com", "10.20.0.0/16"],
    }


def test_viewers_cannot_revoke_invitations_and_bad_numbers_are_messages(client, crew):
    from runtime.models import Invitation
    from runtime.services import auth as auth_svc

    issued = auth_svc.invitation_create(inviter_role="owner", user=None, team=crew, role="member")
    client.force_login(_member("vic", crew, "viewer"))
    r = client.post("/team/settings/", {"action": "invite_revoke", "invitation": str(issued.invitation.id)})
    assert r.status_code == 403 and Invitation.objects.get(id=issued.invitation.id).revoked_at is None
    client.force_login(_member("ada", crew, "admin"))
    for form in ({"action": "invite", "role": "member", "days": "inf"}, {"action": "token_revoke", "token": "x"},
                 {"action": "token_revoke", "token": "1\u00b9"},  # a digit to isdigit(), not to int()
                 {"action": "quotas", "sandboxes": "nan"}):  # fmt: skip
        r = client.post("/team/settings/", form)
        assert r.status_code == 422, (form, r.status_code)
