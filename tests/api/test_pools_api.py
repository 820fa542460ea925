"""Warm pools against real runsc: a matching create claims a started member at once, takes on
the caller's env (and nothing of anybody else's), and the pool refills; a pool's node_selector
keeps its members on nodes with its labels, and a create's claims only a member on such a node."""

from __future__ import annotations

import pytest

from runtime.models import Node, Pool, Sandbox, Team
from runtime.services.nodes import node_register
from runtime.services.pools import pool_claim
from tests.api.test_sandboxes_api import create
from tests.support import GVISOR, requires_runsc, wait_until

pytestmark = [requires_runsc]


def ready(api, pool_id: str) -> int:
    return api.get(f"/pools/{pool_id}").json()["ready"]


def delete_pool(api, pool_id: str, timeout: float = 60) -> None:
    """Delete the pool and wait until no member is starting or stopping: no refill or
    provisioning is left to write while the test database is flushed."""
    api.delete(f"/pools/{pool_id}")
    wait_until(
        lambda: not Sandbox.objects.filter(status__in=["pending", "starting", "stopping"]).exists(), timeout,
        what="the pool's members to settle",
    )  # fmt: skip


@pytest.fixture
def pool(api):
    r = api.post("/pools", json={"image": "busybox", "memory_mb": 256, "size": 2})
    assert r.status_code == 201, r.text
    pool = r.json()
    wait_until(lambda: ready(api, pool["id"]) == 2, 60, what="the pool to fill")
    yield pool
    delete_pool(api, pool["id"])


def test_a_matching_create_claims_a_warm_member_and_the_pool_refills(api, pool):
    assert api.get("/sandboxes").json() == []  # unclaimed members are nobody's sandboxes yet
    sb = create(api, memory_mb=256, env={"WHO": "first"}, metadata={"job": "a"}, timeout_s=600)
    assert sb["status"] == "running" and sb["pool"] == pool["id"] and sb["metadata"] == {"job": "a"}
    out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "echo $WHO; ls -A /root /tmp"}).json()
    assert out["stdout"] == "first\n/root:\n\n/tmp:\n"  # the caller's env; nobody's files
    events = [e["message"] for e in api.get(f"/sandboxes/{sb['id']}/events").json()]
    assert f"claimed from warm pool {pool['id']}" in events
    assert [s["id"] for s in api.get("/sandboxes").json()] == [sb["id"]]

    wait_until(lambda: ready(api, pool["id"]) == 2, 60, what="the refill")
    second = create(api, memory_mb=256, env={"WHO": "second"})
    assert second["pool"] == pool["id"] and second["id"] != sb["id"]
    assert (
        api.post(f"/sandboxes/{second['id']}/exec", json={"cmd": "echo $WHO"}).json()["stdout"] == "second\n"
    )

    # Another spec starts a sandbox of its own: other memory, or another disk size.
    other = create(api, memory_mb=384)
    assert other["pool"] is None
    bigger = create(api, memory_mb=256, disk_mb=20480)
    assert bigger["pool"] is None and bigger["disk_mb"] == 20480
    assert sb["disk_mb"] == pool["disk_mb"] == 10240  # the node's default


