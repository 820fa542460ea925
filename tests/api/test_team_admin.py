"""What admins manage: quotas (limits under the site's ceilings, clear refusals), secrets
(write-only, encrypted at rest), usage metering and budgets, the audit log and invitations.
These run against the API and the services on the test database; sandboxes that really run
are in tests/runtime/test_quotas_live.py."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.fernet import Fernet
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import DatabaseError, connection, transaction
from django.test import Client
from django.utils import timezone

from runtime.lifecycle import transition
from runtime.models import AuditEvent, Image, Membership, Sandbox, Secret, Team, UsageHour
from runtime.services import auth as auth_svc
from runtime.services import secrets as secret_svc
from runtime.services import usage as usage_svc
from tests.support import wait_until


def call(method: str, path: str, raw: str, body: dict | None = None):
    r = Client().generic(method, f"/api/v1{path}", data=json.dumps(body or {}), content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {raw}")  # fmt: skip
    ctype = r.get("Content-Type", "")
    content = b"".join(r) if r.streaming else r.content
    return r.status_code, (json.loads(content) if content and "json" in ctype else content.decode())


@pytest.fixture
def team(transactional_db):
    User = get_user_model()
    team = Team.objects.create(name="crew")
    for role in ("viewer", "member", "admin", "owner"):
        u = User.objects.create_user(username=f"c-{role}", password="pw-pw-pw-pw")
        Membership.objects.create(user=u, team=team, role=role)
    User.objects.create_user(username="c-staff", password="x", is_staff=True)
    Membership.objects.create(user=User.objects.get(username="c-staff"), team=team, role="owner")
    Image.objects.create(name="busybox", digest="sha256:" + "0" * 64)
    return team


def raw(team: Team, username: str) -> str:
    user = get_user_model().objects.get(username=username)
    return auth_svc.token_create(user=user, team=team).raw


def running(
    team: Team, n: int, cpu: float = 1.0, memory_mb: int = 512, status: str = "running"
) -> list[Sandbox]:
    return [Sandbox.objects.create(team=team, image="busybox", image_digest="x", cpu=cpu, memory_mb=memory_mb,
                                   status=status) for _ in range(n)]  # fmt: skip


# -- quotas -----------------------------------------------------------------------------------


def test_a_create_over_a_quota_is_refused_naming_the_quota_its_use_and_its_limit(team):
    admin, member = raw(team, "c-admin"), raw(team, "c-member")
    status, body = call(
        "PUT", f"/teams/{team.id}/quotas", admin, {"sandboxes": 2, "vcpu": 3, "memory_mb": 2048}
    )
    assert status == 200, body
    assert body["sandboxes"]["limit"] == 2 and body["vcpu"]["limit"] == 3
    running(team, 2)
    status, body = call("POST", "/sandboxes", member, {"image": "busybox", "wait": False})
    assert status == 429, body
    assert body["quota"] == "sandboxes" and body["used"] == 2 and body["limit"] == 2
    assert "concurrent sandboxes" in body["detail"] and "2 in use" in body["detail"]
    # Paused and stopped sandboxes hold no CPU or memory: they do not count.
    Sandbox.objects.filter(team=team).update(status="paused")
    status, body = call("POST", "/sandboxes", member, {"image": "busybox", "cpu": 4, "wait": False})
    assert status == 429 and body["quota"] == "vcpu" and body["limit"] == 3 and body["requested"] == 4, body
    status, body = call("POST", "/sandboxes", member, {"image": "busybox", "memory_mb": 4096, "wait": False})
    assert status == 429 and body["quota"] == "memory_mb" and body["used"] == 0, body
    got = call("GET", f"/teams/{team.id}/quotas", member)[1]
    assert got["sandboxes"]["used"] == 0 and got["sandboxes"]["ceiling"] == settings.HANGAR_QUOTA_SANDBOXES


def test_the_lifetime_quota_bounds_timeout_at_create_and_keepalive(team):
    admin = raw(team, "c-admin")
    call("PUT", f"/teams/{team.id}/quotas", admin, {"lifetime_s": 600})
    status, body = call("POST", "/sandboxes", admin, {"image": "busybox", "timeout_s": 601, "wait": False})
    assert status == 429 and body["quota"] == "lifetime_s" and body["limit"] == 600, body
    (sb,) = running(team, 1)
    status, body = call("POST", f"/sandboxes/{sb.id}/keepalive", admin, {"timeout_s": 3600})
    assert status == 429 and body["quota"] == "lifetime_s", body


def test_quota_budget_and_rate_values_must_be_finite(team):
    admin, staff = raw(team, "c-admin"), raw(team, "c-staff")
    for body in ('{"sandboxes": Infinity}', '{"vcpu": NaN}'):
        r = Client().put(f"/api/v1/teams/{team.id}/quotas", data=body, content_type="application/json",
                         HTTP_AUTHORIZATION=f"Bearer {admin}")  # fmt: skip
        assert r.status_code == 422, r.content
    r = Client().put(f"/api/v1/teams/{team.id}/budget", data='{"amount": NaN, "enforced": true}',
                     content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {admin}")  # fmt: skip
    assert r.status_code == 422, r.content
    r = Client().put(f"/api/v1/teams/{team.id}/rates", data='{"vcpu_hour": Infinity}',
                     content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {staff}")  # fmt: skip
    assert r.status_code == 422, r.content


def test_admins_set_limits_up_to_the_ceiling_and_only_site_administrators_raise_it(team):
    admin, staff, member = raw(team, "c-admin"), raw(team, "c-staff"), raw(team, "c-member")
    ceiling = settings.HANGAR_QUOTA_SANDBOXES
    status, body = call("PUT", f"/teams/{team.id}/quotas", admin, {"sandboxes": ceiling + 1})
    assert status == 403 and body["ceiling"] == ceiling and "site administrator" in body["detail"], body
    assert call("PUT", f"/teams/{team.id}/quotas", member, {"sandboxes": 1})[0] == 403
    status, body = call("PUT", f"/teams/{team.id}/quotas", admin, {"sandboxes": 1.5})
    assert status == 422 and "whole number" in body["detail"], body
    assert call("PUT", f"/teams/{team.id}/quotas", admin, {"nope": 1})[0] == 422
    assert call("PUT", f"/teams/{team.id}/quotas", admin, {"vcpu": -1})[0] == 422
    # A site administrator raises the ceiling; then the team's admins may use it.
    status, body = call("PUT", f"/teams/{team.id}/quotas/ceilings", staff, {"sandboxes": ceiling + 10})
    assert status == 200 and body["sandboxes"]["ceiling"] == ceiling + 10, body
    assert call("PUT", f"/teams/{team.id}/quotas/ceilings", admin, {"sandboxes": 1})[0] == 403
    status, body = call("PUT", f"/teams/{team.id}/quotas", admin, {"sandboxes": ceiling + 5})
    assert status == 200 and body["sandboxes"]["limit"] == ceiling + 5
    # Lowering the ceiling lowers what is enforced, whatever the team set.
    call("PUT", f"/teams/{team.id}/quotas/ceilings", staff, {"sandboxes": 3})
    assert call("GET", f"/teams/{team.id}/quotas", member)[1]["sandboxes"]["limit"] == 3
    # null: back to the ceiling; the site's defaults are the staff's to change.
    call("PUT", f"/teams/{team.id}/quotas", admin, {"sandboxes": None})
    status, body = call("PUT", "/site/quotas", staff, {"vcpu": 7})
    assert status == 200 and body["vcpu"] == 7
    assert call("GET", f"/teams/{team.id}/quotas", member)[1]["vcpu"]["ceiling"] == 7
    assert call("PUT", "/site/quotas", admin, {"vcpu": 100})[0] == 403


def test_the_storage_quota_is_checked_when_a_volume_is_created(team):
    from runtime.models import Node

    Node.objects.create(name=settings.HANGAR_NODE_NAME)
    admin = raw(team, "c-admin")
    call("PUT", f"/teams/{team.id}/quotas", admin, {"storage_mb": 100})
    status, body = call("POST", "/volumes", admin, {"name": "big", "size_mb": 200})
    assert status == 429 and body["quota"] == "storage_mb" and body["limit"] == 100, body


def test_the_disk_quota_counts_sandboxes_disks_paused_ones_included(team):
    from runtime.models import Image, Sandbox

    image, _ = Image.objects.get_or_create(name="busybox", defaults={"digest": "sha256:" + "d" * 64})
    admin = raw(team, "c-admin")
    Sandbox.objects.create(team=team, image="busybox", image_digest=image.digest, disk_mb=4096,
                           status=Sandbox.Status.PAUSED)  # fmt: skip
    call("PUT", f"/teams/{team.id}/quotas", admin, {"disk_mb": 6000})
    status, body = call("POST", "/sandboxes", admin, {"image": "busybox", "disk_mb": 2048})
    assert status == 429 and body["quota"] == "disk_mb" and body["used"] == 4096, body
    assert "sandbox disks quota: 4096 MB in use, 2048 MB more asked for, limit 6000 MB" in body["detail"]
    assert call("GET", f"/teams/{team.id}/quotas", admin)[1]["disk_mb"]["used"] == 4096


# -- secrets ----------------------------------------------------------------------------------


def test_secrets_are_write_only_and_admins_manage_them(team):
    admin, member, viewer = raw(team, "c-admin"), raw(team, "c-member"), raw(team, "c-viewer")
    value = "sk-live-" + "q" * 40
    status, body = call("POST", "/secrets", admin, {"name": "OPENAI_API_KEY", "value": value})
    assert status == 201 and body["name"] == "OPENAI_API_KEY" and value not in json.dumps(body), body
    assert call("POST", "/secrets", admin, {"name": "OPENAI_API_KEY", "value": "x"})[0] == 409
    assert call("POST", "/secrets", member, {"name": "MINE", "value": "x"})[0] == 403
    assert call("POST", "/secrets", admin, {"name": "1BAD", "value": "x"})[0] == 422
    assert call("POST", "/secrets", admin, {"name": "EMPTY", "value": ""})[0] == 422
    status, listed = call("GET", "/secrets", viewer)
    assert status == 200 and [s["name"] for s in listed] == ["OPENAI_API_KEY"]
    assert value not in json.dumps(listed)
    assert call("PUT", "/secrets/OPENAI_API_KEY", admin, {"value": "sk-new"})[0] == 200
    assert secret_svc.decrypt(Secret.objects.get(name="OPENAI_API_KEY").ciphertext) == "sk-new"
    # Nothing in the audit log carries a value.
    events = AuditEvent.objects.filter(action__startswith="secret.")
    assert {e.action for e in events} == {"secret.create", "secret.replace"}
    assert all(
        value not in json.dumps(e.data) + e.message and "sk-new" not in json.dumps(e.data) for e in events
    )
    assert call("DELETE", "/secrets/OPENAI_API_KEY", admin)[0] == 204
    assert call("DELETE", "/secrets/OPENAI_API_KEY", admin)[0] == 404


def test_a_sandbox_asks_for_secrets_by_name_and_only_the_names_are_kept(team):
    admin = raw(team, "c-admin")
    call("POST", "/secrets", admin, {"name": "TOKEN", "value": "t0p-s3cret"})
    status, body = call("POST", "/sandboxes", admin, {"image": "busybox", "secrets": ["NOPE"], "wait": False})
    assert status == 422 and "NOPE" in body["detail"], body
    status, body = call("POST", "/sandboxes", admin,
                        {"image": "busybox", "secrets": ["TOKEN"], "env": {"TOKEN": "x"}, "wait": False})  # fmt: skip
    assert status == 422 and "both in env and in secrets" in body["detail"], body
    sb = running(team, 1)[0]
    Sandbox.objects.filter(id=sb.id).update(secrets=["TOKEN"])
    sb.refresh_from_db()
    assert secret_svc.env_for(sb) == {"TOKEN": "t0p-s3cret"}
    status, body = call("GET", f"/sandboxes/{sb.id}", admin)
    assert body["secrets"] == ["TOKEN"] and "t0p-s3cret" not in json.dumps(body)


def test_secrets_at_rest_are_not_readable_in_a_database_dump(team):
    value = "dump-me-if-you-can-" + "z" * 24
    secret_svc.secret_create(team=team, name="DB_PASSWORD", value=value)
    db = connection.settings_dict
    dump = subprocess.run(
        ["pg_dump", "--data-only", "-h", db["HOST"] or "127.0.0.1", "-p", str(db["PORT"] or 5432), "-U",
         db["USER"] or "postgres", db["NAME"]], capture_output=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert b"DB_PASSWORD" in dump  # the dump is of this database, with the secret's row in it
    assert value.encode() not in dump
    # The stored bytes are a Fernet token that the configured key opens.
    assert secret_svc.decrypt(Secret.objects.get(name="DB_PASSWORD").ciphertext) == value


def test_key_rotation_re_encrypts_every_secret_under_the_new_key(team, settings):
    secret_svc.secret_create(team=team, name="A", value="alpha")
    old_token = bytes(Secret.objects.get(name="A").ciphertext)
    # The test settings configure no keys: the key in use is the one generated in the data dir.
    assert not settings.HANGAR_SECRETS_KEYS
    old_key = (settings.DATA_DIR / "secrets_key").read_text().strip()
    new_key = Fernet.generate_key().decode()
    settings.HANGAR_SECRETS_KEYS = [new_key, old_key]
    secret_svc._fernet.cache_clear()
    try:
        assert secret_svc.secrets_rotate() == 1
        rotated = bytes(Secret.objects.get(name="A").ciphertext)
        assert rotated != old_token
        assert Fernet(new_key.encode()).decrypt(rotated) == b"alpha"  # the new key alone opens it
    finally:
        secret_svc._fernet.cache_clear()


# -- usage and budgets ------------------------------------------------------------------------


def test_usage_accrues_per_hour_at_each_change_of_state_and_on_the_meter(team):
    sb = Sandbox.objects.create(team=team, image="busybox", image_digest="x", cpu=2, memory_mb=1024)
    assert transition(sb.id, to="starting")
    t0 = datetime(2026, 11, 30, 10, 30, tzinfo=UTC)
    Sandbox.objects.filter(id=sb.id).update(metered_at=t0)
    # The meter counts it up to "now" (11:15): split between the 10:00 and 11:00 hours.
    usage_svc.meter(now=datetime(2026, 11, 30, 11, 15, tzinfo=UTC))
    hours = {u.hour.hour: u for u in UsageHour.objects.filter(team=team, hour__day=30)}
    assert hours[10].vcpu_seconds == pytest.approx(2 * 1800) and hours[11].vcpu_seconds == pytest.approx(
        2 * 900
    )
    assert hours[10].memory_gb_seconds == pytest.approx(1 * 1800)
    # A sandbox that stops holding CPU counts its last slice at that change.
    Sandbox.objects.filter(id=sb.id).update(metered_at=timezone.now() - timedelta(seconds=60))
    assert transition(sb.id, to="running") and transition(sb.id, to="pausing")
    assert Sandbox.objects.get(id=sb.id).metered_at is not None  # pausing: it still holds them
    assert transition(sb.id, to="paused")
    assert Sandbox.objects.get(id=sb.id).metered_at is None
    total = sum(u.vcpu_seconds for u in UsageHour.objects.filter(team=team))
    assert total == pytest.approx(2 * 2700 + 2 * 60, abs=2)
    assert sum(u.sandboxes for u in UsageHour.objects.filter(team=team)) == 1  # one start counted
    # Paused: nothing more accrues.
    usage_svc.meter()
    assert sum(u.vcpu_seconds for u in UsageHour.objects.filter(team=team)) == pytest.approx(total)


def test_a_sandboxs_own_disk_accrues_storage_while_its_node_holds_it(team):
    """From its start to its deletion, paused in stop mode included (its disk is kept); an
    ephemeral sandbox's pause lets its disk go, and a sandbox without a disk of its own (made
    before disks, or on a node configured without) accrues none."""

    def storage() -> float:
        return sum(u.storage_gb_hours for u in UsageHour.objects.filter(team=team))

    sb = Sandbox.objects.create(team=team, image="busybox", image_digest="x", disk_mb=2048)
    assert transition(sb.id, to="starting")
    t0 = datetime(2026, 11, 30, 10, 30, tzinfo=UTC)
    Sandbox.objects.filter(id=sb.id).update(metered_at=t0, disk_metered_at=t0)
    usage_svc.meter(now=datetime(2026, 11, 30, 11, 15, tzinfo=UTC))
    hours = {u.hour.hour: u for u in UsageHour.objects.filter(team=team, hour__day=30)}
    assert hours[10].storage_gb_hours == pytest.approx(2 * 0.5) and hours[
        11
    ].storage_gb_hours == pytest.approx(2 * 0.25)
    # Paused in stop mode: no CPU or memory, but its disk (and the files on it) are kept.
    assert (
        transition(sb.id, to="running") and transition(sb.id, to="pausing") and transition(sb.id, to="paused")
    )
    row = Sandbox.objects.get(id=sb.id)
    assert row.metered_at is None and row.disk_metered_at is not None
    Sandbox.objects.filter(id=sb.id).update(disk_metered_at=timezone.now() - timedelta(hours=1))
    before = storage()
    usage_svc.meter()
    assert storage() == pytest.approx(before + 2 * 1, abs=0.01)
    # Deleted: the last slice is counted at the change, and nothing after it.
    Sandbox.objects.filter(id=sb.id).update(disk_metered_at=timezone.now() - timedelta(minutes=30))
    before = storage()
    assert transition(sb.id, to="stopping") and transition(sb.id, to="deleted")
    assert Sandbox.objects.get(id=sb.id).disk_metered_at is None
    assert storage() == pytest.approx(before + 2 * 0.5, abs=0.01)
    usage_svc.meter()
    assert storage() == pytest.approx(before + 2 * 0.5, abs=0.01)
    # Ephemeral: counted while running, not while paused (the pause removed its disk).
    eph = Sandbox.objects.create(team=team, image="busybox", image_digest="x", disk_mb=4096, ephemeral=True)
    assert transition(eph.id, to="starting") and transition(eph.id, to="running")
    assert transition(eph.id, to="pausing") and transition(eph.id, to="paused")
    assert Sandbox.objects.get(id=eph.id).disk_metered_at is None
    before = storage()
    usage_svc.meter()
    assert storage() == pytest.approx(before, abs=0.01)
    assert transition(eph.id, to="resuming")
    assert Sandbox.objects.get(id=eph.id).disk_metered_at is not None
    # No disk of its own: nothing, and the meter does not start counting it either.
    none = Sandbox.objects.create(team=team, image="busybox", image_digest="x", disk_mb=0)
    assert transition(none.id, to="starting") and transition(none.id, to="running")
    usage_svc.meter()
    assert Sandbox.objects.get(id=none.id).disk_metered_at is None


def test_usage_api_reports_hours_cost_and_csv_and_the_budget_blocks_at_100_percent(team, settings):
    admin, member, staff = raw(team, "c-admin"), raw(team, "c-member"), raw(team, "c-staff")
    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    UsageHour.objects.create(team=team, hour=hour, vcpu_seconds=36000, memory_gb_seconds=7200, sandboxes=3)
    status, body = call("PUT", f"/teams/{team.id}/rates", staff, {"vcpu_hour": 0.5, "memory_gb_hour": 0.25})
    assert status == 200 and body["vcpu_hour"] == 0.5, body
    assert call("PUT", f"/teams/{team.id}/rates", admin, {"vcpu_hour": 0})[0] == 403
    status, body = call("GET", f"/teams/{team.id}/usage", admin)
    assert status == 200, body
    assert body["totals"]["vcpu_seconds"] == 36000 and body["totals"]["sandboxes"] == 3
    assert body["totals"]["cost"] == pytest.approx(10 * 0.5 + 2 * 0.25)
    assert call("GET", f"/teams/{team.id}/usage", member)[0] == 403
    assert call("GET", f"/teams/{team.id}/usage?from=2026-13-01", admin)[0] == 422
    assert call("GET", f"/teams/{team.id}/usage?from=2026-12-02&to=2026-12-01", admin)[0] == 422
    status, text = call("GET", f"/teams/{team.id}/usage?format=csv", admin)
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0][0] == "hour_utc" and rows[-1][0] == "total" and float(rows[-1][1]) == 36000
    # Budget 6.0 spent 5.5 (91%): a warning, once; sandboxes still start until 100%.
    status, body = call("PUT", f"/teams/{team.id}/budget", admin, {"amount": 6.0, "enforced": True})
    assert status == 200 and body["state"] == "warning" and body["percent"] == pytest.approx(91.7, abs=0.1), (
        body
    )
    assert usage_svc.budgets_warn(now) == ["crew"] and usage_svc.budgets_warn(now) == []
    assert AuditEvent.objects.filter(action="budget.warning", team_id_ref=team.id).count() == 1
    # (A quota of no sandboxes: a create that gets past the budget is refused by that instead.)
    call("PUT", f"/teams/{team.id}/quotas", admin, {"sandboxes": 0})
    assert call("POST", "/sandboxes", member, {"image": "busybox", "wait": False})[1]["quota"] == "sandboxes"
    UsageHour.objects.filter(team=team).update(vcpu_seconds=72000)
    status, body = call("POST", "/sandboxes", member, {"image": "busybox", "wait": False})
    assert status == 429 and body["quota"] == "budget" and "budget" in body["detail"], body
    # Not enforced: usage is reported, nothing is refused for it.
    call("PUT", f"/teams/{team.id}/budget", admin, {"amount": 6.0, "enforced": False})
    status, body = call("POST", "/sandboxes", member, {"image": "busybox", "wait": False})
    assert status == 429 and body["quota"] == "sandboxes", body


# -- audit ------------------------------------------------------------------------------------


def test_changes_and_refusals_are_audited_with_actor_and_token_and_the_log_is_append_only(team):
    admin, member = raw(team, "c-admin"), raw(team, "c-member")
    admin_prefix = admin[:12]
    assert (
        call("POST", f"/teams/{team.id}/members", admin, {"username": "c-staff", "role": "member"})[0] == 409
    )
    get_user_model().objects.create_user(username="newbie", password="x")
    assert (
        call("POST", f"/teams/{team.id}/members", admin, {"username": "newbie", "role": "viewer"})[0] == 201
    )
    assert call("PATCH", f"/teams/{team.id}/members/newbie", admin, {"role": "member"})[0] == 200
    assert call("POST", "/secrets", member, {"name": "X", "value": "y"})[0] == 403  # refused: recorded
    added = AuditEvent.objects.get(action="member.add")
    assert (added.actor, added.via, added.token, added.target, added.team_name) == (
        "c-admin", "api", admin_prefix, "newbie", "crew")  # fmt: skip
    assert AuditEvent.objects.get(action="member.role").data == {"role_from": "viewer", "role": "member"}
    # Written off the event loop, without holding up the answer: it lands a moment later.
    # (An earlier test's refusal may land late, its team long gone: this one is looked up by what it is.)
    mine = AuditEvent.objects.filter(outcome="refused", actor="c-member", team_id_ref=team.id)
    wait_until(mine.exists, 10, what="the refusal's audit record")
    refused = mine.get()
    assert refused.target == "POST /api/v1/secrets" and "needs admin" in refused.message
    # Admins read it through the API, filtered; members may not.
    status, events = call("GET", "/audit?action=member.", admin)
    assert status == 200 and [e["action"] for e in events] == ["member.role", "member.add"], events
    assert call("GET", "/audit?outcome=refused", admin)[1][0]["actor"] == "c-member"
    assert call("GET", "/audit", member)[0] == 403
    status, text = call("GET", "/audit?format=csv", admin)
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0][:3] == ["id", "created_at", "team_name"] and len(rows) - 1 == AuditEvent.objects.filter(
        team_id_ref=team.id).count()  # fmt: skip
    # The database refuses to change or remove a record.
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(id=added.id).update(message="edited")
    with pytest.raises(DatabaseError, match="append-only"), transaction.atomic():
        AuditEvent.objects.filter(id=added.id).delete()


def test_the_audit_csv_cannot_smuggle_spreadsheet_formulas(team):
    from runtime.services import audit

    audit.record("volume.create", team=team, target='=HYPERLINK("http://x")')
    admin = raw(team, "c-admin")
    text = call("GET", "/audit?format=csv&action=volume.", admin)[1]
    assert "'=HYPERLINK" in text


def test_an_audit_export_longer_than_a_page_comes_whole_in_order(team):
    from runtime.services import audit

    AuditEvent.objects.bulk_create(
        [AuditEvent(team_id_ref=team.id, team_name=team.name, via="system", action="volume.create", target=f"v{i}")
         for i in range(int(audit.CSV_PAGE * 2.5))]
    )  # fmt: skip
    admin = raw(team, "c-admin")
    rows = list(csv.reader(io.StringIO(call("GET", "/audit?format=csv&action=volume.", admin)[1])))
    ids = [int(r[0]) for r in rows[1:]]
    assert (
        len(ids) == int(audit.CSV_PAGE * 2.5)
        and ids == sorted(ids, reverse=True)
        and len(set(ids)) == len(ids)
    )


# -- invitations ------------------------------------------------------------------------------


def test_an_invitation_link_adds_whoever_accepts_it_once(team):
    admin, member = raw(team, "c-admin"), raw(team, "c-member")
    assert call("POST", f"/teams/{team.id}/invitations", member, {"role": "member"})[0] == 403
    assert call("POST", f"/teams/{team.id}/invitations", admin, {"role": "owner"})[0] == 403  # owners only
    status, inv = call("POST", f"/teams/{team.id}/invitations", admin, {"role": "admin"})
    assert status == 201 and "/invite/inv_" in inv["url"], inv
    path = inv["url"].split("testserver", 1)[1]
    assert [i["id"] for i in call("GET", f"/teams/{team.id}/invitations", admin)[1]] == [inv["id"]]
    # Someone new opens it, makes an account and is in the team at once.
    browser = Client()
    page = browser.get(path)
    assert page.status_code == 200 and b"Join team crew" in page.content
    r = browser.post(path, {"username": "invitee", "password": "longenough", "password2": "longenough"})
    assert r.status_code == 302, r.content[:400]
    m = Membership.objects.get(user__username="invitee", team=team)
    assert m.role == "admin"
    # Used up: a second person cannot use it.
    other = Client()
    assert other.get(path).status_code == 404
    r = other.post(path, {"username": "second", "password": "longenough", "password2": "longenough"})
    assert r.status_code == 404 and not get_user_model().objects.filter(username="second").exists()
    # A revoked one, and an expired one, say so.
    _, inv2 = call("POST", f"/teams/{team.id}/invitations", admin, {"role": "viewer"})
    assert call("DELETE", f"/teams/{team.id}/invitations/{inv2['id']}", admin)[0] == 204
    assert b"revoked" in Client().get(inv2["url"].split("testserver", 1)[1]).content
    issued = auth_svc.invitation_create(inviter_role="owner", user=None, team=team, role="member")
    issued.invitation.expires_at = timezone.now() - timedelta(seconds=1)
    issued.invitation.save()
    assert b"expired" in Client().get(f"/invite/{issued.raw}/").content
    # An existing user signs in and accepts.
    _, inv3 = call("POST", f"/teams/{team.id}/invitations", admin, {"role": "viewer"})
    user = get_user_model().objects.create_user(username="elsewhere", password="pw")
    c = Client()
    c.force_login(user)
    assert c.post(inv3["url"].split("testserver", 1)[1]).status_code == 302
    assert Membership.objects.get(user=user, team=team).role == "viewer"
    assert {e.action for e in AuditEvent.objects.filter(action__startswith="invitation.")} == {
        "invitation.create", "invitation.revoke", "invitation.accept"}  # fmt: skip


@pytest.mark.parametrize("fmt", ["json", "csv"])
def test_an_audit_filter_with_a_nul_is_a_422_not_a_cut_export(team, fmt):
    admin = raw(team, "c-admin")
    status, body = call("GET", f"/audit?format={fmt}&target=a%00b", admin)
    assert status == 422 and body["detail"] == "target cannot hold a NUL character", body
