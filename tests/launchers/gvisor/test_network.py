"""What only gVisor's sandbox networks have, against real runsc and nftables: a crashed
sandbox's leftovers, and two nodes on one machine (what every runtime's networks do, egress
none / allowlist / all, changed while running, the host out of reach, is
tests/launchers/test_network.py's). The "internet" is a network namespace made here (a /24 of 198.18.0.0/16, the
benchmarking range) with two web servers; nothing else is ever contacted."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from runtime.launchers.base import ExecRequest, SandboxSpec
from runtime.launchers.gvisor.launcher import GVisorLauncher
from tests.support import WORLD_A as A
from tests.support import WORLD_B as B
from tests.support import requires_runsc

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


def test_reconciliation_removes_what_a_crashed_sandbox_left(launcher, boot):
    # A crash leaves a namespace, a veth, rules and a lease: reconciliation removes them.
    # (What every runtime's sandboxes leave, or not, is tests/launchers/test_network.py's.)
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
