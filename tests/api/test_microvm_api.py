"""A sandbox with ``runtime: "microvm"`` through the API, end to end: the test node advertises the
microvm launcher (its probe passes where QEMU and the guest kernel are installed), and a create
boots a real VM (under TCG here) that exec, files, pause and delete reach with no change above
the launcher."""

from __future__ import annotations

import os

import pytest
from django.conf import settings

from runtime.launchers.microvm import boot
from runtime.models import Node
from runtime.node.local import launcher_for
from tests.api.test_sandboxes_api import create
from tests.support import WORLD_A, WORLD_B, requires_runsc, wait_until


def fetch(api, sid: str, url: str) -> str | None:
    out = api.post(
        f"/sandboxes/{sid}/exec", json={"cmd": f"timeout 2 wget -q -O- {url}", "timeout_s": 20}
    ).json()
    return out["stdout"] if out["exit_code"] == 0 else None


pytestmark = [
    requires_runsc,
    pytest.mark.skipif(boot.missing() is not None, reason=f"no microVM support here: {boot.missing()}"),
    pytest.mark.slow,
]


def test_a_microvm_sandbox_runs_commands_and_files_and_is_deleted_whole(api):
    node = Node.objects.get(name=settings.HANGAR_NODE_NAME)
    assert node.launchers["microvm"]["network"] is True and "kvm" in node.launchers["microvm"]

    sb = create(api, runtime="microvm", env={"FOO": "bar"}, cpu=2, memory_mb=256)
    assert sb["status"] == "running" and sb["runtime"] == "microvm", sb
    sid = sb["id"]

    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "echo $FOO; echo oops >&2; exit 4"}).json()
    assert (r["stdout"], r["stderr"], r["exit_code"]) == ("bar\n", "oops\n", 4)
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": ["cat"], "stdin": "piped", "cwd": "/tmp"}).json()
    assert r["stdout"] == "piped"
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "sleep 30", "timeout_s": 1}).json()
    assert r["timed_out"] is True
    # Its own kernel, its vCPUs and RAM.
    r = api.post(f"/sandboxes/{sid}/exec", json={"cmd": "uname -r; grep -c ^processor /proc/cpuinfo"}).json()
    assert r["stdout"].split() == [boot.kernel().version, "2"], r
    assert boot.kernel().version not in (os.uname().release, "4.4.0")

    data = os.urandom(1024 * 1024)
    r = api.put(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"}, content=data)
    assert r.status_code == 200 and r.json()["size"] == len(data)
    r = api.get(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"})
    assert r.status_code == 200 and r.content == data
    listing = api.get(f"/sandboxes/{sid}/files/list", params={"path": "/work"}).json()
    assert [(e["name"], e["size"]) for e in listing] == [("data.bin", len(data))]

    # A stop-mode pause keeps its files; resume boots it again over them.
    r = api.post(f"/sandboxes/{sid}/pause", json={"mode": "stop", "wait": True})
    assert r.status_code in (200, 202), r.text
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "paused", 60, what="paused")
    r = api.post(f"/sandboxes/{sid}/resume", json={"wait": True})
    assert r.status_code in (200, 202), r.text
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "running", 90, what="running")
    r = api.get(f"/sandboxes/{sid}/files", params={"path": "/work/data.bin"})
    assert r.status_code == 200 and r.content == data

    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "deleted", 60, what="deleted")
    assert sid not in launcher_for("microvm").states()


def test_a_microvm_sandbox_has_the_egress_it_asks_for_changed_live_and_leaves_no_network(api, world):
    """The node's nftables policy, as with gVisor: an allowlist, then all, then none, against the
    tests' own namespace of servers (nothing else is contacted)."""
    sb = create(
        api, runtime="microvm", memory_mb=256, network={"egress": "allowlist", "allow": [f"{WORLD_A}:8080"]}
    )
    sid = sb["id"]
    assert sb["status"] == "running" and sb["network"]["egress"] == "allowlist", sb
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") == "server-a\n"
    assert fetch(api, sid, f"http://{WORLD_B}:8080/") is None
    r = api.put(f"/sandboxes/{sid}/network", json={"egress": "all"})
    assert r.status_code == 200, r.text
    assert fetch(api, sid, f"http://{WORLD_B}:8080/") == "server-b\n"
    assert api.put(f"/sandboxes/{sid}/network", json={"egress": "none"}).status_code == 200
    assert fetch(api, sid, f"http://{WORLD_A}:8080/") is None
    network = launcher_for("microvm").network  # type: ignore[attr-defined]
    lease = network.lease_of(sid)
    assert lease is not None and os.path.exists(lease.netns_path)
    assert api.delete(f"/sandboxes/{sid}").status_code == 204
    wait_until(lambda: api.get(f"/sandboxes/{sid}").json()["status"] == "deleted", 60, what="deleted")
    assert network.lease_of(sid) is None and not os.path.exists(lease.netns_path)  # its tap went with it


