"""A second runtime plugs in: the gVisor launcher registered again as ``gvisor-reduced`` with
network and checkpoints off (tests/launchers/reduced.py, registered for the test node's worker
and bridge by HANGAR_LAUNCHER_CLASSES in tests/settings.py). The node advertises each runtime
with its capabilities, and the scheduler, the API, the create form and the pages follow what it
advertises: real sandboxes start on it, and what it lacks is a clear 422, never a 500 or a
sandbox started without what was asked for."""

from __future__ import annotations

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model

from runtime.models import Node, Sandbox
from tests.api.test_sandboxes_api import create
from tests.launchers.reduced import NAME as REDUCED
from tests.support import requires_runsc, wait_until

pytestmark = [requires_runsc]


def test_the_node_advertises_each_runtime_with_what_its_sandboxes_can_have(api):
    node = Node.objects.get(name=settings.HANGAR_NODE_NAME)
    assert node.launchers[settings.HANGAR_DEFAULT_RUNTIME] == {
        "network": True, "checkpoint": True, "kvm": False, "gpu": False, "vm": False, "move": True,
        "max_command_bytes": 1 << 20,
    }  # fmt: skip
    assert node.launchers[REDUCED] == {
        "network": False, "checkpoint": False, "kvm": False, "gpu": False, "vm": False, "move": False,
        "max_command_bytes": 1 << 20,
    }  # fmt: skip
    health = api.get("/health").json()
    mine = next(n for n in health["nodes"] if n["name"] == settings.HANGAR_NODE_NAME)
    assert REDUCED in mine["runtimes"] and mine["launchers"][REDUCED]["network"] is False


def test_a_sandbox_runs_on_the_second_runtime_and_what_it_lacks_is_refused_clearly(api):
    sb = create(api, runtime=REDUCED)
    assert sb["status"] == "running" and sb["runtime"] == REDUCED, sb
    out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "echo $HANGAR_SANDBOX_ID; uname -r"}).json()
    assert out["exit_code"] == 0 and out["stdout"].startswith(sb["id"]), out
    assert Sandbox.objects.get(id=sb["id"]).handle["runtime"] == REDUCED  # its launcher's, by that name

    # A create asking for what it lacks: a 422 that says so, before anything is started.
    before = Sandbox.objects.count()
    r = api.post("/sandboxes", json={"image": "busybox", "runtime": REDUCED, "network": {"egress": "all"}})
    assert r.status_code == 422 and f"the {REDUCED} runtime gives sandboxes no network" in r.json()["detail"]
    r = api.post("/sandboxes", json={"image": "busybox", "runtime": REDUCED, "pause_mode": "checkpoint"})
    assert r.status_code == 422 and f"the {REDUCED} runtime cannot checkpoint" in r.json()["detail"]
    r = api.post("/pools", json={"image": "busybox", "runtime": REDUCED, "size": 1, "network": True})
    assert r.status_code == 422 and "no network" in r.json()["detail"]
    assert Sandbox.objects.count() == before

    # And on the running sandbox: no network, no checkpoint pause; it stays running.
    r = api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"})
    assert r.status_code == 422 and "no network" in r.json()["detail"], r.text
    r = api.post(f"/sandboxes/{sb['id']}/pause", json={"mode": "checkpoint"})
    assert r.status_code == 422 and "cannot checkpoint" in r.json()["detail"], r.text
    assert api.get(f"/sandboxes/{sb['id']}").json()["status"] == "running"

    # What it has works: a pause that stops it and a resume over its files.
    api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "echo kept > /root/f"})
    r = api.post(f"/sandboxes/{sb['id']}/pause", json={"mode": "stop"})
    assert r.status_code == 200 and r.json()["status"] == "paused", r.text
    r = api.post(f"/sandboxes/{sb['id']}/resume", json={})
    assert r.status_code == 200 and r.json()["status"] == "running", r.text
    assert api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "cat /root/f"}).json()["stdout"] == "kept\n"
    assert api.delete(f"/sandboxes/{sb['id']}").status_code in (200, 204)
    wait_until(lambda: api.get(f"/sandboxes/{sb['id']}").json()["status"] == "deleted", 30, what="deleted")


def test_the_default_runtime_keeps_what_the_second_lacks(api):
    r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 256, "pause_mode": "checkpoint"})
    assert r.status_code == 201 and r.json()["runtime"] == settings.HANGAR_DEFAULT_RUNTIME, r.text
    api.delete(f"/sandboxes/{r.json()['id']}")


@pytest.fixture
def alice(client, api):
    client.force_login(get_user_model().objects.get(username="alice"))  # the API token's owner
    return client


def test_the_create_form_and_the_node_table_say_what_each_runtime_cannot_do(alice):
    page = alice.get("/sandboxes/").content.decode()
    assert f'<option value="{REDUCED}">{REDUCED} (no network, no checkpoint)</option>' in page
    assert f"{REDUCED}: no network, no checkpoint" in page
    default = settings.HANGAR_DEFAULT_RUNTIME
    assert f'<option value="{default}" selected>{default}</option>' in page  # the default, chosen
    nodes = alice.get("/", HTTP_HX_REQUEST="true").content.decode()
    assert f"{REDUCED} (no network, no checkpoint)" in nodes
    # The form's create follows the node too: the refusal lands beside the network field.
    r = alice.post("/sandboxes/", {"image": "busybox", "runtime": REDUCED, "cpu": "1", "memory_mb": "256",
                                   "timeout_s": "600", "egress": "all"})  # fmt: skip
    assert r.status_code == 422 and f"the {REDUCED} runtime gives sandboxes no network" in r.content.decode()
