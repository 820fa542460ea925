"""Sandbox networks against every runtime that gives them (gVisor; the QEMU microVM, whose guest
kernel sits on a tap bridged to the same veth), with real nftables: egress none / allowlist /
all, changed while running, host names pinned, the host, other sandboxes and the metadata range
always out of reach, and nothing left behind. The "internet" is a network namespace made here
(a /24 of 198.18.0.0/16, the benchmarking range) with two web servers; nothing else is ever
contacted. What only one runtime has is tested under tests/launchers/<name>/test_network.py."""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.launchers.base import ExecRequest, Launcher, LauncherError, ProcessRequest, SandboxSpec
from tests.launchers.helpers import listener, make_launcher, remove_all, usable_launchers
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


@pytest.fixture(scope="module", params=usable_launchers())
def launcher(request, tmp_path_factory, agent_cache_dir) -> Iterator[Launcher]:
    # Names and a pool of its own (its state dir keeps an id of its own), so it cannot meet a
    # real node's sandboxes on this machine.
    launcher = make_launcher(request.param, tmp_path_factory.mktemp(f"net-{request.param}"), agent_cache_dir)
    if not launcher.capabilities().network:
        # Its refusal of a network is the conformance suite's (test_a_runtime_gives_a_network_…).
        pytest.skip(f"the {request.param} runtime gives sandboxes no network here")
    yield launcher
    remove_all(launcher)


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()


@pytest.fixture
def boot(launcher, busybox, world) -> Iterator[Callable[[dict | None], dict]]:
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


def chain(launcher, sandbox_id: str) -> str:
    return sh(
        "nft", "list", "chain", "inet", launcher.names.table, launcher.network.chain_of(sandbox_id)
    ).stdout


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


def test_egress_none_with_a_network_reaches_nothing(launcher, boot):
    """A network asked for with egress none (a warm pool's member): an interface, and nothing
    through it until a policy says so."""
    h = boot({"egress": "none"})
    assert b"eth0" in launcher.exec(h, ExecRequest(argv=["cat", "/proc/net/dev"])).stdout
    assert fetch(launcher, h, f"http://{A}:8080/") is None
    launcher.set_network(h, {"egress": "all"})
    assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"


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
    # And the node's real services on their own ports, at every address the sandbox could try
    # (Postgres and Redis listen on the host's loopback here: the sandbox's 127.0.0.1 is its own).
    services = [(a, p) for a in (lease.host_ip, "127.0.0.1") for p in (5432, 6379)]
    with listener(launcher, other, other_lease.sandbox_ip, 9000):  # it answers on its own address
        for addr, p in ((lease.host_ip, port), (WORLD_GW, port), (other_lease.sandbox_ip, 9000), *services):
            r = launcher.exec(
                h, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {addr} {p}"], timeout=20)
            )
            assert r.exit_code != 0 and b"hi" not in r.stdout, (addr, r)
        # Listing them changes nothing: they are denied before any policy.
        launcher.set_network(h, {"egress": "allowlist", "allow": [
            f"{lease.host_ip}:{port}", f"{WORLD_GW}:{port}", f"{other_lease.sandbox_ip}:9000"]})  # fmt: skip
        for addr, p in ((lease.host_ip, port), (WORLD_GW, port), (other_lease.sandbox_ip, 9000)):
            r = launcher.exec(
                h, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {addr} {p}"], timeout=20)
            )
            assert r.exit_code != 0 and b"hi" not in r.stdout, (addr, r)
    assert not accepted
    # Link-local (cloud metadata) is refused too, allowlisted or not: judged by the rules'
    # order, never by contacting a real metadata address.
    launcher.set_network(h, {"egress": "allowlist", "allow": ["169.254.169.254"]})
    rules = chain(launcher, h["id"])
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


def test_destroy_leaves_no_namespace_interface_rule_or_record(launcher, boot):
    h = boot({"egress": "all"})
    lease = launcher.network.lease_of(h["id"])
    assert Path(lease.netns_path).exists()
    leases = launcher.network.dir / "leases"
    inside = sh("ip", "-n", lease.netns, "-o", "link").stdout  # a microVM's: its tap and bridge too
    assert "eth0" in inside
    launcher.destroy(launcher.handle_for(h["id"]))
    assert launcher.network.lease_of(h["id"]) is None
    # The namespace goes, and with it everything in it (a microVM's tap and bridge).
    assert not Path(lease.netns_path).exists()
    assert sh("ip", "-n", lease.netns, "link", check=False).returncode != 0
    assert sh("ip", "link", "show", lease.veth, check=False).returncode != 0
    assert (
        launcher.network.chain_of(h["id"])
        not in sh("nft", "list", "table", "inet", launcher.names.table).stdout
    )
    assert not [p.name for p in leases.iterdir() if p.name.startswith(h["id"])]


def test_a_sandbox_without_egress_has_no_network_and_cannot_be_given_one_while_running(launcher, boot):
    h = boot(None)
    assert launcher.network.lease_of(h["id"]) is None
    assert b"eth0" not in launcher.exec(h, ExecRequest(argv=["cat", "/proc/net/dev"])).stdout
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


def test_a_checkpointed_sandbox_is_restored_onto_a_network_of_that_moment(launcher, busybox, world):
    """Restored, a checkpointed sandbox has its network, its processes running on. A runtime
    that keeps the address for it (gVisor: its saved network stack holds it) gets it back; one
    that gives it back while paused (the microVM) may find it taken, and takes another: the
    guest moves to it."""
    if not launcher.capabilities().checkpoint:
        pytest.skip(f"the {launcher.name} runtime has no checkpoints")
    spec = SandboxSpec(id="n" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                       network={"egress": "allowlist", "allow": [f"{A}:8080"]})  # fmt: skip
    net = launcher.network  # type: ignore[attr-defined]
    h = launcher.create(spec)
    try:
        first = net.lease_of(spec.id)
        sleeper = launcher.open_process(h, ProcessRequest(argv=["sleep", "600"]))
        launcher.checkpoint(h)
        if net.lease_of(spec.id) is None:
            # Given back: a sandbox whose first choice of slot is that one takes it meanwhile.
            taker = next(i for i in ("n" + uuid.uuid4().hex[:12] for _ in range(10**6))
                         if int(hashlib.sha1(i.encode()).hexdigest(), 16) % net.slots == first.index)  # fmt: skip
            launcher.create(
                SandboxSpec(id=taker, rootfs=busybox.rootfs, memory_mb=128, network={"egress": "none"})
            )
            try:
                assert net.lease_of(taker).sandbox_ip == first.sandbox_ip
                h = launcher.restore(spec)
            finally:
                launcher.destroy(launcher.handle_for(taker))
            assert net.lease_of(spec.id).sandbox_ip != first.sandbox_ip
        else:
            h = launcher.restore(spec)
            assert net.lease_of(spec.id) == first
        assert fetch(launcher, h, f"http://{A}:8080/") == "server-a\n"
        assert fetch(launcher, h, f"http://{B}:8080/") is None
        ps = launcher.exec(h, ExecRequest(argv=["ps", "-o", "args"])).stdout
        assert b"sleep 600" in ps  # the same processes, not a fresh start
        sleeper.close()
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
