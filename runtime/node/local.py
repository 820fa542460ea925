"""This process's node: its name, its launchers and its image store.

The node runs the launchers ``HANGAR_LAUNCHERS`` names, or by default every registered one
whose own probe passes here (and logs why it leaves one out). Each is configured from what the
node gives every launcher (its state under ``HANGAR_RUNTIME_DIR/<name>``, the node's id, its
network and disk settings, the CA bundle) and its own ``HANGAR_LAUNCHER_CONFIG`` block. Nothing
here names a launcher.
"""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

from django.conf import settings

from ..host.hostnames import node_id
from ..host.images.store import ImageStore
from ..host.volumes import VolumeStore
from ..launchers.base import Launcher, LauncherError
from ..launchers.registry import get_launcher, launcher_class, launcher_names

log = logging.getLogger(__name__)


def local_node_name() -> str:
    return settings.HANGAR_NODE_NAME


@cache
def local_node_id() -> str:
    """The id this node keeps in its data directory, which every name it takes on the host
    carries (nftables tables, interfaces, namespaces, cgroups): unlike node names, unique."""
    return node_id(settings.DATA_DIR)


def node_queue(name: str) -> str:
    return f"node.{name}"


def launcher_config(name: str) -> dict[str, Any]:
    """The keyword arguments the launcher ``name`` is constructed with on this node."""
    return {
        "state_dir": str(settings.HANGAR_RUNTIME_DIR / name),
        "node_id": local_node_id(),
        "agent_cache_dir": str(settings.DATA_DIR / "bin"),
        "network_pool": settings.HANGAR_NETWORK_POOL,
        "network_exceptions": tuple(settings.HANGAR_NETWORK_EXCEPTIONS),
        "network_nameservers": tuple(settings.HANGAR_NETWORK_NAMESERVERS),
        "gateway_port": settings.HANGAR_SANDBOX_GATEWAY_PORT,
        "disk_mb": settings.HANGAR_SANDBOX_DISK_MB,
        "spare_disks": settings.HANGAR_SPARE_DISKS,
        "ca_certs": settings.HANGAR_SANDBOX_CA_CERTS,
        **settings.HANGAR_LAUNCHER_CONFIG.get(name, {}),
    }


def launcher_for(runtime: str) -> Launcher:
    """This node's launcher of ``runtime`` (one instance per process)."""
    return get_launcher(runtime, **launcher_config(runtime))


@cache
def local_launchers() -> dict[str, Launcher]:
    """The launchers this node runs, by name (see the module's doc)."""
    named = list(settings.HANGAR_LAUNCHERS)
    found: dict[str, Launcher] = {}
    for name in named or launcher_names():
        try:
            reason = launcher_class(name).probe(launcher_config(name))
        except LauncherError as exc:
            reason = str(exc)
        if reason:
            # Named in HANGAR_LAUNCHERS, it was wanted: an error. Found by default, a note.
            (log.error if named else log.info)("node %s leaves the %s runtime out: %s", local_node_name(), name,
                                               reason)  # fmt: skip
            continue
        found[name] = launcher_for(name)
    if not found:
        log.error("node %s runs no runtime: it will take no sandboxes", local_node_name())
    return found


def local_capabilities() -> dict[str, dict[str, bool]]:
    """What the node advertises (its row's ``launchers``): each runtime it runs and what its
    sandboxes can have."""
    return {name: launcher.capabilities().as_dict() for name, launcher in local_launchers().items()}


def local_address_pools() -> list[str]:
    """The networks this node's sandboxes take addresses from (configured, or chosen once and
    kept: see host/hostnames.py), one per launcher that gives sandboxes networks."""
    return [pool for launcher in local_launchers().values() if (pool := launcher.address_pool())]


@cache
def _store(path: str) -> ImageStore:
    return ImageStore(path)


def image_store() -> ImageStore:
    return _store(str(settings.HANGAR_IMAGES_DIR))


def volume_store() -> VolumeStore:
    return VolumeStore(settings.HANGAR_VOLUMES_DIR)


def node_memory_mb() -> int:
    if settings.HANGAR_NODE_MEMORY_MB:
        return settings.HANGAR_NODE_MEMORY_MB
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    return 1024
