"""Volumes against real runsc: the data outlives sandboxes, the size is the filesystem's, and
what holds a volume keeps it from being deleted."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

from runtime.node.local import volume_store
from tests.api.test_sandboxes_api import create
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def run(api, sandbox_id: str, cmd: str) -> dict:
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd})
    assert r.status_code == 200, r.text
    return r.json()


def delete_and_wait(api, sandbox_id: str) -> None:
    assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sandbox_id}").json()["status"] == "deleted", 30, what="delete")


@pytest.fixture
def volume(api):
    r = api.post("/volumes", json={"name": "work", "size_mb": 32})
    assert r.status_code == 201, r.text
    return r.json()


def test_volume_create_list_get_delete(api, other_api, volume):
    assert (
        volume["name"] == "work" and volume["size_mb"] == 32 and volume["node"] == settings.HANGAR_NODE_NAME
    )
    assert volume["attached_to"] == [] and volume["id"].startswith("vol")
    assert [v["name"] for v in api.get("/volumes").json()] == ["work"]
    got = api.get(f"/volumes/{volume['id']}").json()
    assert 0 < got["used_bytes"] < 4 * 1024 * 1024  # an empty filesystem
    assert api.get("/volumes/work").json()["id"] == volume["id"]  # by name too
    assert os.path.exists(volume_store().image(volume["id"]))

    # Another team sees nothing of it.
    assert other_api.get(f"/volumes/{volume['id']}").status_code == 404
    assert other_api.delete(f"/volumes/{volume['id']}").status_code == 404
    assert other_api.get("/volumes").json() == []

    assert api.delete("/volumes/work").status_code == 204
    assert api.get("/volumes/work").status_code == 404
    assert not os.path.exists(volume_store().image(volume["id"]))


def test_volume_input_errors_are_explained(api, volume):
    r = api.post("/volumes", json={"name": "work", "size_mb": 32})
    assert r.status_code == 409 and "already has a volume named 'work'" in r.json()["detail"]
    r = api.post("/volumes", json={"name": "Bad Name", "size_mb": 32})
    assert r.status_code == 422 and "invalid volume name" in r.json()["detail"]
    r = api.post("/volumes", json={"name": "tiny", "size_mb": 1})
    assert (
        r.status_code == 422 and "size_mb: Input should be greater than or equal to 16" in r.json()["detail"]
    )
    assert api.post("/volumes", json={"name": "x", "size_mb": 32, "node": "nowhere"}).status_code == 404
    for path, why in [("work", "absolute"), ("/", "absolute"), ("/a/../b", "normalised"), ("/proc/x", "reserved"),
                      ("/.hangar", "reserved")]:  # fmt: skip
        r = api.post(
            "/sandboxes", json={"image": "busybox", "volumes": [{"volume": "work", "mount_path": path}]}
        )
        assert r.status_code == 422 and why in r.json()["detail"], (path, r.text)
    r = api.post("/sandboxes", json={"image": "busybox", "volumes": [
        {"volume": "work", "mount_path": "/a"}, {"volume": "work", "mount_path": "/a"}]})  # fmt: skip
    assert r.status_code == 422 and "two volumes at '/a'" in r.json()["detail"]
    r = api.post("/sandboxes", json={"image": "busybox", "volumes": [{"volume": "nope", "mount_path": "/a"}]})
    assert r.status_code == 404 and "no volume 'nope'" in r.json()["detail"]


def test_data_outlives_its_sandbox_and_holders_block_deletion(api, volume):
    a = create(api, volumes=[{"volume": "work", "mount_path": "/workspace"}])
    assert a["status"] == "running", a
    assert a["volumes"] == [
        {"volume": volume["id"], "name": "work", "mount_path": "/workspace", "read_only": False}
    ]
    out = run(
        api,
        a["id"],
        "echo kept > /workspace/note && mkdir -p /workspace/src && echo x > /workspace/src/f && sync; ls /workspace",
    )
    assert out["exit_code"] == 0 and out["stdout"].split() == ["note", "src"]

    r = api.delete("/volumes/work")
    assert r.status_code == 409 and r.json()["sandboxes"] == [a["id"]] and a["id"] in r.json()["detail"]
    assert api.get("/volumes/work").json()["attached_to"] == [a["id"]]

    delete_and_wait(api, a["id"])  # deleting the sandbox leaves the volume alone
    assert api.get("/volumes/work").json()["attached_to"] == []

    b = create(api, volumes=[{"volume": volume["id"], "mount_path": "/data", "read_only": True}])
    assert run(api, b["id"], "cat /data/note /data/src/f")["stdout"] == "kept\nx\n"
    ro = run(api, b["id"], "echo no > /data/other; echo rc=$?")
    assert "rc=0" not in ro["stdout"]  # read-only: the write fails inside the sandbox
    delete_and_wait(api, b["id"])
    assert api.delete("/volumes/work").status_code == 204


def test_a_write_past_the_size_fails_inside_and_the_host_is_not_filled(api, volume):
    sb = create(api, volumes=[{"volume": "work", "mount_path": "/v"}])
    out = run(api, sb["id"], "dd if=/dev/zero of=/v/big bs=1M count=64 2>&1; echo rc=$?")
    assert "No space left on device" in out["stdout"] and "rc=0" not in out["stdout"], out
    size = run(api, sb["id"], "wc -c < /v/big")["stdout"].strip()
    assert 20 * 1024 * 1024 < int(size) <= 32 * 1024 * 1024
    image = volume_store().image(volume["id"])
    assert os.stat(image).st_blocks * 512 <= 33 * 1024 * 1024  # the file never grows past the size
    # Room comes back when files go, and the sandbox carries on.
    assert run(api, sb["id"], "rm /v/big && echo fits > /v/small && cat /v/small")["stdout"] == "fits\n"
    used = api.get("/volumes/work").json()["used_bytes"]
    assert used < 4 * 1024 * 1024
