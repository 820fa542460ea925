"""A fleet on this machine: a control plane (`hangar up` on a Postgres and Redis of its own,
with its own node) and two more nodes joined to it by join tokens (`hangar node join`), each
with its own data dir, runsc root and address pool (tests/reliability/stack.py). Sandboxes
spread across the three; a `node_selector` pins one; a node SIGKILLed whole is `lost` within
30 s with its sandboxes saying so, and started again re-adopts the sandboxes that survived; a
drained node moves its paused sandboxes to the others (a checkpointed one goes on there with
its processes and memory), takes no new sandbox and is removed once empty; a used or expired join token is
refused at once."""

from __future__ import annotations

import hashlib
import ipaddress
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.reliability.stack import ROOT, JoinedNode, Stack, alive
from tests.support import requires_runsc

pytestmark = [requires_runsc, pytest.mark.slow, pytest.mark.timeout(900)]

LOST_WITHIN_S = 30  # the bound from death to lost


class Fleet:
    def __init__(self, cp: Stack, nodes: dict[str, JoinedNode]) -> None:
        self.cp, self.nodes = cp, nodes
        self.staff_token = ""

    def staff(self) -> httpx.Client:
        return httpx.Client(base_url=f"{self.cp.url}/api/v1", timeout=60,
                            headers={"Authorization": f"Bearer {self.staff_token}"})  # fmt: skip

    def placeable(self) -> set[str]:
        """Ready nodes that have said they are there (a joined node does once its runtimes and
        the default image are ready)."""
        with self.staff() as staff:
            return {
                n["name"]
                for n in staff.get("/nodes").json()
                if n["state"] == "ready" and n["last_heartbeat_at"]
            }

    def token(self, *extra: str) -> str:
        return self.cp.cli("node", "token", "create", *extra).strip().splitlines()[-1]

    def states(self, api: httpx.Client) -> dict[str, str]:
        return {n["name"]: n["state"] for n in api.get("/nodes").json()}


def wait(check, within: float, what: str):
    deadline = time.monotonic() + within
    last = None
    while time.monotonic() < deadline:
        try:
            if out := check():
                return out
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            last = exc
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {within} s ({last!r})")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    cp = Stack(tmp_path_factory.mktemp("fleet-cp"), disk_mb=640, name="cp")
    nodes = {
        name: JoinedNode(
            tmp_path_factory.mktemp(f"fleet-{name}"), cp, f"{name}-{cp.tag}", labels=f"zone={zone}"
        )
        for name, zone in (("n1", "b"), ("n2", "c"))
    }
    f = Fleet(cp, nodes)
    try:
        cp.mount_data_disk()
        cp.start_postgres()
        cp.start_redis()
        cp.bootstrap()
        cp.cli("user", "create", "staff", "--password", "pw-staff-123456", "--staff")
        cp.cli("team", "create", "site", "--owner", "staff")
        f.staff_token = (
            cp.cli("token", "create", "--user", "staff", "--team", "site").strip().splitlines()[-1]
        )
        cp.start()
        for node in nodes.values():
            node.join(f.token())
        names = {cp.node, *(n.name for n in nodes.values())}
        wait(lambda: f.placeable() >= names, 180,
             "three ready nodes: " + " | ".join(n.log() for n in nodes.values()))  # fmt: skip
        yield f
    finally:
        try:
            cp.close()  # deletes every sandbox through the API while the nodes still run
        finally:
            for node in nodes.values():
                node.close()


def create(api: httpx.Client, **extra) -> dict:
    r = api.post("/sandboxes", json={"image": "busybox", "memory_mb": 128, "timeout_s": 900, **extra})
    assert r.status_code == 201, r.text
    assert r.json()["status"] == "running", r.json()
    return r.json()