def test_a_pool_with_a_node_selector_keeps_its_members_on_such_nodes_and_serves_creates_that_select_them(
    api, local_node
):
    Node.objects.filter(id=local_node.id).update(labels={"zone": "t", "disk": "ssd"})
    r = api.post(
        "/pools", json={"image": "busybox", "memory_mb": 256, "size": 1, "node_selector": {"zone": "nowhere"}}
    )
    assert r.status_code == 422 and "no node carries the labels zone=nowhere" in r.json()["detail"], r.text
    r = api.post(
        "/pools", json={"image": "busybox", "memory_mb": 256, "size": 1, "node_selector": {"zone": "t"}}
    )
    assert r.status_code == 201 and r.json()["node_selector"] == {"zone": "t"}, r.text
    pool = r.json()
    try:
        wait_until(lambda: ready(api, pool["id"]) == 1, 60, what="the pool to fill")
        member = Sandbox.objects.get(pool_id=pool["id"])
        assert member.node_id == local_node.id and member.node_selector == {"zone": "t"}
        # The same spec and labels again: that pool exists (the same spec with other labels would not).
        r = api.post(
            "/pools", json={"image": "busybox", "memory_mb": 256, "size": 1, "node_selector": {"zone": "t"}}
        )
        assert r.status_code == 409 and pool["id"] in r.json()["detail"]
        # A create that selects labels its node carries claims it, and keeps both selectors.
        sb = create(api, memory_mb=256, node_selector={"disk": "ssd"})
        assert sb["pool"] == pool["id"] and sb["node_selector"] == {"zone": "t", "disk": "ssd"}, sb
        wait_until(lambda: ready(api, pool["id"]) == 1, 60, what="the refill")
    finally:
        delete_pool(api, pool["id"])


def test_a_claim_with_a_node_selector_takes_only_a_member_on_a_node_with_those_labels(transactional_db):
    team = Team.objects.create(name="claims")
    a = node_register(name="claim-a", launchers=GVISOR, cpu=4, memory_mb=4096, labels={"zone": "a"})
    b = node_register(name="claim-b", launchers=GVISOR, cpu=4, memory_mb=4096, labels={"zone": "b"})
    pool = Pool.objects.create(
        team=team, image="busybox", runtime="gvisor", cpu=1, memory_mb=256, disk_mb=1024
    )
    on_a, on_b = (Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", runtime="gvisor",
                                         node=n, pool=pool, status="running", cpu=1, memory_mb=256, disk_mb=1024)
                  for n in (a, b))  # fmt: skip
    spec = {"team": team, "image": "busybox", "runtime": "gvisor", "cpu": 1, "memory_mb": 256, "disk_mb": 1024,
            "claim": {"timeout_s": 60}}  # fmt: skip
    assert pool_claim(**spec, node_selector={"zone": "c"}) is None
    claimed = pool_claim(**spec, node_selector={"zone": "b"})
    assert claimed is not None and claimed.id == on_b.id and claimed.node_selector == {"zone": "b"}
    assert pool_claim(**spec, node_selector={"zone": "b"}) is None  # the only one there is taken
    assert pool_claim(**spec).id == on_a.id  # no selector: any member


def test_pools_are_the_teams_own(api, other_api, pool):
    assert other_api.get(f"/pools/{pool['id']}").status_code == 404
    assert other_api.get("/pools").json() == []
    assert other_api.delete(f"/pools/{pool['id']}").status_code == 404


def test_deleting_a_pool_removes_its_unclaimed_members_only(api, pool):
    claimed = create(api, memory_mb=256)
    assert claimed["pool"] == pool["id"]
    assert api.delete(f"/pools/{pool['id']}").status_code == 204
    assert api.get(f"/pools/{pool['id']}").status_code == 404
    assert api.get(f"/sandboxes/{claimed['id']}").json()["status"] == "running"  # the caller's, kept


def test_pool_input_errors_are_explained(api, pool):
    r = api.post("/pools", json={"image": "busybox", "memory_mb": 256, "size": 2})
    assert r.status_code == 409 and pool["id"] in r.json()["detail"]
    r = api.post("/pools", json={"image": "busybox", "size": 0})
    assert r.status_code == 422 and "size: Input should be greater than or equal to 1" in r.json()["detail"]
    r = api.post("/pools", json={"image": "nope", "size": 1})
    assert r.status_code == 400 and "unknown image" in r.json()["detail"]
    r = api.patch(f"/pools/{pool['id']}", json={"size": 1})
    assert r.status_code == 200 and r.json()["size"] == 1


