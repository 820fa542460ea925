"""This process's node: its name, its launchers and its image store."""

from __future__ import annotations

from functools import cache

from django.conf import settings

from .launchers import get_launcher, launcher_names
from .launchers.base import Launcher
from .launchers.images import ImageStore
from .launchers.volumes import VolumeStore


def local_node_name() -> str:
    return settings.HANGAR_NODE_NAME


def node_queue(name: str) -> str:
    return f"node.{name}"


def launcher_for(runtime: str) -> Launcher:
    if runtime == "gvisor":
        return get_launcher(
            "gvisor",
            state_dir=str(settings.HANGAR_RUNTIME_DIR / "gvisor"),
            runsc=settings.HANGAR_RUNSC,
            platform=settings.HANGAR_RUNSC_PLATFORM,
            agent_cache_dir=str(settings.DATA_DIR / "bin"),
            network_pool=settings.HANGAR_NETWORK_POOL,
            network_exceptions=tuple(settings.HANGAR_NETWORK_EXCEPTIONS),
            network_nameservers=tuple(settings.HANGAR_NETWORK_NAMESERVERS),
            gateway_port=settings.HANGAR_SANDBOX_GATEWAY_PORT,
            disk_mb=settings.HANGAR_SANDBOX_DISK_MB,
            spare_disks=settings.HANGAR_SPARE_DISKS,
        )
    return get_launcher(runtime, state_dir=str(settings.HANGAR_RUNTIME_DIR / runtime))


def local_runtimes() -> list[str]:
    return [name for name in launcher_names() if name == "gvisor"]


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
