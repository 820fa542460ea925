"""The fleet's nodes: states and their transitions, a silent node lost within the threshold
(its sandboxes told, deletable at once, back when it answers), cordon keeping placements off,
drain replacing warm-pool members elsewhere and sending paused sandboxes to another node, remove refused while anything is there, the
API's roles (staff, member, another team), join tokens and the Nodes page."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.utils import timezone

from runtime.errors import Conflict, NoCapacity
from runtime.models import (
    AuditEvent,
    Image,
    Membership,
    Node,
    NodeJoinToken,
    Pool,
    Sandbox,
    SandboxEvent,
    SandboxVolume,
    Team,
    Volume,
)
from runtime.services import auth as auth_svc
from runtime.services import fleet
from runtime.services.nodes import lost_silence_s, node_heartbeat, node_pick, node_register, nodes_mark_lost

GVISOR = {"gvisor": {"network": True, "checkpoint": True, "kvm": False, "gpu": False}}
N = Node.State


def call(method: str, path: str, raw: str | None, body: dict | None = None):
    headers = {"HTTP_AUTHORIZATION": f"Bearer {raw}"} if raw else {}
    r = Client().generic(method, f"/api/v1{path}", data=json.dumps(body or {}), content_type="application/json",
                         **headers)  # fmt: skip
    return r.status_code, (r.json() if r.content else None)


@pytest.fixture
def fleet_team(transactional_db):
    User = get_user_model()
    team = Team.objects.create(name="fleet")
    other = Team.objects.create(name="elsewhere")
    raws = {}
    for username, role, staff, t in (("f-staff", "member", True, team), ("f-member", "member", False, team),
                                     ("f-viewer", "viewer", False, team), ("f-other", "owner", False, other)):  # fmt: skip
        user = User.objects.create_user(username=username, password="x", is_staff=staff)
        Membership.objects.create(user=user, team=t, role=role)
        raws[username] = auth_svc.token_create(user=user, team=t).raw
    return team, raws


def _node(name: str, **kw) -> Node:
    return node_register(name=name, launchers=GVISOR, cpu=4, memory_mb=8192, **kw)


def _image(*nodes: Node) -> Image:
    image = Image.objects.create(name="img", digest="sha256:abc")
    image.nodes.add(*nodes)
    return image


def _sandbox(team: Team, node: Node, status: str = "running", **kw) -> Sandbox:
    return Sandbox.objects.create(team=team, image="img", image_digest="sha256:abc", runtime="gvisor", node=node,
                                  status=status, **kw)  # fmt: skip


def _silent_for(node: Node, seconds: float) -> None:
    Node.objects.filter(id=node.id).update(heartbeat_at=timezone.now() - timedelta(seconds=seconds))


# -- states -----------------------------------------------------------------------------------


def test_states_move_only_along_their_transitions_and_each_change_is_audited(fleet_team):
    node = _node("n1")
    assert node.state == N.READY
    assert fleet.node_cordon(name="n1").state == N.CORDONED
    assert fleet.node_cordon(name="n1").state == N.CORDONED  # twice: harmless
    assert fleet.node_uncordon(name="n1").state == N.READY
    assert fleet.node_drain(name="n1")["state"] == N.DRAINING
    with pytest.raises(Conflict, match="n1 is draining; cordon needs it ready"):
        fleet.node_cordon(name="n1")
    assert fleet.node_remove(name="n1").state == N.REMOVED
    with pytest.raises(Conflict, match="n1 is removed"):
        fleet.node_uncordon(name="n1")
    # A removed node stays removed: its heartbeat does not bring it back, nor does a bare start.
    node_heartbeat(name="n1")
    assert Node.objects.get(name="n1").state == N.REMOVED
    with pytest.raises(Conflict, match="join it again"):
        _node("n1")
    actions = list(AuditEvent.objects.filter(target="n1").values_list("action", flat=True))
    assert sorted(set(actions)) == ["node.cordon", "node.drain", "node.remove", "node.uncordon"]
    # A cordoned node that registers again (a restart) stays cordoned.
    _node("n2")
    fleet.node_cordon(name="n2")
    assert _node("n2").state == N.CORDONED


def test_a_silent_node_is_lost_within_the_threshold_its_sandboxes_told_and_back_when_it_answers(
    fleet_team, settings
):
    team, _ = fleet_team
    settings.HANGAR_NODE_OFFLINE_AFTER_S, settings.HANGAR_NODE_HEARTBEAT_S = 30, 5
    # The check runs every heartbeat interval: silence of threshold - interval is lost, so a
    # death is seen at most the threshold after it.
    assert lost_silence_s() + settings.HANGAR_NODE_HEARTBEAT_S <= 30
    fresh, dead, cordoned = _node("fresh"), _node("dead"), _node("dead-cordoned")
    fleet.node_cordon(name="dead-cordoned")
    running, paused, gone = (
        _sandbox(team, dead),
        _sandbox(team, dead, "paused"),
        _sandbox(team, dead, "deleted"),
    )
    _silent_for(fresh, lost_silence_s() - 3)
    _silent_for(dead, lost_silence_s() + 1)
    _silent_for(cordoned, lost_silence_s() + 1)
    assert sorted(nodes_mark_lost()) == ["dead", "dead-cordoned"]
    assert Node.objects.get(name="fresh").state == N.READY
    assert Node.objects.get(name="dead").state == N.LOST
    for sb in (running, paused):
        sb.refresh_from_db()
        assert sb.status_reason.startswith("lost: node dead stopped answering"), sb.status_reason
        assert SandboxEvent.objects.filter(sandbox=sb, kind="node_lost").exists()
    assert Sandbox.objects.get(id=gone.id).status_reason == ""  # an ended one is not told
    assert nodes_mark_lost() == []  # once
    # Nothing is scheduled on a lost node.
    image = _image(dead)
    with pytest.raises(NoCapacity):
        node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image)
    # It answers again: ready (the cordoned one cordoned), its sandboxes' reasons gone.
    node_heartbeat(name="dead")
    node_heartbeat(name="dead-cordoned")
    assert Node.objects.get(name="dead").state == N.READY
    assert Node.objects.get(name="dead-cordoned").state == N.CORDONED
    running.refresh_from_db()
    assert (
        running.status_reason == ""
        and SandboxEvent.objects.filter(sandbox=running, kind="node_back").exists()
    )
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == dead


def test_a_sandbox_on_a_lost_node_is_deleted_at_once(fleet_team):
    team, raws = fleet_team
    dead = _node("gone-node")
    sb = _sandbox(team, dead)
    _silent_for(dead, lost_silence_s() + 1)
    nodes_mark_lost()
    status, _ = call("DELETE", f"/sandboxes/{sb.id}", raws["f-member"])
    assert status in (200, 204), status
    sb.refresh_from_db()
    assert sb.status == Sandbox.Status.DELETED and sb.stopped_at is not None
    # The node, once back, destroys what is left of it: its row no longer wants it (the
    # reconciliation destroys a runtime whose row is deleted).
    assert fleet.node_holding(dead) == 0


def test_cordon_keeps_new_placements_off(fleet_team):
    a, b = _node("place-a"), _node("place-b")
    image = _image(a, b)
    picked = {node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image).name}
    fleet.node_cordon(name="place-a")
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == b
    fleet.node_drain(name="place-b")
    with pytest.raises(NoCapacity):
        node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image)
    fleet.node_uncordon(name="place-a")
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == a
    assert picked <= {"place-a", "place-b"}


def test_drain_replaces_warm_pool_members_elsewhere_and_leaves_the_rest(fleet_team):
    team, _ = fleet_team
    a, b = _node("drain-a"), _node("drain-b")
    _image(a, b)
    fleet.node_cordon(name="drain-b")  # the member lands on a
    pool = Pool.objects.create(team=team, image="img", runtime="gvisor", cpu=1, memory_mb=256, size=1)
    member = _sandbox(team, a, pool=pool)
    claimed = _sandbox(team, a)
    fleet.node_uncordon(name="drain-b")
    done = fleet.node_drain(name="drain-a")
    assert done["replaced"] == [member.id] and done["kept"] == []
    member.refresh_from_db()
    assert member.status == Sandbox.Status.STOPPING  # being destroyed on a
    fresh = Sandbox.objects.filter(pool=pool).exclude(id=member.id).get()
    assert fresh.node == b and fresh.claimed_at is None
    assert done["remaining"] == 2  # the claimed one runs on; the member is still stopping
    assert Node.objects.get(name="drain-a").state == N.DRAINING
    with pytest.raises(Conflict, match="still holds"):
        fleet.node_remove(name="drain-a")
    Sandbox.objects.filter(id__in=[member.id, claimed.id]).update(status="deleted")
    assert fleet.node_remove(name="drain-a").state == N.REMOVED


def test_drain_sends_its_paused_sandboxes_to_a_node_that_can_take_them_and_says_why_the_rest_stay(
    fleet_team, monkeypatch
):
    team, _ = fleet_team
    movable = {"gvisor": {**GVISOR["gvisor"], "move": True}}
    sent: list[tuple[str, list, str]] = []
    monkeypatch.setattr(
        fleet.enqueue, "send", lambda task, args, *, queue, **kw: sent.append((task, args, queue))
    )
    src = node_register(
        name="mv-src", launchers=movable, cpu=4, memory_mb=8192, tunnel_address="127.0.0.1:7001"
    )
    dst = node_register(name="mv-dst", launchers=movable, cpu=4, memory_mb=8192, labels={"zone": "b"})
    old = node_register(
        name="mv-old", launchers=GVISOR, cpu=64, memory_mb=65536
    )  # the most room: cannot move
    _image(src, dst, old)
    checkpointed = _sandbox(team, src, "paused", paused_mode="checkpoint", network={"egress": "all"})
    pinned = _sandbox(team, src, "paused", node_selector={"zone": "a"})
    volume = Volume.objects.create(team=team, name="v", size_mb=64, node=src)
    attached = _sandbox(team, src, "paused")
    SandboxVolume.objects.create(sandbox=attached, volume=volume, mount_path="/data")
    running = _sandbox(team, src)
    done = fleet.node_drain(name="mv-src")
    assert done["moving"] == {checkpointed.id: "mv-dst"}
    assert sent == [("move_in", [checkpointed.id, "mv-src"], dst.queue)]
    assert "no node carries the labels zone=a" in done["staying"][pinned.id]
    assert done["staying"][attached.id] == "its volumes live on node mv-src"
    assert running.id not in done["moving"] and running.id not in done["staying"]
    assert done["remaining"] == 4  # until the move is done: the node it goes to copies it
    event = SandboxEvent.objects.get(sandbox=checkpointed, kind="moving")
    assert event.message == "node mv-src is draining: moving to node mv-dst"
    # Asking again sends what is still paused there again (a move that failed is tried again);
    # with mv-dst cordoned, nothing can take it, and it says so.
    fleet.node_cordon(name="mv-dst")
    again = fleet.node_drain(name="mv-src")
    assert again["moving"] == {} and "lack move" in again["staying"][checkpointed.id], again
    # A node others cannot reach (no tunnel port) keeps its paused sandboxes, and says why.
    fleet.node_uncordon(name="mv-dst")
    closed = node_register(name="mv-closed", launchers=movable, cpu=4, memory_mb=8192)
    stuck = _sandbox(team, closed, "paused")
    assert fleet.node_drain(name="mv-closed")["staying"] == {
        stuck.id: "node mv-closed takes no connections from other nodes (no HANGAR_TUNNEL_PORT)"
    }
    assert len(sent) == 1


# -- the API ----------------------------------------------------------------------------------


def test_the_node_list_shows_staff_everything_and_others_names_and_states(fleet_team):
    team, raws = fleet_team
    node = _node("listed", labels={"zone": "a"})
    _sandbox(team, node, cpu=2, memory_mb=1024)
    status, listed = call("GET", "/nodes", raws["f-staff"])
    assert status == 200
    (row,) = [n for n in listed if n["name"] == "listed"]
    assert set(row) == {"name", "state", "runtimes", "capabilities", "capacity", "allocated", "labels",
                        "sandboxes", "last_heartbeat_at", "version"}  # fmt: skip
    assert (
        row["state"] == "ready"
        and row["runtimes"] == ["gvisor"]
        and row["capabilities"]["gvisor"]["kvm"] is False
    )
    assert row["capacity"]["cpu"] == 4 and row["allocated"] == {"cpu": 2, "memory_mb": 1024, "disk_mb": row[
        "allocated"]["disk_mb"], "gpus": 0}  # fmt: skip
    assert row["labels"] == {"zone": "a"} and row["sandboxes"] == 1 and row["last_heartbeat_at"]
    for who in ("f-member", "f-viewer", "f-other"):
        status, listed = call("GET", "/nodes", raws[who])
        assert status == 200 and {"name": "listed", "state": "ready"} in listed, (who, listed)
        assert all(set(n) == {"name", "state"} for n in listed), (who, listed)
    assert call("GET", "/nodes", None)[0] == 401
    # /health shows the state too.
    health = Client().get("/api/v1/health").json()
    assert {"name": "listed", "state": "ready"}.items() <= next(
        n for n in health["nodes"] if n["name"] == "listed"
    ).items()


def test_only_staff_change_nodes_unknown_is_404_remove_refused_while_active(fleet_team):
    team, raws = fleet_team
    node = _node("api-node")
    sb = _sandbox(team, node)
    for who in ("f-member", "f-viewer", "f-other"):
        for method, path in (("POST", "/nodes/api-node/cordon"), ("POST", "/nodes/api-node/uncordon"),
                             ("POST", "/nodes/api-node/drain"), ("DELETE", "/nodes/api-node"),
                             ("GET", "/nodes/tokens"), ("POST", "/nodes/tokens")):  # fmt: skip
            assert call(method, path, raws[who])[0] == 403, (who, method, path)
    assert Node.objects.get(name="api-node").state == N.READY
    staff = raws["f-staff"]
    assert call("POST", "/nodes/nosuch/cordon", staff)[0] == 404
    assert call("DELETE", "/nodes/nosuch", staff)[0] == 404
    status, body = call("POST", "/nodes/api-node/cordon", staff)
    assert status == 200 and body["state"] == "cordoned"
    status, body = call("POST", "/nodes/api-node/uncordon", staff)
    assert status == 200 and body["state"] == "ready"
    status, body = call("POST", "/nodes/api-node/drain", staff)
    assert status == 200 and body["state"] == "draining" and body["remaining"] == 1
    status, body = call("DELETE", "/nodes/api-node", staff)
    assert status == 409 and "still holds 1 sandbox" in body["detail"]
    Sandbox.objects.filter(id=sb.id).update(status="deleted")
    status, body = call("DELETE", "/nodes/api-node", staff)
    assert status == 200 and body["state"] == "removed"
    assert AuditEvent.objects.filter(action="node.remove", target="api-node", actor="f-staff").exists()


def test_join_tokens_through_the_api_single_use_expiry_revocation(fleet_team, settings):
    _, raws = fleet_team
    staff = raws["f-staff"]
    status, made = call("POST", "/nodes/tokens", staff, {})
    assert status == 201 and made["token"].startswith("hjt_") and made["uses"] == 1
    stored = NodeJoinToken.objects.get(id=made["id"])
    assert made["token"] not in stored.token_hash and stored.token_hash != made["token"]
    status, body = call("POST", "/nodes/join", None, {"token": made["token"], "name": "api-joined",
                                                       "labels": {"zone": "b"}})  # fmt: skip
    assert status == 200, body
    # Its own database role (runtime/services/node_roles.py; tests/runtime/test_node_roles.py).
    assert body["name"] == "api-joined" and body["database_url"].startswith("postgres://hangar_node_")
    assert Node.objects.get(name="api-joined").labels == {"zone": "b"}
    status, body = call("POST", "/nodes/join", None, {"token": made["token"], "name": "api-joined-2"})
    assert status == 401 and "has been used (1 of 1 joins)" in body["detail"]
    status, body = call("POST", "/nodes/join", None, {"token": "hjt_nonsense", "name": "x"})
    assert status == 401 and "unknown join token" in body["detail"]
    status, made = call("POST", "/nodes/tokens", staff, {"uses": 3, "expires_in": 60})
    status, body = call("DELETE", f"/nodes/tokens/{made['id']}", staff)
    assert status == 200 and body["revoked_at"]
    status, body = call("POST", "/nodes/join", None, {"token": made["token"], "name": "revoked-join"})
    assert status == 401 and "revoked" in body["detail"]
    assert call("DELETE", "/nodes/tokens/999999", staff)[0] == 404
    status, listed = call("GET", "/nodes/tokens", staff)
    assert status == 200 and all("token" not in t for t in listed) and len(listed) == 2
    assert call("POST", "/nodes/tokens", staff, {"uses": 0})[0] == 422
    assert call("POST", "/nodes/join", None, {"token": "x", "name": "Bad Name!"})[0] == 422


def test_a_control_plane_on_the_embedded_redis_or_sqlite_refuses_joins(fleet_team, settings, monkeypatch):
    issued = fleet.join_token_create(user=None)
    settings.REDIS_URL = "unix:///tmp/hangar/redis.sock?db=0"
    status, body = call("POST", "/nodes/join", None, {"token": issued.raw, "name": "nope"})
    assert status == 409 and "embedded Redis" in body["detail"]
    assert NodeJoinToken.objects.get(id=issued.token.id).used == 0  # not spent on a refusal
    settings.REDIS_URL = "redis://10.0.0.1:6379/0"
    assert fleet.join_refusal() == ""
    monkeypatch.setitem(settings.DATABASES["default"], "ENGINE", "django.db.backends.sqlite3")
    assert "runs on SQLite" in fleet.join_refusal()


# -- the Nodes page ---------------------------------------------------------------------------


def test_the_nodes_page_shows_staff_the_fleet_and_its_buttons(fleet_team):
    team, _ = fleet_team
    node = _node("paged", labels={"zone": "c"}, version="1.2.3")
    _sandbox(team, node, cpu=1, memory_mb=2048)
    staff, member = Client(), Client()
    staff.force_login(get_user_model().objects.get(username="f-staff"))
    member.force_login(get_user_model().objects.get(username="f-member"))
    page = staff.get("/nodes/").content.decode()
    assert "paged" in page and "zone=c" in page and "1.2.3" in page and "kvm:false" in page
    assert 'class="meter"' in page and "width: 25%" in page  # 2048 of 8192 MB
    assert "/nodes/paged/cordon/" in page and "join-token-form" in page
    r = staff.post("/nodes/paged/cordon/", HTTP_HX_REQUEST="true")
    assert r.status_code == 200 and "cordoned" in r.content.decode()
    assert Node.objects.get(name="paged").state == N.CORDONED
    r = staff.post("/nodes/join-tokens/", {"uses": "2"}, HTTP_HX_REQUEST="true")
    raw = r.content.decode().split('<pre id="join-token-value">')[1].split("</pre>")[0]
    assert raw.startswith("hjt_") and NodeJoinToken.objects.get(uses=2).used == 0
    assert raw not in staff.get("/nodes/").content.decode()  # shown once
    page = member.get("/nodes/").content.decode()
    assert "paged" in page and "cordoned" in page and "zone=c" not in page and "join-token-form" not in page
    assert member.post("/nodes/paged/uncordon/").status_code == 403
    assert member.post("/nodes/join-tokens/").status_code == 403
    assert Node.objects.get(name="paged").state == N.CORDONED
