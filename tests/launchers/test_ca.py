"""Certificates every sandbox trusts from its start (``HANGAR_SANDBOX_CA_CERTS``): the bundle
mounted read-only at /.hangar/ca-certificates.crt, the variables that name it, and the
certificates added to the image's system store (Debian and RHEL layouts) once, whatever the
restarts; a launcher without a bundle changes nothing. Real runsc sandboxes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from runtime.host.images.store import ImageStore
from runtime.launchers.agent import ca
from runtime.launchers.base import ExecRequest, Launcher, SandboxSpec
from tests.launchers.helpers import make_launcher, remove_all, usable_launchers
from tests.support import requires_runsc

DEBIAN = "/etc/ssl/certs/ca-certificates.crt"
RHEL = "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem"
RHEL_LINK = "/etc/pki/tls/certs/ca-bundle.crt"
SUSE = "/etc/ssl/ca-bundle.pem"


def _cert(directory: Path, cn: str) -> bytes:
    out = directory / f"{cn}.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(directory / f"{cn}.key"), "-out", str(out), "-subj", f"/CN={cn}", "-days", "2"],
        check=True, capture_output=True,
    )  # fmt: skip
    return out.read_bytes()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, bytes]:
    d = tmp_path_factory.mktemp("certs")
    return {"image": _cert(d, "image-root"), "org": _cert(d, "org-inspection-ca")}


@pytest.fixture(scope="module")
def rootfs(image_store: ImageStore, tmp_path_factory, certs) -> Path:
    """busybox with a Debian store, a RHEL store (and its link), and a store that is a link
    to a device (what a sandbox could make of one before a restart)."""
    root = tmp_path_factory.mktemp("ca-rootfs") / "rootfs"
    shutil.copytree(image_store.build_busybox().rootfs, root, symlinks=True)
    for path in (DEBIAN, RHEL):
        (root / path[1:]).parent.mkdir(parents=True, exist_ok=True)
        (root / path[1:]).write_bytes(
            b"# the image's own\n" + certs["image"].rstrip(b"\n")
        )  # no final newline
    (root / RHEL_LINK[1:]).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(RHEL, root / RHEL_LINK[1:])
    os.symlink("/dev/zero", root / SUSE[1:])
    return root


@pytest.fixture(scope="module", params=usable_launchers())
def factory(request, tmp_path_factory, agent_cache_dir) -> Iterator[Callable[[str], Launcher]]:
    made: list[Launcher] = []

    def make(bundle: str) -> Launcher:
        launcher = make_launcher(request.param, tmp_path_factory.mktemp("ca-launcher"), agent_cache_dir,
                                 ca_certs=bundle, spare_disks=0)  # fmt: skip
        made.append(launcher)
        return launcher

    yield make
    for launcher in made:
        remove_all(launcher)


def sh(launcher: Launcher, handle: dict, script: str) -> str:
    r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", script], timeout=30))
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r.stdout.decode()


pytestmark = [requires_runsc]


def test_a_sandbox_trusts_the_bundle_from_its_start_and_its_store_gets_it_once(
    factory, rootfs, certs, tmp_path
):
    bundle = tmp_path / "bundle.pem"
    bundle.write_bytes(b"a comment first\r\n" + certs["org"].replace(b"\n", b"\r\n") + certs["image"])
    launcher = factory(str(bundle))
    spec = SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=rootfs, memory_mb=256, env={"GREETING": "hi"})
    handle = launcher.create(spec)

    env = dict(line.split("=", 1) for line in sh(launcher, handle, "env").splitlines() if "=" in line)
    for name in (
        "SSL_CERT_FILE",
        "NODE_EXTRA_CA_CERTS",
        "REQUESTS_CA_BUNDLE",
        "GIT_SSL_CAINFO",
        "CURL_CA_BUNDLE",
    ):
        assert env[name] == "/.hangar/ca-certificates.crt", name
    assert env["GREETING"] == "hi"
    mounted = ca.certificates(sh(launcher, handle, "cat /.hangar/ca-certificates.crt").encode())
    assert mounted[:2] == ca.certificates(bundle.read_bytes())
    # With the CAs the node itself trusts: the variables replace a tool's own list, so a bundle
    # of only the organisation's CA must not cost the sandbox the public ones.
    node_store = next((p for p in ca.SYSTEM_STORES if os.path.exists(p)), None)
    if node_store is not None:
        assert set(ca.read_bundle(node_store)) <= set(mounted)
    assert len(mounted) == len(set(mounted)), "each certificate once"
    r = launcher.exec(handle, ExecRequest(argv=["/bin/sh", "-c", "echo x >> /.hangar/ca-certificates.crt"]))
    assert r.exit_code != 0, "the bundle is read-only in the sandbox"

    def stores() -> dict[str, bytes]:
        return {p: sh(launcher, handle, f"cat {p}").encode() for p in (DEBIAN, RHEL, RHEL_LINK)}

    org, image = ca.certificates(certs["org"])[0], ca.certificates(certs["image"])[0]
    for path, text in stores().items():
        # The image's content stays first; the organisation's CA is added, the image's not again.
        assert text.startswith(b"# the image's own\n" + certs["image"].rstrip(b"\n") + b"\n"), path
        assert text.count(org) == 1 and text.count(image) == 1, path
    assert sh(launcher, handle, f"readlink {RHEL_LINK}").strip() == RHEL, "the link stays a link"
    assert sh(launcher, handle, f"readlink {SUSE}").strip() == "/dev/zero", "a device is left alone"

    # A restart over the same files (a stop-mode pause and resume) adds nothing twice.
    before = stores()
    launcher.suspend(launcher.handle_for(spec.id))
    handle = launcher.create(spec)
    assert stores() == before
    # Nor does a checkpoint and restore, and the sandbox still trusts it after one.
    if launcher.capabilities().checkpoint:
        launcher.checkpoint(handle)
        handle = launcher.restore(spec)
        assert stores() == before
        assert "/.hangar/ca-certificates.crt" in sh(launcher, handle, "echo $SSL_CERT_FILE")
        assert ca.certificates(sh(launcher, handle, "cat /.hangar/ca-certificates.crt").encode())[0] == org


def test_a_launcher_without_a_bundle_changes_nothing(factory, rootfs, certs):
    launcher = factory("")
    handle = launcher.create(SandboxSpec(id="t" + uuid.uuid4().hex[:12], rootfs=rootfs, memory_mb=256))
    env = sh(launcher, handle, "env")
    for name in ca.ENV_VARS:
        assert f"{name}=" not in env
    assert (
        sh(launcher, handle, "test -e /.hangar/ca-certificates.crt && echo there || echo absent")
        == "absent\n"
    )
    assert sh(launcher, handle, f"cat {DEBIAN}").encode() == b"# the image's own\n" + certs["image"].rstrip(
        b"\n"
    )


def test_a_bundle_without_certificates_is_refused_clearly(tmp_path):
    empty = tmp_path / "empty.pem"
    empty.write_text("no certificates here\n")
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        ca.read_bundle(empty)
    with pytest.raises(ValueError, match="cannot read"):
        ca.read_bundle(tmp_path / "missing.pem")
    # The setting fails loudly at start, naming itself.
    for path, why in ((empty, "holds no PEM certificate"), (tmp_path / "missing.pem", "cannot read")):
        r = subprocess.run(
            [sys.executable, "-c", "import dashboard.settings"],
            env={**os.environ, "HANGAR_SANDBOX_CA_CERTS": str(path), "HANGAR_DATA_DIR": str(tmp_path / "data")},
            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
        )  # fmt: skip
        assert r.returncode != 0 and "ImproperlyConfigured: HANGAR_SANDBOX_CA_CERTS" in r.stderr, r.stderr
        assert why in r.stderr
