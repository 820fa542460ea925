"""How a node comes to run its launchers, and what the control plane learns of them: only
from the node's row (its heartbeat), never by importing a launcher."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.errors import InvalidValue, NoCapacity
from runtime.models import Image, Node
from runtime.node import local as node_mod
from runtime.services.nodes import node_heartbeat, node_pick, node_register, runtime_require, runtimes_offered
from tests.launchers.reduced import NAME as REDUCED
from tests.support import GVISOR

ROOT = Path(__file__).resolve().parent.parent.parent
REDUCED_CAPS = {
    REDUCED: {
        "network": False,
        "checkpoint": False,
        "kvm": False,
        "gpu": False,
        "vm": False,
        "move": False,
        "max_command_bytes": 1 << 20,
    }
}


@pytest.fixture
def fresh_node(settings):
    """runtime.node's launchers made again from the (overridden) settings, and again after."""
    node_mod.local_launchers.cache_clear()
    yield settings
    node_mod.local_launchers.cache_clear()


def test_by_default_a_node_runs_every_launcher_whose_probe_passes_and_logs_why_it_leaves_one_out(
    fresh_node, caplog
):
    fresh_node.HANGAR_LAUNCHER_CONFIG = {
        **fresh_node.HANGAR_LAUNCHER_CONFIG,
        REDUCED: {"runsc": "/nonexistent/runsc"},
        "microvm": {"kernel_dir": "/nonexistent"},
    }
    with caplog.at_level(logging.INFO, logger="runtime.node.local"):
        assert list(node_mod.local_launchers()) == [fresh_node.HANGAR_DEFAULT_RUNTIME]
    assert f"leaves the {REDUCED} runtime out: runsc (/nonexistent/runsc) is not installed" in caplog.text
    assert "leaves the microvm runtime out: " in caplog.text
    assert set(node_mod.local_capabilities()) == {fresh_node.HANGAR_DEFAULT_RUNTIME}


def test_hangar_launchers_names_the_launchers_a_node_runs(fresh_node):
    fresh_node.HANGAR_LAUNCHERS = [REDUCED]
    assert node_mod.local_capabilities() == REDUCED_CAPS
    assert node_mod.local_address_pools() == []  # a runtime without networks takes no pool


