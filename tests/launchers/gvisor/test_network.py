"""Sandbox networks against real runsc and nftables: egress none / allowlist / all, changed
while running, host names pinned, the host and other sandboxes always out of reach, and
nothing left behind. The "internet" is a network namespace made here (a /24 of 198.18.0.0/16, the
benchmarking range) with two web servers; nothing else is ever contacted."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from runtime.launchers.base import ExecRequest, SandboxSpec
from runtime.launchers.gvisor.launcher import GVisorLauncher
from tests.support import WORLD_A as A
from tests.support import WORLD_B as B
from tests.support import WORLD_GW, requires_runsc

pytestmark = [
    requires_runsc,
    pytest.mark.skipif(
        shutil.which("nft") is None,
        reason="needs nft (nftables) to enforce egress; scripts/install-system-deps.sh installs it, so this skips only where it was left out",
    ),
]


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, agent_cache_dir):
    state = tmp_path_factory.mktemp("launcher-net")
    # Names and a pool of its own (its state dir keeps an id of its own), so it cannot meet a
    # real node's sandboxes on this machine.
    launcher = GVisorLauncher(state_dir=state, agent_cache_dir=agent_cache_dir)
    yield launcher
    for sandbox_id in launcher.states():
        launcher.destroy(launcher.handle_for(sandbox_id))
    launcher.release_spares()
    launcher.network.remove_base()


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()


@pytest.fixture
def boot(launcher, busybox, world):
    made: list[str] = []

    def start(network: dict | None) -> dict:
        spec = SandboxSpec(
            id="n" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256, network=network
        )
        made.append(spec.id)
        return launcher.create(spec)

    yield start
    for sandbox_id in made:
        launcher.destroy(launcher.handle_for(sandbox_id))


def fetch(launcher, handle: dict, url: str) -> str | None:
    """The body at url from inside the sandbox, or None if it cannot be reached (2 s)."""
    # busybox's own wget -T crashes under gVisor; timeout(1) bounds it instead.
    r = launcher.exec(handle, ExecRequest(argv=["sh", "-c", f"timeout 2 wget -q -O- {url}"], timeout=20))
    return r.stdout.decode() if r.exit_code == 0 else None


def test_an_allowlist_lets_through_only_what_it_lists_and_changes_apply_at_once(launcher, boot):
    h = boot({"egress": "allowlist", "allow": [f"{A}:8080"]})
    assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"
    assert fetch(launcher, h, f"http://{B}:8080/") is None
    launcher.set_network(h, {"egress": "all"})
    assert fetch(launcher, h, f"http://{B}:8080/") == "server-b\n"
    launcher.set_network(h, {"egress": "none"})
    assert fetch(launcher, h, f"http://{A}:8080/") is None
    launcher.set_network(h, {"egress": "allowlist", "allow": [f"{B}/32"]})
    assert fetch(launcher, h, f"http://{B}:8080/") == "server-b\n"
    assert fetch(launcher, h, f"http://{A}:8080/") is None


def test_the_host_and_other_sandboxes_are_out_of_reach_whatever_the_policy(launcher, boot):
    # A service on the host, on every address (as Postgres or Redis could be).
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    port = server.getsockname()[1]
    accepted: list = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end of the test, unaccepted
            accepted.append(server.accept())

    threading.Thread(target=accept, daemon=True).start()
    h = boot({"egress": "all"})
    other = boot({"egress": "all"})
    lease, other_lease = launcher.network.lease_of(h["id"]), launcher.network.lease_of(other["id"])
    assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"  # the internet: yes
    # Its gateway (the host), the host's address toward the world, and the other sandbox: no.
    launcher.exec(other, ExecRequest(argv=["sh", "-c", "nc -ll -p 9000 -e echo hi &"]))
    for addr, p in ((lease.host_ip, port), (WORLD_GW, port), (other_lease.sandbox_ip, 9000)):
        r = launcher.exec(h, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {addr} {p}"], timeout=20))
        assert r.exit_code != 0 and b"hi" not in r.stdout, (addr, r)
    # Listing them changes nothing: they are denied before any policy.
    launcher.set_network(h, {"egress": "allowlist", "allow": [
        f"{lease.host_ip}:{port}", f"{WORLD_GW}:{port}", f"{other_lease.sandbox_ip}:9000"]})  # fmt: skip
    for addr, p in ((lease.host_ip, port), (WORLD_GW, port), (other_lease.sandbox_ip, 9000)):
        r = launcher.exec(h, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {addr} {p}"], timeout=20))
        assert r.exit_code != 0 and b"hi" not in r.stdout, (addr, r)
    assert not accepted
    # Link-local (cloud metadata) is refused too, allowlisted or not.
    launcher.set_network(h, {"egress": "allowlist", "allow": ["169.254.169.254"]})
    rules = sh("nft", "list", "chain", "inet", launcher.names.table, f"sb_{h['id']}").stdout
    assert rules.index("169.254.0.0/16") < rules.index("169.254.169.254")  # denied before allowed
    server.close()


def test_host_names_are_resolved_by_the_host_pinned_and_followed(launcher, boot):
    answers = {"api.world.test": [B]}
    launcher.network.resolve = lambda host: list(answers.get(host, []))
    policy = {"egress": "allowlist", "allow": ["api.world.test:8080"]}
    h = boot(policy)
    hosts = launcher.exec(h, ExecRequest(argv=["cat", "/etc/hosts"])).stdout.decode()
    assert f"{B}\tapi.world.test" in hosts
    assert fetch(launcher, h, "http://api.world.test:8080/") == "server-b\n"
    # The name moves: the next reconciliation follows it, rules and /etc/hosts alike.
    answers["api.world.test"] = [A]
    launcher.network_reconcile({h["id"]: policy})
    assert fetch(launcher, h, "http://api.world.test:8080/") == "server-a\n"
    assert fetch(launcher, h, f"http://{B}:8080/") is None


def test_nothing_is_left_behind_and_reconciliation_removes_leftovers(launcher, boot):
    h = boot({"egress": "all"})
    lease = launcher.network.lease_of(h["id"])
    assert Path(lease.netns_path).exists()
    launcher.destroy(launcher.handle_for(h["id"]))
    assert launcher.network.lease_of(h["id"]) is None
    assert not Path(lease.netns_path).exists()
    assert sh("ip", "link", "show", lease.veth, check=False).returncode != 0
    assert f"sb_{h['id']}" not in sh("nft", "list", "table", "inet", launcher.names.table).stdout
    # A crash leaves a namespace, a veth, rules and a lease: reconciliation removes them.
    h2 = boot({"egress": "all"})
    lease2 = launcher.network.lease_of(h2["id"])
    subprocess.run(
        [launcher.runsc.binary, "--root", str(launcher.runsc.root), "kill", "--all", h2["id"], "KILL"],
        check=False,
    )
    time.sleep(0.5)
    subprocess.run(
        [launcher.runsc.binary, "--root", str(launcher.runsc.root), "delete", "--force", h2["id"]],
        check=False,
    )
    assert launcher.network_reconcile({}) == [h2["id"]]
    assert launcher.network.lease_of(h2["id"]) is None and not Path(lease2.netns_path).exists()
    assert f"sb_{h2['id']}" not in sh("nft", "list", "table", "inet", launcher.names.table).stdout


def test_a_sandbox_without_egress_has_no_network_and_cannot_be_given_one_while_running(launcher, boot):
    from runtime.launchers.base import LauncherError

    h = boot(None)
    assert launcher.network.lease_of(h["id"]) is None
    assert fetch(launcher, h, f"http://{A}:8080/") is None
    with pytest.raises(LauncherError, match="started without a network"):
        launcher.set_network(h, {"egress": "all"})
    launcher.set_network(h, {"egress": "none"})  # nothing to change: fine


def test_a_paused_sandbox_gets_its_network_back_when_it_starts_again(launcher, busybox, world):
    spec = SandboxSpec(id="n" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                       network={"egress": "allowlist", "allow": [f"{A}:8080"]})  # fmt: skip
    h = launcher.create(spec)
    try:
        launcher.suspend(launcher.handle_for(spec.id))
        assert launcher.network.lease_of(spec.id) is None  # a paused sandbox holds no addresses
        h = launcher.create(spec)
        assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"
        assert fetch(launcher, h, f"http://{B}:8080/") is None
    finally:
        launcher.destroy(launcher.handle_for(spec.id))


def test_no_record_of_a_sandbox_outlives_it_and_reconciliation_removes_stray_ones(launcher, boot):
    """Its lease, applied policy and pinned names (written by a refresh) all go with it; and a
    record alone (a crash between two removals) is found and removed by reconciliation."""
    launcher.network.resolve = lambda host: [A] if host == "api.world.test" else []
    policy = {"egress": "allowlist", "allow": ["api.world.test:8080"]}
    h = boot(policy)
    launcher.network_reconcile({h["id"]: policy})  # the first refresh pins the names it resolved
    leases = launcher.network.dir / "leases"
    assert (leases / f"{h['id']}.names").exists()
    launcher.destroy(launcher.handle_for(h["id"]))
    assert not [p.name for p in leases.iterdir() if p.name.startswith(h["id"])]
    (leases / "sbstray.names").write_text("{}")
    (leases / "sbstray2.policy").write_text("{}")
    assert set(launcher.network_reconcile({})) >= {"sbstray", "sbstray2"}
    assert not [p.name for p in leases.iterdir() if p.name.startswith("sbstray")]


def test_two_nodes_on_one_machine_never_touch_each_others_networks(launcher, boot, busybox, world, tmp_path,
                                                                   agent_cache_dir):  # fmt: skip
    """Another Hangar on this machine (its own state dir, so its own id): its own table, names,
    cgroups and pool, and its reconciliation leaves this one's sandboxes alone (and the reverse)."""
    other = GVisorLauncher(state_dir=tmp_path / "other-node", agent_cache_dir=agent_cache_dir)
    assert other.names.node_id != launcher.names.node_id
    mine = boot({"egress": "all"})
    theirs_spec = SandboxSpec(id="n" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                              network={"egress": "all"})  # fmt: skip
    theirs = other.create(theirs_spec)
    try:
        assert not launcher.network.pool.overlaps(other.network.pool)
        lease, their_lease = launcher.network.lease_of(mine["id"]), other.network.lease_of(theirs["id"])
        assert (
            their_lease.veth.startswith(other.names.iface_prefix) and their_lease.table == other.names.table
        )
        assert f"sb_{theirs['id']}" not in sh("nft", "list", "table", "inet", launcher.names.table).stdout
        # Each reconciles knowing only its own sandboxes: neither removes the other's.
        assert launcher.network_reconcile({mine["id"]: {"egress": "all"}}) == []
        assert other.network_reconcile({theirs["id"]: {"egress": "all"}}) == []
        assert Path(lease.netns_path).exists() and Path(their_lease.netns_path).exists()
        assert fetch(launcher, mine, f"http://{A}:8080/") == "server-a\n"
        assert fetch(other, theirs, f"http://{B}:8080/") == "server-b\n"
        # The other's whole node going away leaves this one's sandbox working.
        other.destroy(other.handle_for(theirs["id"]))
        other.network.remove_base()
        assert fetch(launcher, mine, f"http://{A}:8080/") == "server-a\n"
        assert sh("nft", "list", "table", "inet", other.names.table, check=False).returncode != 0
    finally:
        other.destroy(other.handle_for(theirs_spec.id))
        other.network.remove_base()
        other.release_spares()
