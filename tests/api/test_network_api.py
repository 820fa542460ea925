"""Egress through the API: a network at create, changed while running, refused with reasons
when it cannot be, kept across a pause. The "internet" is the tests' own namespace (the
``world`` fixture)."""

from __future__ import annotations

import shutil

import pytest

from tests.api.test_sandboxes_api import create
from tests.support import WORLD_A, WORLD_B, requires_runsc

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
    r = api.post(
        "/sandboxes", json={"image": "busybox", "network": {"egress": "all"}, "pause_mode": "checkpoint"}
    )
    assert r.status_code == 422 and "cannot be checkpointed" in r.json()["detail"]
    # Started without a network: one cannot be added while it runs, but after a pause it can.
    sb = create(api, memory_mb=256)
    r = api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"})
    assert r.status_code == 409 and "pause it" in r.json()["detail"], r.text
    api.post(f"/sandboxes/{sb['id']}/pause", json={})
    assert api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"}).status_code == 200
    api.post(f"/sandboxes/{sb['id']}/resume", json={})
    assert fetch(api, sb["id"], f"http://{WORLD_A}:8080/") == "server-a\n"