def test_a_preview_reaches_a_server_in_a_microvm_sandbox(api, server):
    """A preview URL takes the agent's tunnel to the sandbox's own loopback: no network needed."""
    from tests.api.test_previews_api import background, preview, put

    sid = create(api, runtime="microvm", memory_mb=256, ports=[{"port": 8000, "public": True}])["id"]
    try:
        put(api, sid, "/www/index.html", "<h1>hello from the microVM</h1>\n")
        background(api, sid, "httpd -f -p 127.0.0.1:8000 -h /www")
        wait_until(lambda: api.post(f"/sandboxes/{sid}/exec", json={"cmd": "wget -q -O- http://127.0.0.1:8000/"})
                   .json()["exit_code"] == 0, 30, what="httpd")  # fmt: skip
        with preview(server, sid, 8000) as c:
            r = c.get("/")
            assert r.status_code == 200 and r.text == "<h1>hello from the microVM</h1>\n", r.text
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_terminal_in_a_microvm_sandbox_over_the_websocket(api, team_token):
    """The terminal path (websocket, channel layer, the node's bridge, a PTY through the agent)
    takes the one road to the microVM with no change above the launcher."""
    import asyncio

    from channels.layers import channel_layers

    from tests.test_consumers import communicator, read_until

    sid = create(api, runtime="microvm")["id"]
    try:
        term = api.post(f"/sandboxes/{sid}/terminals", json={"env": {"PS1": "READY$ "}}).json()

        async def main() -> None:
            comm = communicator(term["websocket"], team_token)
            assert (await comm.connect())[0]
            await read_until(comm, b"READY$ ", timeout=30)
            await comm.send_to(bytes_data=b"uname -r; echo $((6*7))\n")
            out = await read_until(comm, b"\r\n42\r\n", timeout=30)
            assert boot.kernel().version.encode() in out
            await comm.send_to(text_data='{"type": "resize", "rows": 33, "cols": 101}')
            await comm.send_to(bytes_data=b"stty size\n")
            await read_until(comm, b"33 101", timeout=30)
            await comm.disconnect()

        channel_layers.backends.clear()  # a layer bound to this test's own event loop
        try:
            asyncio.run(main())
        finally:
            channel_layers.backends.clear()
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_warm_pool_of_microvms_serves_a_matching_create_at_once(api):
    """A pool keeps booted VMs; a create of its spec claims one (the caller's environment and
    metadata on it, the guest's own kernel) instead of booting, and the pool boots a refill."""
    from tests.api.test_pools_api import delete_pool, ready

    r = api.post("/pools", json={"image": "busybox", "runtime": "microvm", "memory_mb": 256, "size": 1})
    assert r.status_code == 201, r.text
    pool = r.json()
    try:
        wait_until(lambda: ready(api, pool["id"]) == 1, 120, what="the pool to boot its member")
        sb = create(api, runtime="microvm", env={"WHO": "claimer"}, metadata={"job": "vm"})
        assert sb["pool"] == pool["id"] and sb["runtime"] == "microvm" and sb["metadata"] == {"job": "vm"}, sb
        out = api.post(f"/sandboxes/{sb['id']}/exec", json={"cmd": "echo $WHO; uname -r"}).json()
        assert out["stdout"].split() == ["claimer", boot.kernel().version], out
        wait_until(lambda: ready(api, pool["id"]) == 1, 120, what="the refill")
        api.delete(f"/sandboxes/{sb['id']}")
    finally:
        delete_pool(api, pool["id"], timeout=90)
