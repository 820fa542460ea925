"""HANGAR_SANDBOX_CA_CERTS for real: on a network that inspects TLS (this machine's), a harness
with ``agent: claude-code`` on the ``base`` image installs the agent's package from the npm
registry and its CLI answers ``--version`` once its node is given the node's system CA bundle;
a sandbox of a node without the setting fails (npm: SELF_SIGNED_CERT_IN_CHAIN).

Two nodes on this machine, sharing its data dir: the session's worker (no bundle) and a second
worker started here with the setting. Each holds ``base`` in turn, so the scheduler sends each
sandbox where the test wants it; this process plays the control plane of the node it creates on
(a harness's volume is made on the creating process's node)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model

from runtime.models import Harness, HarnessLogEntry, Image, Membership, Sandbox, Team
from runtime.node.local import local_capabilities, node_memory_mb
from runtime.services import harnesses as harness_svc
from runtime.services import sandbox_io as io_svc
from runtime.services import sandboxes as sandbox_svc
from runtime.services.images import image_register
from runtime.services.nodes import node_register
from tests.support import die_with_parent, requires_runsc, wait_until

SYSTEM_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
ROOT = Path(__file__).resolve().parents[2]


def _registry_reachable() -> bool:
    try:
        socket.create_connection(("registry.npmjs.org", 443), timeout=5).close()
    except OSError:
        return False
    return True


pytestmark = [
    requires_runsc,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        not SYSTEM_BUNDLE.is_file(), reason=f"needs the node's system CA bundle {SYSTEM_BUNDLE}"
    ),
    pytest.mark.skipif(not _registry_reachable(), reason="needs the npm registry (registry.npmjs.org:443)"),
]


@pytest.fixture
def ca_node(celery_worker, local_node, service_env, settings) -> Iterator[str]:
    """A second node on this machine whose worker has HANGAR_SANDBOX_CA_CERTS set."""
    name = f"{settings.HANGAR_NODE_NAME}-ca"
    node_register(name=name, launchers=local_capabilities(), cpu=4, memory_mb=min(node_memory_mb(), 16384))
    log_path = Path(tempfile.mkdtemp()) / "ca-worker.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "dashboard", "worker", "-Q", f"node.{name}", "-n", f"{name}@%h",
             "--pool", "threads", "--concurrency", "4", "--loglevel", "INFO", "--without-gossip",
             "--without-mingle", "--without-heartbeat"],
            cwd=ROOT, env={**service_env, "HANGAR_NODE_NAME": name, "HANGAR_SANDBOX_CA_CERTS": str(SYSTEM_BUNDLE)},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent,
        )  # fmt: skip
    try:
        wait_until(
            lambda: b"ready." in log_path.read_bytes() or proc.poll() is not None, 60, what="CA worker"
        )
        assert proc.poll() is None, log_path.read_text()
        yield name
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _hold_base_only_on(node_name: str, info) -> None:
    image = image_register(info=info, name="base", node_name=node_name)
    for node in image.nodes.exclude(name=node_name):
        image.nodes.remove(node)


def _log(h: Harness) -> str:
    return "\n".join(HarnessLogEntry.objects.filter(harness=h).order_by("id").values_list("text", flat=True))


def test_a_harness_installs_a_real_agent_through_an_inspecting_proxy_with_the_nodes_ca(
    ca_node, local_node, base_image_info, settings
):
    info, _ = base_image_info
    user = get_user_model().objects.create_user(username="ada", password="pw")
    team = Team.objects.create(name="ca")
    Membership.objects.create(user=user, team=team, role=Membership.Role.OWNER)

    # Without the setting: a sandbox of the session's node trusts only its image's store.
    _hold_base_only_on(local_node.name, info)
    spec = sandbox_svc.SandboxRequest(image="base", memory_mb=1024, network={"egress": "all"})
    plain = sandbox_svc.sandbox_create(team=team, user=user, request=spec)
    plain = sandbox_svc.sandbox_wait(sandbox=plain, timeout=120)
    assert plain.status == Sandbox.Status.RUNNING and plain.node.name == local_node.name, plain.status_reason
    curl = io_svc.sandbox_exec(sandbox=plain, cmd="curl -sS -o /dev/null https://registry.npmjs.org/").result
    if curl.exit_code != 0:  # this network inspects TLS (no proof to give where it does not)
        npm = io_svc.sandbox_exec(
            sandbox=plain, cmd="npm view --fetch-retries=0 @anthropic-ai/claude-code version", timeout_s=120
        ).result
        assert npm.exit_code != 0 and b"SELF_SIGNED_CERT_IN_CHAIN" in npm.stdout + npm.stderr, npm
    sandbox_svc.sandbox_delete(sandbox=plain)

    # With it: a harness on the CA node sets itself up from the real registry.
    _hold_base_only_on(ca_node, info)
    settings.HANGAR_NODE_NAME = ca_node  # this process creates its volume there
    h = harness_svc.harness_create(team=team, user=user, name="claude", agent="claude-code", image="base",
                                   memory_mb=2048, disk_mb=3072, network={"egress": "all"})  # fmt: skip

    def set_up() -> bool:
        h.refresh_from_db()
        return h.setup in (Harness.Setup.DONE, Harness.Setup.FAILED)

    wait_until(set_up, 1000, interval=1, what="the harness's setup")
    assert h.setup == Harness.Setup.DONE, f"{h.setup_error}\n{_log(h)[-3000:]}"
    assert h.sandbox.node.name == ca_node
    assert "installing @anthropic-ai/claude-code" in _log(h)
    assert re.match(r"\d+\.\d+\.\d+", h.agent_version), h.agent_version
    out = io_svc.sandbox_exec(sandbox=h.sandbox, cmd="claude --version; echo $NODE_EXTRA_CA_CERTS").result
    assert out.exit_code == 0, out
    version, bundle = out.stdout.decode().splitlines()
    assert version == h.agent_version and "Claude Code" in version
    assert bundle == "/.hangar/ca-certificates.crt"
    # And the image's system store trusts it too (curl reads that one, not the variables, when
    # told to use its default).
    out = io_svc.sandbox_exec(
        sandbox=h.sandbox,
        cmd="env -u SSL_CERT_FILE -u CURL_CA_BUNDLE curl -sS -o /dev/null https://registry.npmjs.org/",
    ).result
    assert out.exit_code == 0, out
    assert Image.objects.get(name="base").nodes.filter(name=ca_node).exists()