def test_each_launcher_is_configured_from_its_own_settings_block(fresh_node):
    fresh_node.HANGAR_LAUNCHER_CONFIG = {**fresh_node.HANGAR_LAUNCHER_CONFIG, REDUCED: {"platform": "kvm"}}
    reduced = node_mod.launcher_for(REDUCED)
    assert reduced.name == REDUCED and reduced.capabilities().kvm
    assert not node_mod.launcher_for(fresh_node.HANGAR_DEFAULT_RUNTIME).capabilities().kvm
    assert node_mod.launcher_config(REDUCED)["state_dir"] == str(fresh_node.HANGAR_RUNTIME_DIR / REDUCED)
    from runtime.launchers.base import NODE_PARAMETERS

    assert set(NODE_PARAMETERS) <= set(node_mod.launcher_config(REDUCED))  # what every launcher gets


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"HANGAR_DEFAULT_RUNTIME": "nope"}, "HANGAR_DEFAULT_RUNTIME names nope"),
        ({"HANGAR_LAUNCHERS": "gvisor,nope"}, "HANGAR_LAUNCHERS names nope"),
        ({"HANGAR_LAUNCHER_CLASSES": "x=not a target"}, "HANGAR_LAUNCHER_CLASSES: 'x=not a target' is not"),
        ({"HANGAR_LAUNCHER_CONFIG": '{"gvisor": 1}'}, "HANGAR_LAUNCHER_CONFIG must map launcher names"),
    ],
)
def test_launcher_settings_fail_loudly(env, says, tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", "import dashboard.settings"],
        env={**os.environ, "HANGAR_LAUNCHER_CLASSES": "", **env, "HANGAR_DATA_DIR": str(tmp_path)},
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert r.returncode != 0 and "ImproperlyConfigured" in r.stderr and says in r.stderr, r.stderr


def test_a_launcher_registered_in_the_settings_is_known_to_the_process():
    from runtime.launchers.registry import launcher_class, launcher_names

    assert REDUCED in launcher_names()
    assert launcher_class(REDUCED).__name__ == "ReducedGVisorLauncher"


def _image(*nodes: Node) -> Image:
    image = Image.objects.create(name="img", digest="sha256:abc")
    image.nodes.add(*nodes)
    return image


def test_the_scheduler_follows_what_each_node_advertises(transactional_db):
    full = node_register(name="full", launchers=GVISOR, cpu=4, memory_mb=4096)
    reduced = node_register(name="reduced", launchers=REDUCED_CAPS, cpu=4, memory_mb=65536)
    image = _image(full, reduced)
    assert node_pick(runtime="gvisor", cpu=1, memory_mb=256, image=image) == full  # not the roomier one
    assert node_pick(runtime=REDUCED, cpu=1, memory_mb=256, image=image) == reduced
    with pytest.raises(InvalidValue, match=f"the {REDUCED} runtime gives sandboxes no network"):
        node_pick(runtime=REDUCED, cpu=1, memory_mb=256, image=image, needs=["network"])
    with pytest.raises(InvalidValue, match=f"the {REDUCED} runtime cannot checkpoint"):
        node_pick(runtime=REDUCED, cpu=1, memory_mb=256, image=image, needs=["checkpoint"])
    with pytest.raises(NoCapacity, match="^no node: 2 lack runtime other; "):
        node_pick(runtime="other", cpu=1, memory_mb=256, image=image)
    # A second node that gives the reduced runtime a network takes the creates that ask for one.
    both = node_register(name="both", launchers={REDUCED: {"network": True}}, cpu=4, memory_mb=1024)
    image.nodes.add(both)
    assert node_pick(runtime=REDUCED, cpu=1, memory_mb=256, image=image, needs=["network"]) == both
    runtime_require(runtime=REDUCED, capability="network")
    assert runtimes_offered() == {
        "gvisor": {
            "network": True,
            "checkpoint": True,
            "kvm": False,
            "gpu": False,
            "vm": False,
        },
        REDUCED: {
            "network": True,
            "checkpoint": False,
            "kvm": False,
            "gpu": False,
            "vm": False,
            "move": False,
        },
    }


def test_the_heartbeat_refreshes_what_the_node_advertises(transactional_db, fresh_node):
    from runtime.tasks import node_heartbeat as heartbeat_task

    node_register(name=fresh_node.HANGAR_NODE_NAME, launchers={}, cpu=4, memory_mb=4096)
    heartbeat_task()
    assert Node.objects.get(name=fresh_node.HANGAR_NODE_NAME).launchers == node_mod.local_capabilities()
    assert node_heartbeat(name=fresh_node.HANGAR_NODE_NAME, launchers=REDUCED_CAPS)
    node = Node.objects.get(name=fresh_node.HANGAR_NODE_NAME)
    assert node.runtimes == [REDUCED] and not node.can(REDUCED, "network")
    with pytest.raises(InvalidValue, match="no network"):
        runtime_require(runtime=REDUCED, capability="network")


def test_a_create_whose_env_leaves_no_room_for_a_command_on_its_node_is_refused(transactional_db):
    from runtime.models import Sandbox, Team
    from runtime.services import sandboxes as svc

    tiny = {"gvisor": {**GVISOR["gvisor"], "max_command_bytes": 4096}}  # what its node advertises
    _image(node_register(name="tiny", launchers=tiny, cpu=4, memory_mb=4096))
    with pytest.raises(InvalidValue, match="the gvisor runtime takes at most 4096 per command"):
        svc.sandbox_create(
            team=Team.objects.create(name="t"), user=None,
            request=svc.SandboxRequest(image="img", env={"BIG": "x" * 5000}),
        )  # fmt: skip
    assert not Sandbox.objects.exists()
