"""Image builds and pulls as jobs: started by staff through the API or the images page, run
by the node's real worker, followed live."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model

from dashboard.asgi import application
from runtime.models import ImageJob, Membership, Team
from runtime.services.auth import token_create
from tests.support import refused_with, requires_runsc, wait_until


@pytest.fixture
def staff_api(server, celery_worker, local_node, team_token):
    user = get_user_model().objects.create_user(username="root-admin", password="pw", is_staff=True)
    team = Team.objects.get(name="alpha")
    Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)
    token = token_create(user=user, team=team).raw
    with httpx.Client(
        base_url=f"{server}/api/v1", headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as client:
        yield client


@requires_runsc
def test_a_build_runs_on_the_node_and_reports_its_progress(staff_api):
    r = staff_api.post("/images/build", json={"kind": "busybox"})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "queued" and job["node"] == settings.HANGAR_NODE_NAME

    def done() -> bool:
        nonlocal job
        job = staff_api.get(f"/images/jobs/{job['id']}").json()
        return job["status"] in ("succeeded", "failed")

    wait_until(done, 120, what="the build")
    assert job["status"] == "succeeded", job
    assert "building busybox" in job["log"]
    assert job["image"] == "busybox" and job["finished_at"] >= job["started_at"]
    names = {i["name"]: i for i in staff_api.get("/images").json()}
    assert settings.HANGAR_NODE_NAME in names["busybox"]["nodes"]
    assert staff_api.get("/images/jobs").json()[0]["id"] == job["id"]


def test_only_staff_start_jobs_and_bad_input_is_explained(api, staff_api):
    r = api.post("/images/build", json={"kind": "busybox"})  # alice: a team owner, not staff
    assert r.status_code == 403 and "administrators" in r.json()["detail"]
    assert api.post("/images/pull", json={"ref": "example.com/app:1"}).status_code == 403

    assert staff_api.post("/images/build", json={"kind": "windows"}).status_code == 422
    r = staff_api.post("/images/pull", json={"ref": "has space:1"})
    assert r.status_code == 422 and "invalid image reference" in r.json()["detail"]
    r = staff_api.post("/images/pull", json={"ref": "Example.com/App:1"})
    assert r.status_code == 422 and "give it a name" in r.json()["detail"]
    r = staff_api.post("/images/pull", json={"ref": "example.com/app:1", "name": "Bad Name"})
    assert r.status_code == 422 and "invalid image name" in r.json()["detail"]
    r = staff_api.post("/images/pull", json={"ref": "example.com/app:1", "node": "nowhere"})
    assert r.status_code == 404
    assert staff_api.get("/images/jobs/999999").status_code == 404
    assert not ImageJob.objects.exists()


def test_a_failed_pull_says_why(staff_api):
    # A registry on a closed local port: skopeo fails, and the job carries its message.
    r = staff_api.post(
        "/images/pull", json={"ref": "127.0.0.1:9/nothing:1", "name": "nothing", "insecure": True}
    )
    assert r.status_code == 202
    job_id = r.json()["id"]
    wait_until(
        lambda: staff_api.get(f"/images/jobs/{job_id}").json()["status"] == "failed", 120, what="the pull"
    )
    job = staff_api.get(f"/images/jobs/{job_id}").json()
    assert "127.0.0.1:9" in job["error"] and "skopeo" in job["log"]


def test_the_job_page_socket_sends_the_outcome_and_closes(staff_api, client):
    job_id = staff_api.post("/images/build", json={"kind": "busybox"}).json()["id"]
    wait_until(
        lambda: staff_api.get(f"/images/jobs/{job_id}").json()["status"] in ("succeeded", "failed"), 120,
        what="the build",
    )  # fmt: skip
    client.force_login(get_user_model().objects.get(username="alice"))
    headers = [
        (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
        (b"origin", b"http://testserver"),
        (b"host", b"testserver"),
    ]

    async def main() -> tuple[str, dict]:
        comm = WebsocketCommunicator(application, f"/ws/ui/images/jobs/{job_id}", headers=headers)
        assert (await comm.connect())[0]
        html = await comm.receive_from(10)
        closed = await comm.receive_output(10)
        return html, closed

    html, closed = asyncio.run(main())
    assert 'id="job-view"' in html and 'data-status="succeeded"' in html and "building busybox" in html
    assert closed["type"] == "websocket.close" and closed.get("code") == 1000


def test_the_images_page_socket_pushes_jobs_as_they_move(staff_api, client):
    client.force_login(get_user_model().objects.get(username="alice"))
    headers = [
        (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode()),
        (b"origin", b"http://testserver"),
        (b"host", b"testserver"),
    ]

    async def main() -> tuple[str, int]:
        comm = WebsocketCommunicator(application, "/ws/ui/images", headers=headers)
        assert (await comm.connect())[0]
        job_id = (await asyncio.to_thread(staff_api.post, "/images/build", json={"kind": "busybox"})).json()[
            "id"
        ]
        html = ""
        while f'id="job-{job_id}" data-status="succeeded"' not in html:
            html = await comm.receive_from(60)
        await comm.disconnect()
        # Token clients are for the API's sockets; these pages are the browser's. (In the same
        # event loop: the consumers' thread-sensitive database calls belong to one loop.)
        comm = WebsocketCommunicator(
            application, "/ws/ui/images", headers=[(b"authorization", b"Bearer hgr_x")]
        )
        return html, await refused_with(comm)

    html, code = asyncio.run(main())
    assert 'id="jobs-body" hx-swap-oob="true"' in html and 'id="images-body"' in html
    assert code == 4401
