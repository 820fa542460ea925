"""Quotas and secrets with sandboxes that really run: concurrent creates against the last
units of a quota, resume checked like a create, secrets in a sandbox's environment, and the
usage a real sandbox accrues."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from runtime.models import Team, UsageHour
from tests.api.test_sandboxes_api import create
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def _team_id(api) -> int:
    return api.get("/teams").json()[0]["id"]


def test_many_concurrent_creates_against_a_quota_of_three_end_with_exactly_three_running(api, server):
    import httpx

    team_id = _team_id(api)
    assert api.put(f"/teams/{team_id}/quotas", json={"sandboxes": 3}).status_code == 200
    assert api.post("/secrets", json={"name": "TOKEN", "value": "s3cr3t-value"}).status_code == 201
    headers = dict(api.headers)

    def one(_: int) -> httpx.Response:
        with httpx.Client(base_url=str(api.base_url), headers=headers, timeout=120) as c:
            return c.post("/sandboxes", json={"image": "busybox", "cpu": 0.25, "memory_mb": 128,
                                              "secrets": ["TOKEN"]})  # fmt: skip

    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] * 3 + [429] * 5, [r.text[:200] for r in answers]
    for r in answers:
        if r.status_code == 429:
            assert r.json()["quota"] == "sandboxes" and r.json()["limit"] == 3, r.text
    made = [r.json() for r in answers if r.status_code == 201]
    assert all(sb["status"] == "running" for sb in made), made
    listed = api.get("/sandboxes").json()
    assert sorted(sb["id"] for sb in listed if sb["status"] == "running") == sorted(sb["id"] for sb in made)
    # The secret is in each sandbox's environment, and only its name in what the API shows.
    out = api.post(f"/sandboxes/{made[0]['id']}/exec", json={"cmd": "echo $TOKEN"}).json()
    assert out["stdout"] == "s3cr3t-value\n", out
    assert made[0]["secrets"] == ["TOKEN"] and "s3cr3t-value" not in str(made)
    events = api.get(f"/sandboxes/{made[0]['id']}/events").json()
    assert "s3cr3t-value" not in str(events)


def test_resume_is_checked_against_the_quota_and_usage_accrues_from_real_sandboxes(api):
    team_id = _team_id(api)
    api.put(f"/teams/{team_id}/quotas", json={"sandboxes": 1})
    first = create(api, cpu=0.5, memory_mb=128)
    r = api.post(f"/sandboxes/{first['id']}/pause", json={"mode": "stop"})
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    second = create(api, cpu=0.5, memory_mb=128)  # the paused one holds nothing: room for this
    r = api.post(f"/sandboxes/{first['id']}/resume", json={})
    assert r.status_code == 429 and r.json()["quota"] == "sandboxes" and r.json()["used"] == 1, r.text
    assert api.get(f"/sandboxes/{first['id']}").json()["status"] == "paused"
    assert api.delete(f"/sandboxes/{second['id']}").status_code == 204
    r = api.post(f"/sandboxes/{first['id']}/resume", json={})
    assert r.status_code == 200 and r.json()["status"] == "running", r.text
    assert api.delete(f"/sandboxes/{first['id']}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{first['id']}").json()["status"] == "deleted", timeout=60)
    # Both held 0.5 vCPU from start to stop: the team's hours say so, and two starts (and a restart).
    team = Team.objects.get(id=team_id)
    used = sum(u.vcpu_seconds for u in UsageHour.objects.filter(team=team))
    assert used > 0.5 * 1.0, used
    assert sum(u.sandboxes for u in UsageHour.objects.filter(team=team)) == 2
    usage = api.get(f"/teams/{team_id}/usage").json()
    assert usage["totals"]["vcpu_seconds"] == used and usage["totals"]["sandboxes"] == 2
