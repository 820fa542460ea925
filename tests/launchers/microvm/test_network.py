"""What only the microVM's networks have (what every runtime's do is
tests/launchers/test_network.py's): a tap bridged to the sandbox's veth in its namespace, QEMU
in that namespace, the guest's own kernel holding the address, and the gVisor launcher of the
same node beside it, each reconciling only its own. Real QEMU, runsc and nftables; the "internet"
is the test namespace of tests/conftest.py's ``world``, nothing else is contacted."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.launchers.base import ExecRequest, SandboxSpec
from runtime.launchers.gvisor.launcher import GVisorLauncher
from runtime.launchers.microvm import boot
from runtime.launchers.microvm.launcher import MicroVMLauncher
from tests.launchers.helpers import listener, make_launcher, remove_all
from tests.support import WORLD_A as A
from tests.support import WORLD_B as B
from tests.support import requires_runsc

pytestmark = [
    requires_runsc,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, QEMU's tap)"),
    pytest.mark.skipif(boot.missing() is not None, reason=f"no microVM support here: {boot.missing()}"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="needs nft (nftables) to enforce egress"),
    pytest.mark.slow,
]


def sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture(scope="module")
def node(tmp_path_factory, agent_cache_dir) -> Iterator[tuple[MicroVMLauncher, GVisorLauncher]]:
    """Both launchers of one node: one node id (one table, one interface prefix), state dirs
    of their own, as runtime/node/local.py makes them."""
    root = tmp_path_factory.mktemp("node")
    microvm = make_launcher("microvm", root / "microvm", agent_cache_dir)
    gvisor = make_launcher("gvisor", root / "gvisor", agent_cache_dir, node_id=microvm.names.node_id)
    assert isinstance(microvm, MicroVMLauncher) and isinstance(gvisor, GVisorLauncher)
    yield microvm, gvisor
    for launcher in (microvm, gvisor):
        remove_all(launcher, network=False)  # their one node's tables, once both are empty
    gvisor.network.remove_base()
    microvm.network.remove_base()


@pytest.fixture(scope="module")
def busybox(image_store):
    return image_store.build_busybox()


def fetch(launcher, handle: dict, url: str) -> str | None:
    r = launcher.exec(handle, ExecRequest(argv=["sh", "-c", f"timeout 2 wget -q -O- {url}"], timeout=20))
    return r.stdout.decode() if r.exit_code == 0 else None


def test_the_guest_holds_the_address_on_a_tap_bridged_to_the_veth(node, busybox, world):
    microvm, _ = node
    assert microvm.capabilities().network and microvm.address_pool()
    spec = SandboxSpec(id="v" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                       network={"egress": "all"})  # fmt: skip
    h = microvm.create(spec)
    try:
        lease = microvm.network.lease_of(spec.id)
        assert lease.netns.startswith(f"hangarvm-{microvm.names.node_id}-")
        inside = sh("ip", "-n", lease.netns, "-o", "link").stdout
        assert "tap0" in inside and "br0" in inside, inside
        # The namespace holds no address of the sandbox's: the guest's kernel does.
        assert lease.sandbox_ip not in sh("ip", "-n", lease.netns, "-o", "addr").stdout
        addrs = microvm.exec(h, ExecRequest(argv=["ip", "-o", "addr", "show", "eth0"])).stdout.decode()
        assert f"{lease.sandbox_ip}/{lease.prefix}" in addrs, addrs
        assert fetch(microvm, h, f"http://{A}:8080/") == "server-a\n"
        # QEMU runs in the namespace; only its own address leaves it.
        assert os.stat(f"/proc/{h['qemu_pid']}/ns/net").st_ino == os.stat(lease.netns_path).st_ino
        rules = sh(
            "nft", "list", "chain", "inet", microvm.names.table, microvm.network.chain_of(spec.id)
        ).stdout
        assert f"ip saddr != {lease.sandbox_ip} drop" in rules
        microvm.destroy(h)
        assert not Path(lease.netns_path).exists()  # the tap and bridge went with it
    finally:
        microvm.destroy(microvm.handle_for(spec.id))


def test_the_gvisor_launcher_of_the_same_node_never_takes_a_microvms_network_for_a_leftover(
    node, busybox, world
):
    microvm, gvisor = node
    assert microvm.names.table == gvisor.names.table
    assert not microvm.network.pool.overlaps(gvisor.network.pool)
    vm_spec = SandboxSpec(id="v" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                          network={"egress": "all"})  # fmt: skip
    gv_spec = SandboxSpec(id="g" + uuid.uuid4().hex[:12], rootfs=busybox.rootfs, memory_mb=256,
                          network={"egress": "all"})  # fmt: skip
    vm, gv = microvm.create(vm_spec), gvisor.create(gv_spec)
    try:
        # Each reconciles knowing only its own sandboxes (as node_reconcile calls them).
        assert gvisor.network_reconcile({gv_spec.id: {"egress": "all"}}) == []
        assert microvm.network_reconcile({vm_spec.id: {"egress": "all"}}) == []
        assert fetch(microvm, vm, f"http://{A}:8080/") == "server-a\n"
        assert fetch(gvisor, gv, f"http://{B}:8080/") == "server-b\n"
        # And neither reaches the other.
        gv_ip = gvisor.network.lease_of(gv_spec.id).sandbox_ip
        with listener(gvisor, gv, gv_ip, 9000):  # it answers on its own address
            r = microvm.exec(
                vm, ExecRequest(argv=["sh", "-c", f"echo x | timeout 2 nc {gv_ip} 9000"], timeout=20)
            )
            assert r.exit_code != 0 and b"hi" not in r.stdout, r
    finally:
        microvm.destroy(microvm.handle_for(vm_spec.id))
        gvisor.destroy(gvisor.handle_for(gv_spec.id))
