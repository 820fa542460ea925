"""The sandbox API end to end: HTTP to a real daphne server, a real Celery worker process,
real runsc sandboxes, real Postgres and Redis."""

from __future__ import annotations

import os
import time

import pytest

from runtime.node import launcher_for
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def create(api, **body):
    body.setdefault("image", "busybox")
    body.setdefault("memory_mb", 256)
    r = api.post("/sandboxes", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_create_exec_files_delete(api):
    sb = create(api, env={"FOO": "bar"}, metadata={"owner": "ci"})
    assert sb["status"] == "running", sb
    assert sb["node"] == "test-node" and sb["image"] == "busybox" and sb["runtime"] == "gvisor"
    assert sb["metadata"] == {"owner": "ci"}
    assert sb["started_at"] and sb["expires_at"]
    sid = sb["id"]

    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo $FOO; echo oops >&2; exit 4"})
    assert r.status_code == 200
    out = r.json()
    assert out["stdout"] == "bar\n" and out["stderr"] == "oops\n" and out["exit_code"] == 4
    assert out["timed_out"] is False and out["duration_ms"] > 0

    r = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": ["cat"], "stdin": "piped", "cwd": "/tmp", "env": {"A": "1"}}
    )
    assert r.json()["stdout"] == "piped"

    data = os.urandom(2 * 1024 * 1024)
    r = api.put(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"}, content=data)
    assert r.status_code == 200 and r.json()["size"] == len(data)
    r = api.get(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"})
    assert r.status_code == 200 and r.content == data
    r = api.get(f"/sandboxes/{sid}/files/list", params={"path": "/work"})
    assert [(e["name"], e["type"], e["size"]) for e in r.json()] == [("data.bin", "file", len(data))]

    assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
    stats = api.get(f"/sandboxes/{sid}/stats").json()
    assert stats["memory_limit_bytes"] == 256 * 1024 * 1024 and stats["cpu_seconds"] > 0
    # Its own disk, of the default size, holds what it wrote.
    assert sb["disk_mb"] == 10240 and 9 << 30 < stats["disk_limit_bytes"] <= 10 << 30
    assert stats["disk_bytes"] >= len(data)
    assert sid in [s["id"] for s in api.get("/sandboxes").json()]
    assert [s["id"] for s in api.get("/sandboxes", params={"status": "running"}).json()] == [sid]

    r = api.delete(f"/sandboxes/{sid}")
    assert r.status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "deleted", 30, what="deleted")
    assert sid not in launcher_for("gvisor").list()
    assert sid not in [s["id"] for s in api.get("/sandboxes").json()]
    kinds = [
        (e["status_from"], e["status_to"])
        for e in api.get(f"/sandboxes/{sid}/events").json()
        if e["kind"] == "status"
    ]
    assert ("pending", "starting") in kinds and ("starting", "running") in kinds
    assert ("running", "stopping") in kinds and ("stopping", "deleted") in kinds


def test_create_without_wait_returns_pending_then_runs(api):
    sb = create(api, wait=False)
    assert sb["status"] in ("pending", "starting", "running")
    wait_until(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "running", 30, what="running")


def test_exec_timeout(api):
    sid = create(api)["id"]
    start = time.monotonic()
    out = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sleep 30", "timeout_s": 1}).json()
    assert out["timed_out"] is True
    assert time.monotonic() - start < 10


def test_unknown_image_is_400_naming_the_images(api):
    r = api.post("/sandboxes", json={"image": "nope"})
    assert r.status_code == 400
    assert "nope" in r.json()["detail"] and "busybox" in r.json()["detail"]


@pytest.mark.parametrize(
    "body, word",
    [
        ({"memory_mb": 1}, "memory_mb"),
        ({"cpu": 1000}, "cpu"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"cpu": "x"}, "cpu"),
        ({"disk_mb": 10}, "disk_mb must be between 64 and"),
        ({"disk_mb": 10**9}, "disk_mb must be between 64 and"),
    ],
)
def test_bad_sizes_are_422_with_the_allowed_range(api, body, word):
    r = api.post("/sandboxes", json={"image": "busybox", **body})
    assert r.status_code == 422
    assert word in r.json()["detail"]


def test_other_teams_sandbox_is_404(api, other_api):
    sid = create(api)["id"]
    assert other_api.get(f"/sandboxes/{sid}").status_code == 404
    assert other_api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"}).status_code == 404
    assert other_api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 404
    assert other_api.put(f"/sandboxes/{sid}/files", params={"path": "/x"}, content=b"x").status_code == 404
    assert other_api.delete(f"/sandboxes/{sid}").status_code == 404
    assert sid not in [s["id"] for s in other_api.get("/sandboxes").json()]
    assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
    assert api.get("/sandboxes/sbdoesnotexist").status_code == 404


