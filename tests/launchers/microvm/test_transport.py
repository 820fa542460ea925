"""How the node reaches a microVM's agent: the virtio-serial port, or vsock where the node has
``/dev/vhost-vsock`` (``transport`` in the launcher's config). This host has no vhost-vsock, so
no VM runs over vsock here (docs/microvm.md says so); these check the choice and what QEMU and
the guest's kernel are told, with the device stood in for. The guest's end that takes the next
host end is tested in test_mux.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime.launchers.base import LauncherError, SandboxSpec
from runtime.launchers.microvm import boot
from runtime.launchers.microvm.launcher import MicroVMLauncher


@pytest.fixture
def kernel_dir(tmp_path) -> Path:
    """A guest kernel laid out as install-microvm.sh lays it out (never booted here)."""
    d = tmp_path / "kernel"
    (d / "modules").mkdir(parents=True)
    (d / "vmlinuz").write_bytes(b"\0")
    (d / "version").write_text("6.1.0-test\n")
    (d / "modules.list").write_text("virtio_mmio.ko\nvsock.ko\nvmw_vsock_virtio_transport.ko\n")
    return d


def _launcher(tmp_path: Path, kernel_dir: Path, transport: str) -> MicroVMLauncher:
    return MicroVMLauncher(tmp_path / "state", kernel_dir=str(kernel_dir), accel="tcg", transport=transport)


def _argv(launcher: MicroVMLauncher, tmp_path: Path) -> tuple[dict, list[str]]:
    spec = SandboxSpec(id="sbtransport01", rootfs=tmp_path)
    kern = boot.kernel(launcher.kernel_dir)
    handle = {"id": spec.id, "dir": str(tmp_path / "sb"), "accel": "tcg", "vcpus": 1, "link": launcher.link()}
    if handle["link"] == "vsock":
        handle["cid"] = 4242
    return handle, launcher._qemu_argv(
        spec, handle, kern, tmp_path / "initrd", tmp_path / "root", tmp_path / "disk"
    )


def test_without_vhost_vsock_auto_takes_the_serial_port_and_vsock_says_why_not(
    tmp_path, kernel_dir, monkeypatch
):
    monkeypatch.setattr(boot, "VHOST_VSOCK", str(tmp_path / "no-vhost-vsock"))
    handle, argv = _argv(_launcher(tmp_path, kernel_dir, "auto"), tmp_path)
    assert handle["link"] == "serial"
    assert "virtserialport,chardev=agent,name=hangar" in argv
    assert not any("vhost-vsock-device" in a or "hangar.link=" in a for a in argv)
    with pytest.raises(LauncherError, match="vhost-vsock"):
        _launcher(tmp_path, kernel_dir, "vsock").link()


def test_with_vhost_vsock_the_vm_gets_the_device_its_cid_and_the_port_to_listen_on(
    tmp_path, kernel_dir, monkeypatch
):
    monkeypatch.setattr(boot, "VHOST_VSOCK", "/dev/null")  # stands in: a device the node can open
    for transport in ("auto", "vsock"):
        handle, argv = _argv(_launcher(tmp_path, kernel_dir, transport), tmp_path)
        assert handle["link"] == "vsock"
        assert argv[argv.index("vhost-vsock-device,guest-cid=4242") - 1] == "-device"
        assert f"hangar.link=vsock:{boot.VSOCK_PORT}" in argv[argv.index("-append") + 1]
        assert not any("virtserial" in a or "vm.sock" in a for a in argv)
    # The node's config can keep the port where vsock is there.
    assert _argv(_launcher(tmp_path, kernel_dir, "serial"), tmp_path)[0]["link"] == "serial"


def test_a_guest_kernel_unpacked_without_vsocks_modules_is_named(tmp_path, kernel_dir, monkeypatch):
    monkeypatch.setattr(boot, "VHOST_VSOCK", "/dev/null")
    monkeypatch.setattr(boot, "DEFAULT_KERNEL_DIR", kernel_dir)
    (kernel_dir / "modules.list").write_text("virtio_mmio.ko\n")
    assert "without vsock's modules" in (boot.vsock_missing(boot.kernel(str(kernel_dir))) or "")
    assert _launcher(tmp_path, kernel_dir, "auto").link() == "serial"


def test_an_unknown_transport_is_refused(tmp_path, kernel_dir):
    with pytest.raises(LauncherError, match="auto, serial or vsock"):
        _launcher(tmp_path, kernel_dir, "carrier-pigeon")
