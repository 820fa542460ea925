"""Egress through the API: a network at create, changed while running, refused with reasons
when it cannot be, kept across a pause. The "internet" is the tests' own namespace (the
``world`` fixture)."""

from __future__ import annotations

import shutil

import pytest

from tests.api.test_sandboxes_api import create
from tests.support import WORLD_A, WORLD_B, requires_runsc, wait_until

pytestmark = [
    requires_runsc,
    pytest.mark.skipif(
        shutil.which("nft") is None,
        reason="needs nft (nftables) to enforce egress; scripts/install-system-deps.sh installs it, so this skips only where it was left out",
    ),
]


def fetch(api, sid: str, url: str) -> str | None:
    out = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": f"timeout 2 wget -q -O- {url}", "timeout_s": 20}
    ).json()
    return out["stdout"] if out["exit_code"] == 0 else None


def test_egress_is_set_at_create_changed_while_running_and_kept_across_a_pause(api, world):
    sb = create(api, memory_mb=256, network={"egress": "allowlist", "allow": [f"{WORLD_A}:8080"]})
    sid = sb["id"]
    assert sb["network"] == {"egress": "allowlist", "allow": [f"{WORLD_A}:8080"]}
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") == "server-a\n"
    assert fetch(api, sid, f"http://{WORLD_B}:8080/") is None
    r = api.put(f"/sandboxes/{sid}/network", json={"egress": "all"})
    assert r.status_code == 200 and r.json()["network"] == {"egress": "all", "allow": []}, r.text
    assert fetch(api, sid, f"http://{WORLD_B}:8080/") == "server-b\n"
    r = api.put(f"/sandboxes/{sid}/network", json={"egress": "allowlist", "allow": [WORLD_B]})
    assert r.status_code == 200
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") is None
    assert "network" in [e["kind"] for e in api.get(f"/sandboxes/{sid}/events").json()]
    # Paused, then resumed: the policy holds (a fresh namespace, the same rules).
    assert api.post(f"/sandboxes/{sid}/pause", json={"mode": "stop"}).json()["status"] == "paused"
    assert api.post(f"/sandboxes/{sid}/resume", json={}).json()["status"] == "running"
    assert fetch(api, sid, f"http://{WORLD_B}:8080/") == "server-b\n"
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") is None


def test_network_input_and_impossible_changes_are_refused_with_reasons(api, world):
    bad = [
        ({"egress": "allowlist"}, "needs at least one entry"),
        ({"egress": "all", "allow": ["1.2.3.4"]}, 'allow is for egress "allowlist"'),
        ({"egress": "allowlist", "allow": ["exa mple.com"]}, "not a host name"),
        ({"egress": "allowlist", "allow": ["1.2.3.4:99999"]}, "port must be"),
        ({"egress": "allowlist", "allow": ["::1"]}, "IPv4 only"),
    ]
    for network, words in bad:
        r = api.post("/sandboxes", json={"image": "busybox", "network": network, "wait": False})
        assert r.status_code == 422 and words in r.json()["detail"], (network, r.text)
    # Checkpointed without a network, it resumes as it was saved: no network can be added then.
    sb = create(api, memory_mb=256, pause_mode="checkpoint")
    assert api.post(f"/sandboxes/{sb['id']}/pause", json={}).json()["paused_mode"] == "checkpoint"
    r = api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"})
    assert r.status_code == 409 and "checkpointed without a network" in r.json()["detail"], r.text
    api.delete(f"/sandboxes/{sb['id']}")
    # Started without a network: one cannot be added while it runs, but after a pause it can.
    sb = create(api, memory_mb=256)
    r = api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"})
    assert r.status_code == 409 and "pause it" in r.json()["detail"], r.text
    api.post(f"/sandboxes/{sb['id']}/pause", json={})
    assert api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"}).status_code == 200
    api.post(f"/sandboxes/{sb['id']}/resume", json={})
    assert fetch(api, sb["id"], f"http://{WORLD_A}:8080/") == "server-a\n"


def test_a_sandbox_with_a_network_is_checkpointed_and_restored_with_it(api, world):
    """Its processes and gVisor's network stack are saved; while paused it holds no namespace
    (only its addresses); restored, the policy in force then applies (changed while paused)."""
    import subprocess

    sb = create(api, memory_mb=256, pause_mode="checkpoint",
                network={"egress": "allowlist", "allow": [f"{WORLD_A}:8080"]})  # fmt: skip
    sid = sb["id"]
    counter = api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": "i=0; while :; do i=$((i+1)); echo $i > /tmp/c.new; mv /tmp/c.new /tmp/count; sleep 0.05; done",
        "background": True}).json()  # fmt: skip
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") == "server-a\n"
    # A connection to outside that is open when it is saved (gVisor cannot save its peer's side)
    # does not stop the checkpoint: it is reset, as after any pause, and its client sees that.
    api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": f"sleep 600 | (nc {WORLD_A} 8080; echo closed > /tmp/held)", "background": True})  # fmt: skip
    wait_until(lambda: f"{WORLD_A}:8080" in api.post(f"/sandboxes/{sid}/exec", json={
        "cmd": "netstat -tn"}).json()["stdout"], 10, what="the held connection")  # fmt: skip
    r = api.post(f"/sandboxes/{sid}/pause", json={})
    assert r.json()["status"] == "paused" and r.json()["paused_mode"] == "checkpoint", r.json()[
        "status_reason"
    ]
    before = api.get(f"/sandboxes/{sid}").json()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hangar-{sid}" not in netns  # nothing of it runs while paused
    # The node's reconciliation leaves a paused sandbox's addresses alone: it needs them back.
    from django.conf import settings

    from runtime.node.sandboxes import node_reconcile

    assert sid not in node_reconcile(node_name=settings.HANGAR_NODE_NAME)["networks_removed"]
    r = api.put(f"/sandboxes/{sid}/network", json={"egress": "allowlist", "allow": [f"{WORLD_B}:8080"]})
    assert r.status_code == 200, r.text
    r = api.post(f"/sandboxes/{sid}/resume", json={})
    assert r.status_code == 200 and r.json()["status"] == "running", r.text
    assert r.json()["paused_mode"] == "", before
    messages = [e["message"] for e in api.get(f"/sandboxes/{sid}/events").json()]
    assert any("resumed from its checkpoint" in m for m in messages), messages
    assert api.get(f"/sandboxes/{sid}/processes/{counter['id']}").json()["status"] == "running"
    wait_until(lambda: api.post(f"/sandboxes/{sid}/exec", json={"cmd": "cat /tmp/held"}).json()["stdout"]
               == "closed\n", 10, what="the held connection to be reset")  # fmt: skip
    assert (
        f"{WORLD_A}:8080"
        not in api.post(f"/sandboxes/{sid}/exec", json={"cmd": "netstat -tn"}).json()["stdout"]
    )
    assert fetch(api, sid, f"http://{WORLD_B}:8080/") == "server-b\n"
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") is None
    # Gone with it: namespace, rules and addresses.
    assert api.delete(f"/sandboxes/{sid}").status_code in (200, 202, 204)
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "deleted", 30, what="delete")
    from runtime.node.local import launcher_for

    assert launcher_for("gvisor").network.lease_of(sid) is None
    assert f"sb_{sid}" not in subprocess.run(["nft", "list", "table", "inet", launcher_for("gvisor").names.table], capture_output=True,
                                             text=True).stdout  # fmt: skip
