"""Sandbox networks against real runsc and nftables: egress none / allowlist / all, changed
while running, host names pinned, the host and other sandboxes always out of reach, and
nothing left behind. The "internet" is a network namespace made here (198.18.0.0/24, the
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
from runtime.launchers.gvisor import GVisorLauncher
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
    # A pool of its own, so it cannot meet a real node's sandboxes on this machine.
    launcher = GVisorLauncher(state_dir=state, agent_cache_dir=agent_cache_dir, network_pool="10.89.0.0/24")
    yield launcher
    for sandbox_id in launcher.list():
        launcher.destroy_id(sandbox_id)
    launcher.disks.drain()


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
        launcher.destroy_id(sandbox_id)


def fetch(launcher, handle: dict, url: str) -> str | None:
    """The body at url from inside the sandbox, or None if it cannot be reached (2 s)."""
    # busybox's own wget -T crashes under gVisor; timeout(1) bounds it instead.
    r = launcher.exec(handle, ExecRequest(argv=["sh", "-c", f"timeout 2 wget -q -O- {url}"], timeout=20))
    return r.stdout.decode() if r.exit_code == 0 else None


def test_an_allowlist_lets_through_only_what_it_lists_and_changes_apply_at_once(launcher, boot):
    h = boot({"egress": "allowlist", "allow": [f"{A}:8080"]})
    assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"
    assert fetch(launcher, h, f"http://{B}:8080/") is None
    launcher.set_network(h["id"], {"egress": "all"})
    assert fetch(launcher, h, f"http://{B}:8080/") == "server-b\n"
    launcher.set_network(h["id"], {"egress": "none"})
    assert fetch(launcher, h, f"http://{A}:8080/") is None
    launcher.set_network(h["id"], {"egress": "allowlist", "allow": ["198.18.0.3/32"]})
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
    for addr, p in ((lease.host_ip, port), ("198.18.0.1", port), (other_lease.sandbox_ip, 9000)):
        r = launcher.exec(h, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {addr} {p}"], timeout=20))
        assert r.exit_code != 0 and b"hi" not in r.stdout, (addr, r)
    # Listing them changes nothing: they are denied before any policy.
    launcher.set_network(h["id"], {"egress": "allowlist", "allow": [
        f"{lease.host_ip}:{port}", f"198.18.0.1:{port}", f"{other_lease.sandbox_ip}:9000"]})  # fmt: skip
    for addr, p in ((lease.host_ip, port), ("198.18.0.1", port), (other_lease.sandbox_ip, 9000)):
        r = launcher.exec(h, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {addr} {p}"], timeout=20))
        assert r.exit_code != 0 and b"hi" not in r.stdout, (addr, r)
    assert not accepted
    # Link-local (cloud metadata) is refused too, allowlisted or not.
    launcher.set_network(h["id"], {"egress": "allowlist", "allow": ["169.254.169.254"]})
    rules = sh("nft", "list", "chain", "inet", "hangar", f"sb_{h['id']}").stdout
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
    launcher.destroy_id(h["id"])
    assert launcher.network.lease_of(h["id"]) is None
    assert not Path(lease.netns_path).exists()
    assert sh("ip", "link", "show", lease.veth, check=False).returncode != 0
    assert f"sb_{h['id']}" not in sh("nft", "list", "table", "inet", "hangar").stdout
    # A crash leaves a namespace, a veth, rules and a lease: reconciliation removes them.
    h2 = boot({"egress": "all"})
    lease2 = launcher.network.lease_of(h2["id"])
    subprocess.run(
        [launcher.runsc, "--root", str(launcher.root), "kill", "--all", h2["id"], "KILL"], check=False
    )
    time.sleep(0.5)
    subprocess.run([launcher.runsc, "--root", str(launcher.root), "delete", "--force", h2["id"]], check=False)
    assert launcher.network_reconcile({}) == [h2["id"]]
    assert launcher.network.lease_of(h2["id"]) is None and not Path(lease2.netns_path).exists()
    assert f"sb_{h2['id']}" not in sh("nft", "list", "table", "inet", "hangar").stdout


def test_a_sandbox_without_egress_has_no_network_and_cannot_be_given_one_while_running(launcher, boot):
    from runtime.launchers.base import LauncherError

    h = boot(None)
    assert launcher.network.lease_of(h["id"]) is None
    assert fetch(launcher, h, f"http://{A}:8080/") is None
    with pytest.raises(LauncherError, match="started without a network"):
        launcher.set_network(h["id"], {"egress": "all"})
    launcher.set_network(h["id"], {"egress": "none"})  # nothing to change: fine


def test_a_paused_sandbox_gets_its_network_back_when_it_starts_again(launcher, busybox, world):
    spec = SandboxSpec(id="n" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                       network={"egress": "allowlist", "allow": [f"{A}:8080"]})  # fmt: skip
    h = launcher.create(spec)
    try:
        launcher.suspend(spec.id)
        assert launcher.network.lease_of(spec.id) is None  # a paused sandbox holds no addresses
        h = launcher.create(spec)
        assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"
        assert fetch(launcher, h, f"http://{B}:8080/") is None
    finally:
        launcher.destroy_id(spec.id)