def test_a_pool_with_networks_serves_creates_that_ask_for_egress(api, world):
    """Members start with a namespace of their own and nothing let out; a create with a network
    claims one and its policy is in force when the create answers. A create without a network
    does not take such a member (nor the reverse)."""
    import subprocess

    from tests.api.test_network_api import fetch
    from tests.support import WORLD_A, WORLD_B

    r = api.post("/pools", json={"image": "busybox", "memory_mb": 256, "size": 1, "network": True})
    assert r.status_code == 201 and r.json()["network"] is True, r.text
    pool_id = r.json()["id"]
    try:
        wait_until(lambda: ready(api, pool_id) == 1, 60, what="the pool to fill")
        member = Sandbox.objects.get(pool_id=pool_id, claimed_at__isnull=True)
        # Started with a network, nothing let out yet.
        from runtime.node.local import launcher_for

        netns = launcher_for("gvisor").names.netns_prefix + member.id
        assert netns in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        plain = create(api, memory_mb=256)
        assert plain["pool"] is None  # no network asked for: not this pool's

        sb = create(api, memory_mb=256, network={"egress": "allowlist", "allow": [f"{WORLD_A}:8080"]})
        assert sb["pool"] == pool_id and sb["id"] == member.id
        assert sb["network"] == {"egress": "allowlist", "allow": [f"{WORLD_A}:8080"]}
        assert fetch(api, sb["id"], f"http://{WORLD_A}:8080/") == "server-a\n"
        assert fetch(api, sb["id"], f"http://{WORLD_B}:8080/") is None
        # Its policy changes like any sandbox's.
        assert api.put(f"/sandboxes/{sb['id']}/network", json={"egress": "all"}).status_code == 200
        assert fetch(api, sb["id"], f"http://{WORLD_B}:8080/") == "server-b\n"

        # The refill's member takes the next create with a network; "all" this time.
        wait_until(lambda: ready(api, pool_id) == 1, 60, what="the refill")
        second = create(api, memory_mb=256, network={"egress": "all"})
        assert second["pool"] == pool_id
        assert fetch(api, second["id"], f"http://{WORLD_B}:8080/") == "server-b\n"
        # One pool per spec: another with networks for it is a conflict.
        r = api.post("/pools", json={"image": "busybox", "memory_mb": 256, "size": 1, "network": True})
        assert r.status_code == 409
    finally:
        delete_pool(api, pool_id)


def test_a_member_that_cannot_take_the_network_policy_is_dropped_and_the_create_starts_its_own(
    celery_worker, local_node, monkeypatch
):
    from runtime.launchers.base import LauncherError
    from runtime.models import Pool, SandboxEvent, Team
    from runtime.services import sandboxes as svc

    team = Team.objects.create(name="netpool")
    pool = Pool.objects.create(team=team, image="busybox", memory_mb=256, size=1, network=True)
    member = Sandbox.objects.create(team=team, image="busybox", image_digest="sha256:x", status="running",
                                    pool=pool, node=local_node, memory_mb=256, expires_at=None,
                                    network={"egress": "none", "allow": []})  # fmt: skip

    def refuse(sandbox, net):
        raise LauncherError("nft: no such chain (simulated)")

    monkeypatch.setattr(svc, "sandbox_network_apply", refuse)
    sb = svc.sandbox_create(
        team=team,
        user=None,
        request=svc.SandboxRequest(image="busybox", memory_mb=256, network={"egress": "all"}),
    )
    assert sb.id != member.id and sb.pool_id is None and sb.network == {"egress": "all", "allow": []}
    member.refresh_from_db()
    assert member.status in ("stopping", "deleted")
    assert "network policy" in member.status_reason
    # Its row never said it had the caller's policy, and no create was recorded for it.
    assert member.network == {"egress": "none", "allow": []}
    from runtime.models import AuditEvent

    assert not AuditEvent.objects.filter(action="sandbox.create", target=member.id).exists()
    assert AuditEvent.objects.filter(action="sandbox.create", target=sb.id).exists()
    assert SandboxEvent.objects.filter(
        sandbox_id=member.id, message__contains="could not be applied"
    ).exists()
    sb = svc.sandbox_wait(sandbox=sb, timeout=60)
    assert sb.status == "running", sb.status_reason