def test_exec_and_files_on_a_deleted_sandbox_are_409(api):
    sid = create(api)["id"]
    api.delete(f"/sandboxes/{sid}")
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true"})
    assert r.status_code == 409 and r.json()["status"] in ("stopping", "deleted")
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/etc/passwd"}).status_code == 409


def test_client_mistakes_are_4xx_never_500(api):
    sid = create(api)["id"]
    checks = [
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": ""}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": []}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["/no/such/bin"]}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "cwd": "relative"}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "timeout_s": -1}),
        api.post(f"/sandboxes/{sid}/exec", json={"cmd": "true", "env": {"1BAD": "x"}}),
        api.post(f"/sandboxes/{sid}/exec", content=b"not json", headers={"Content-Type": "application/json"}),
        api.get(f"/sandboxes/{sid}/files", params={"path": "relative"}),
        api.get(f"/sandboxes/{sid}/files"),
        api.get(f"/sandboxes/{sid}/files/list", params={"path": "/etc/passwd"}),
        api.get(f"/sandboxes/{sid}/files", params={"path": "/tmp"}),
        api.get("/sandboxes", params={"status": "bogus"}),
        api.get("/sandboxes", params={"limit": 0}),
        api.get("/sandboxes", params={"offset": -1}),
        api.post("/sandboxes", json={"image": "busybox", "env": {"A=B": "x"}}),
        api.post("/sandboxes", json={}),
    ]
    for r in checks:
        assert 400 <= r.status_code < 500, (r.request.url, r.status_code, r.text)
        assert r.json()["detail"]
    assert api.get(f"/sandboxes/{sid}/files", params={"path": "/missing"}).status_code == 404


def test_requests_without_a_valid_token_are_401(server, local_node):
    import httpx

    assert httpx.get(f"{server}/api/v1/sandboxes").status_code == 401
    r = httpx.get(f"{server}/api/v1/sandboxes", headers={"Authorization": "Bearer hgr_wrong"})
    assert r.status_code == 401 and "token" in r.json()["detail"]
    assert httpx.get(f"{server}/api/v1/health").status_code == 200
    assert httpx.get(f"{server}/api/v1/openapi.json").json()["info"]["title"] == "Hangar API"


def test_images_and_health(api):
    images = api.get("/images").json()
    assert [i["name"] for i in images] == ["busybox"]
    assert images[0]["nodes"] == ["test-node"] and images[0]["digest"].startswith("sha256:")
    health = api.get("/health").json()
    assert health["status"] == "ok" and health["nodes"][0]["name"] == "test-node"


def test_memory_limit_fails_the_sandbox_with_the_reason(api):
    sid = create(api, memory_mb=160)["id"]
    r = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": "head -c 700000000 /dev/zero | tail -c 600000000 | wc -c"}
    )
    assert r.status_code == 409
    assert "out of memory" in r.json()["detail"]
    sb = api.get(f"/sandboxes/{sid}").json()
    assert sb["status"] == "failed" and "out of memory" in sb["status_reason"]


def test_list_is_newest_first_and_pages(api):
    ids = [create(api, wait=False)["id"] for _ in range(3)]
    listed = [s["id"] for s in api.get("/sandboxes").json()]
    assert listed == ids[::-1]
    assert [s["id"] for s in api.get("/sandboxes", params={"limit": 2}).json()] == ids[::-1][:2]
    assert [s["id"] for s in api.get("/sandboxes", params={"limit": 2, "offset": 2}).json()] == ids[:1]


def test_api_answers_keep_security_headers_set_no_cookie_and_record_the_tokens_user(api):
    """/api/ has a middleware stack of its own (dashboard/asgi.py) and checks tokens on the
    blocking pool: the headers stay, and what a request does is still put down to the token's
    user (the actor set on that thread reaches the view)."""
    from runtime.models import AuditEvent

    r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256, "wait": False})
    assert r.status_code == 201, r.text
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    assert "set-cookie" not in r.headers
    created = AuditEvent.objects.get(action="sandbox.create", target=r.json()["id"])
    assert (created.actor, created.via, created.team_name) == ("alice", "api", "alpha")
    assert api.get("/sandboxes/sbnosuchthing").status_code == 404


def test_static_files_are_served_by_the_app(server):
    import httpx

    r = httpx.get(f"{server}/static/vendor/htmx/htmx.min.js")
    assert r.status_code == 200 and b"htmx" in r.content
    assert httpx.get(f"{server}/static/hangar/hangar.css").status_code == 200