def sh(api: httpx.Client, sandbox_id: str, cmd: str) -> dict:
    r = api.post(f"/sandboxes/{sandbox_id}/exec", json={"cmd": cmd}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_three_nodes_spread_pin_lose_come_back_drain_and_remove(fleet, report):
    cp, n1, n2 = fleet.cp, fleet.nodes["n1"], fleet.nodes["n2"]
    with cp.api() as api:
        # Spread: six sandboxes over three empty nodes of one machine's size, two each.
        made = [create(api, network={"egress": "all"}) for _ in range(6)]
        with fleet.staff() as staff:
            seen = staff.get("/nodes").json()
        assert Counter(sb["node"] for sb in made) == {cp.node: 2, n1.name: 2, n2.name: 2}, (
            [sb["node"] for sb in made],
            seen,
        )
        for sb in made:
            api.put(f"/sandboxes/{sb['id']}/files", params={"path": "/mark"}, content=sb["node"].encode())
            assert sh(api, sb["id"], "cat /mark")["stdout"] == sb["node"]  # reached on its node
        # The joined nodes' processes talk to Redis as users of their own, without Redis's
        # dangerous commands (runtime/services/node_redis.py), not as the control plane.
        clients = redis.Redis(port=cp.redis_port).client_list()
        users = {c["user"] for c in clients if c["user"].startswith("hangar_node_")}
        assert len(users) == 2, [(c["user"], c["name"]) for c in clients]
        assert all(
            "-@dangerous"
            in " ".join(str(r) for r in redis.Redis(port=cp.redis_port).acl_getuser(u)["categories"])
            for u in users
        )
        # Each node's address pool (chosen at its first network) is its own.
        pools = [ipaddress.IPv4Network((d / "runtime/gvisor/network/pool").read_text().strip())
                 for d in (cp.data, n1.data, n2.data)]  # fmt: skip
        assert all(not a.overlaps(b) for i, a in enumerate(pools) for b in pools[i + 1 :]), pools

        # A node_selector pins one: zone=c is n2's label alone.
        pinned = [create(api, node_selector={"zone": "c"}) for _ in range(2)]
        assert {sb["node"] for sb in pinned} == {n2.name}
        r = api.post("/sandboxes", json={"image": "busybox", "node_selector": {"zone": "nowhere"}})
        assert r.status_code == 422 and "no node carries the labels zone=nowhere" in r.json()["detail"], (
            r.text
        )

        # n1 SIGKILLed whole: its worker and bridge die with it, and it is lost within 30 s.
        on_n1 = [sb["id"] for sb in made if sb["node"] == n1.name]
        killed_at = time.monotonic()
        pids = n1.kill()
        wait(lambda: not any(alive(p) for p in pids), 10, "n1's node, worker and bridge gone")
        wait(lambda: fleet.states(api)[n1.name] == "lost", LOST_WITHIN_S + 5, "n1 lost")
        lost_s = time.monotonic() - killed_at
        assert lost_s <= LOST_WITHIN_S + 2, lost_s  # the check's tick rounds up by at most 2 s here
        for sid in on_n1:
            got = api.get(f"/sandboxes/{sid}").json()
            assert got["status_reason"].startswith(f"lost: node {n1.name} "), got
        # Nothing is placed on a lost node.
        more = [create(api) for _ in range(2)]
        assert n1.name not in {sb["node"] for sb in more}

        # n1 again (a bare `hangar node`): ready, its sandboxes re-adopted with their files.
        back_at = time.monotonic()
        n1.run_again()
        wait(lambda: fleet.states(api)[n1.name] == "ready", 120, "n1 ready again: " + n1.log())
        back_s = time.monotonic() - back_at
        for sid in on_n1:
            wait(
                lambda s=sid: api.get(f"/sandboxes/{s}").json()["status_reason"] == "",
                30,
                f"{sid}'s reason gone",
            )
            assert api.get(f"/sandboxes/{sid}").json()["status"] == "running"
            assert sh(api, sid, "cat /mark")["stdout"] == n1.name

        # n2 drained: its paused sandboxes move (one checkpointed, with a network: its
        # processes, memory and files go on elsewhere; one pinned to zone=c has nowhere to go
        # and stays); no new sandbox goes there; it stays draining while the rest is there,
        # refuses removal, and is removed once it is gone.
        with fleet.staff() as staff:
            on_n2 = [
                sb["id"]
                for sb in api.get("/sandboxes", params={"limit": 1000}).json()
                if sb["node"] == n2.name
            ]
            assert len(on_n2) >= 4, on_n2  # two spread there, two pinned
            mover, stayer = next(sb["id"] for sb in made if sb["node"] == n2.name), pinned[0]["id"]
            sh(api, mover, "echo in-memory > /dev/shm/mem")
            r = api.post(f"/sandboxes/{mover}/exec", json={"background": True,
                         "cmd": "i=0; while :; do i=$((i+1)); echo $i > /dev/shm/count; sleep 0.1; done"})  # fmt: skip
            assert r.status_code == 202, r.text
            for sid, mode in ((mover, "checkpoint"), (stayer, "stop")):
                r = api.post(f"/sandboxes/{sid}/pause", json={"mode": mode}, timeout=120)
                assert r.status_code == 200 and r.json()["status"] == "paused", r.text
            r = staff.post(f"/nodes/{n2.name}/drain")
            assert r.status_code == 200, r.text
            drained = r.json()
            assert drained["state"] == "draining" and len(on_n2) - 1 <= drained["remaining"] <= len(on_n2), (
                r.text
            )
            assert set(drained["moving"]) == {mover} and drained["moving"][mover] in {cp.node, n1.name}, (
                r.text
            )
            assert "zone=c" in drained["staying"][stayer], r.text
            moved_at, moved_to = time.monotonic(), drained["moving"][mover]
            wait(lambda: api.get(f"/sandboxes/{mover}").json()["node"] == moved_to, 90,
                 f"{mover} moved to {moved_to}: " + n2.log())  # fmt: skip
            move_s = time.monotonic() - moved_at
            got = api.get(f"/sandboxes/{mover}").json()
            assert got["status"] == "paused", got
            events = [e["kind"] for e in api.get(f"/sandboxes/{mover}/events").json()]
            assert "moving" in events and "moved" in events, events
            r = api.post(f"/sandboxes/{mover}/resume", json={}, timeout=120)
            assert r.status_code == 200 and r.json()["status"] == "running", r.text
            assert sh(api, mover, "cat /dev/shm/mem /mark")["stdout"] == f"in-memory\n{n2.name}"
            count = int(sh(api, mover, "cat /dev/shm/count")["stdout"])
            time.sleep(0.5)
            assert int(sh(api, mover, "cat /dev/shm/count")["stdout"]) > count  # the same process, going on
            # Its network is its new node's: an address of that node's pool.
            data = cp.data if moved_to == cp.node else n1.data
            pool = ipaddress.IPv4Network((data / "runtime/gvisor/network/pool").read_text().strip())
            out = sh(api, mover, "ip -4 -o addr show | grep -v ' lo ' | head -1")["stdout"].split()
            assert ipaddress.IPv4Interface(out[3]).ip in pool, (out, pool)
            wait(
                lambda: not (n2.data / "runtime/gvisor/sandboxes" / mover).exists(), 30, "n2 forgot its copy"
            )
            on_n2.remove(mover)
            assert n2.name not in {create(api)["node"] for _ in range(2)}
            r = api.post("/sandboxes", json={"image": "busybox", "node_selector": {"zone": "c"}})
            assert r.status_code == 503 and "draining" in r.json()["detail"], r.text
            r = staff.delete(f"/nodes/{n2.name}")
            assert r.status_code == 409, r.text
            for sid in on_n2:
                api.delete(f"/sandboxes/{sid}")
            wait(lambda: staff.delete(f"/nodes/{n2.name}").status_code == 200, 90, "n2 removed once empty")
            assert fleet.states(api)[n2.name] == "removed"
    report.held(
        "fleet", "three nodes: spread 2/2/2, node_selector pinned, one SIGKILLed lost and back, one drained (a paused "
        "sandbox moved with its processes) and removed",
        lost_after_s=round(lost_s, 1), back_ready_s=round(back_s, 1), paused_move_s=round(move_s, 1),
    )  # fmt: skip


def _join(fleet: Fleet, token: str, name: str) -> subprocess.CompletedProcess[str]:
    env = {**fleet.nodes["n1"].env, "HANGAR_DATA_DIR": str(fleet.nodes["n1"].root / "never")}
    return subprocess.run(
        [sys.executable, "-m", "dashboard.cli", "node", "join", fleet.cp.url, "--token", token, "--name", name],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_used_or_expired_join_token_is_refused_at_once(fleet, report):
    used = fleet.token()
    with fleet.cp.api() as api:  # a join through the API uses it up (no node process needed)
        r = httpx.post(
            f"{fleet.cp.url}/api/v1/nodes/join", json={"token": used, "name": "once-" + fleet.cp.tag}
        )
        assert r.status_code == 200, r.text
        assert "once-" + fleet.cp.tag in fleet.states(api)
    started = time.monotonic()
    out = _join(fleet, used, "twice-" + fleet.cp.tag)
    assert out.returncode != 0 and "has been used (1 of 1 joins)" in out.stderr, out
    expiring = fleet.token("--expires-in", "1")
    time.sleep(2)
    out = _join(fleet, expiring, "late-" + fleet.cp.tag)
    assert out.returncode != 0 and "it has expired" in out.stderr, out
    assert time.monotonic() - started < 60
    report.held("fleet", "a used and an expired join token refused by hangar node join, which exits non-zero")


def test_a_node_s_machine_lost_whole_and_back(fleet, report):
    """Not the node's processes alone (the first test): its sandboxes die with its machine.
    Lost within 30 s, its sandboxes saying so; one deleted meanwhile is released at once; back,
    the node reports the others gone (failed, with the reason) and leaves nothing of the three
    on the host: no process, mount, namespace, interface, rule or directory."""
    from tests.reliability.stack import host_resources

    cp, n1 = fleet.cp, fleet.nodes["n1"]
    with cp.api() as api:
        wait(lambda: fleet.states(api)[n1.name] == "ready", 60, "n1 ready")
        mine = [create(api, node_selector={"zone": "b"}, network={"egress": "all"}) for _ in range(3)]
        assert {sb["node"] for sb in mine} == {n1.name}, mine
        ids = [sb["id"] for sb in mine]
        lost_at = time.monotonic()
        node_pids, sandbox_pids = n1.lose_machine()
        assert sandbox_pids, "no process of n1's sandboxes was found to kill"
        wait(lambda: not any(alive(p) for p in node_pids + sandbox_pids), 10, "n1's machine down")
        wait(lambda: fleet.states(api)[n1.name] == "lost", LOST_WITHIN_S + 5, "n1 lost")
        lost_s = time.monotonic() - lost_at
        for sid in ids:
            got = api.get(f"/sandboxes/{sid}").json()
            assert got["status_reason"].startswith(f"lost: node {n1.name} "), got

        # Deleted while its node is lost: the row is released at once.
        gone = ids[0]
        assert api.delete(f"/sandboxes/{gone}").status_code == 204
        assert api.get(f"/sandboxes/{gone}").json()["status"] == "deleted"

        # Back (the machine restarted, `hangar node` again): what the database no longer wants
        # goes, and the sandboxes that did not survive are failed with a reason.
        back_at = time.monotonic()
        n1.run_again()
        wait(lambda: fleet.states(api)[n1.name] == "ready", 120, "n1 ready again: " + n1.log())
        for sid in ids[1:]:
            got = wait(lambda s=sid: (g := api.get(f"/sandboxes/{s}").json())["status"] == "failed" and g, 90,
                       f"{sid} failed once n1 is back: " + n1.log())  # fmt: skip
            assert got["status_reason"], got
        settled_s = time.monotonic() - back_at
        sandboxes_dir = n1.data / "runtime" / "gvisor" / "sandboxes"

        def nothing_left() -> bool:  # as test_faults.py's last test looks (its veth by its id's digest)
            found = host_resources()
            for sid in ids:
                digest = hashlib.sha1(sid.encode()).hexdigest()[:8]
                for kind, text in found.items():
                    if sid in text or (kind in ("interfaces", "nftables") and digest in text):
                        return False
            return not any((sandboxes_dir / sid).exists() for sid in ids)

        wait(nothing_left, 60, "nothing of the three left on the host: " + n1.log())
    report.held(
        "fleet", "a node's machine lost whole (its sandboxes with it): lost, a delete meanwhile released at once, "
        "back: the rest failed with their reason, nothing of them left on the host",
        lost_after_s=round(lost_s, 1), settled_after_back_s=round(settled_s, 1),
    )  # fmt: skip
