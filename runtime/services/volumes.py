"""Volumes: a team's persistent filesystems of a fixed size, kept on a node.

Rules (the README says them too): deleting a sandbox never deletes a volume; a volume attached
to a sandbox that is not deleted cannot be deleted (409, naming the sandboxes); a sandbox that
attaches volumes runs on their node; the size is the filesystem's, so a write past it fails
with ENOSPC inside the sandbox and the host is never filled.
"""

from __future__ import annotations

import logging
import posixpath
import re
from dataclasses import dataclass
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import QuerySet

from ..errors import Conflict, InvalidValue, NodeUnavailable, NotFound
from ..host import volumes as host_volumes
from ..host.volumes import VolumeError, VolumeUsage
from ..launchers.base import ExecRequest, LauncherError, Mount
from ..models import Node, Sandbox, SandboxVolume, Team, Volume
from ..node.local import launcher_for, local_node_name, volume_store
from . import audit, quotas
from . import usage as usage_svc
from .nodes import node_call
from .sandbox_calls import handle_of

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")
RESERVED_PATHS = ("/proc", "/sys", "/dev", "/.hangar")
MIN_MB = 16


@dataclass(frozen=True)
class VolumeMount:
    """One entry of a create request's ``volumes``: a volume (id or name) and where it goes."""

    volume: str
    mount_path: str
    read_only: bool = False


def volumes_for_team(*, team: Team) -> QuerySet[Volume]:
    return Volume.objects.filter(team=team).select_related("node").order_by("name")


def volume_get(*, team: Team, volume: str) -> Volume:
    """A volume of the team by id or by name; 404 for anything else, another team's included."""
    found = Volume.objects.select_related("node").filter(team=team).filter(id=volume).first()
    if found is None:
        found = Volume.objects.select_related("node").filter(team=team, name=volume).first()
    if found is None:
        raise NotFound(f"no volume {volume!r} in this team")
    return found


def volume_holders(volume: Volume) -> list[str]:
    """Ids of the sandboxes (not deleted) that hold the volume."""
    return sorted(
        SandboxVolume.objects.filter(volume=volume)
        .exclude(sandbox__status=Sandbox.Status.DELETED)
        .values_list("sandbox_id", flat=True)
        .distinct()
    )


def volume_create(
    *, team: Team, name: str, size_mb: int, user: Any = None, node_name: str | None = None
) -> Volume:
    name = (name or "").strip()
    if not NAME_RE.fullmatch(name):
        raise InvalidValue(
            f"invalid volume name {name!r}: 1-64 of a-z 0-9 _ . - starting with a letter or digit"
        )
    limit = settings.HANGAR_VOLUME_MAX_MB
    if not isinstance(size_mb, int) or not MIN_MB <= size_mb <= limit:
        raise InvalidValue(f"size_mb must be between {MIN_MB} and {limit}, got {size_mb}")
    wanted = node_name or local_node_name()
    node = Node.objects.filter(name=wanted).first()
    if node is None:
        raise NotFound(f"no node named {wanted!r}")
    try:
        with transaction.atomic():
            quotas.lock_team(team)
            quotas.check(team, storage_mb=size_mb)
            volume = Volume.objects.create(
                team=team, name=name, size_mb=size_mb, node=node,
                created_by=user if user is not None and getattr(user, "is_authenticated", False) else None,
            )  # fmt: skip
    except IntegrityError:
        raise Conflict(f"this team already has a volume named {name!r}") from None
    try:
        _on_node(volume, "create", {"size_mb": size_mb})
    except Exception:
        volume.delete()  # no data was made: the name is free again
        raise
    audit.record(
        "volume.create", team=team, target=f"{volume.name} ({volume.id})", size_mb=size_mb, node=node.name
    )
    return volume


def volume_usage(volume: Volume) -> dict[str, int] | None:
    """{used_bytes, total_bytes} of the volume's filesystem, or None if its node cannot say."""
    try:
        return _on_node(volume, "usage", {})
    except NodeUnavailable:
        return None


def volume_delete(*, volume: Volume) -> None:
    holders = volume_holders(volume)
    if holders:
        raise Conflict(
            f"volume {volume.name!r} is attached to {', '.join(holders)}; delete those sandboxes first",
            sandboxes=holders,
        )
    _on_node(volume, "delete", {})
    with transaction.atomic():
        usage_svc.volume_final(volume)
        audit.record("volume.delete", team=volume.team, target=f"{volume.name} ({volume.id})")
        volume.delete()


def volumes_reconcile() -> list[str]:
    """Remove this node's volume data that no row owns (a create whose answer was lost, rows
    removed with their team). A row is always written before its data, so data without one is
    an orphan."""
    store = volume_store()
    on_disk = store.list()
    known = set(Volume.objects.filter(id__in=on_disk).values_list("id", flat=True))
    removed = []
    for volume_id in on_disk:
        if volume_id not in known:
            log.warning("removing volume data %s: no volume row owns it", volume_id)
            store.delete(volume_id)
            removed.append(volume_id)
    return removed


# -- attaching to sandboxes -----------------------------------------------------------------


def resolve_mounts(*, team: Team, mounts: list[VolumeMount]) -> list[tuple[Volume, VolumeMount]]:
    """Check a create request's volumes: the team's own, sane distinct mount paths, one node."""
    resolved: list[tuple[Volume, VolumeMount]] = []
    paths: set[str] = set()
    for m in mounts:
        path = m.mount_path
        if (
            not isinstance(path, str)
            or not path.startswith("/")
            or posixpath.normpath(path) != path
            or path == "/"
        ):
            raise InvalidValue(f"mount_path must be an absolute, normalised path other than /, got {path!r}")
        if any(path == r or path.startswith(r + "/") for r in RESERVED_PATHS):
            raise InvalidValue(f"mount_path {path!r} is reserved ({', '.join(RESERVED_PATHS)})")
        if len(path) > 512:
            raise InvalidValue("mount_path is longer than 512 characters")
        if path in paths:
            raise InvalidValue(f"two volumes at {path!r}")
        paths.add(path)
        resolved.append((volume_get(team=team, volume=m.volume), m))
    nodes = {v.node_id for v, _ in resolved}
    if len(nodes) > 1:
        raise InvalidValue(
            "the volumes are on different nodes; a sandbox can only attach volumes of one node"
        )
    return resolved


def volume_node_id(resolved: list[tuple[Volume, VolumeMount]]) -> int | None:
    return resolved[0][0].node_id if resolved else None


# Sandboxes in these states hold no volume: they will not run again.
_DONE = (Sandbox.Status.DELETED, Sandbox.Status.STOPPED, Sandbox.Status.FAILED)


def check_exclusive(*, resolved: list[tuple[Volume, VolumeMount]], node: Node, runtime: str) -> None:
    """A microVM's own kernel mounts its volumes, and a filesystem is mounted by one kernel at a
    time: a volume attached to a microVM sandbox (until that sandbox is deleted or ends) is that
    sandbox's alone, and a microVM sandbox attaches only volumes no other sandbox holds. Conflict
    otherwise. In the create's transaction: the volumes' rows are locked, so two creates that
    would both take a volume are serialised."""
    if not resolved:
        return
    ids = sorted(v.id for v, _ in resolved)
    list(Volume.objects.select_for_update().filter(id__in=ids).order_by("id"))
    vm = node.can(runtime, "vm")
    held = (
        SandboxVolume.objects.filter(volume_id__in=ids)
        .exclude(sandbox__status__in=_DONE)
        .select_related("sandbox", "volume")
        .order_by("volume__name", "sandbox_id")
    )
    for sv in held:
        if vm:
            raise Conflict(
                f"volume {sv.volume.name!r} is attached to sandbox {sv.sandbox_id}: a microVM sandbox "
                "attaches a volume alone; delete that sandbox first", sandboxes=[sv.sandbox_id],
            )  # fmt: skip
        if node.can(sv.sandbox.runtime, "vm"):
            raise Conflict(
                f"volume {sv.volume.name!r} is attached to microVM sandbox {sv.sandbox_id}, which holds "
                "it alone; delete that sandbox first", sandboxes=[sv.sandbox_id],
            )  # fmt: skip


def attach(*, sandbox: Sandbox, resolved: list[tuple[Volume, VolumeMount]]) -> None:
    SandboxVolume.objects.bulk_create(
        [
            SandboxVolume(sandbox=sandbox, volume=v, mount_path=m.mount_path, read_only=m.read_only)
            for v, m in resolved
        ]
    )


def sandbox_mounts(sandbox: Sandbox, *, as_disks: bool = False) -> tuple[Mount, ...]:
    """On the sandbox's node: mount its volumes on the host and say where they go inside; or,
    ``as_disks`` (a microVM, whose kernel mounts them), each volume's image, held for it."""
    store = volume_store()
    out = []
    for sv in SandboxVolume.objects.filter(sandbox=sandbox).select_related("volume").order_by("mount_path"):
        if as_disks:
            image = store.attach_as_disk(sv.volume_id, sandbox.id)
            out.append(Mount(source="", destination=sv.mount_path, read_only=sv.read_only, disk=str(image)))
        else:
            source = store.mount(sv.volume_id)
            out.append(Mount(source=str(source), destination=sv.mount_path, read_only=sv.read_only))
    return tuple(out)


# -- on the volume's node -------------------------------------------------------------------


def _on_node(volume: Volume, op: str, payload: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    node = volume.node
    if node is None:
        raise NodeUnavailable(f"volume {volume.name!r} has lost its node")
    if node.name == local_node_name():
        try:
            return volume_op(op=op, volume_id=volume.id, payload=payload)
        except VolumeError as exc:
            raise NodeUnavailable(f"volume {op} failed on node {node.name}: {exc}") from None
    answer = node_call(node, "volume_op", [op, volume.id, payload], timeout)
    if "error" in answer:
        raise NodeUnavailable(f"volume {op} failed on node {node.name}: {answer['error']}")
    return answer


def _usage_in_vm(volume_id: str) -> VolumeUsage | None:
    """The volume's use as the microVM that holds it sees it (``df`` in the guest at its mount
    path): the host cannot mount it meanwhile, and its superblock is current only once the guest
    lets go. None when no VM holds it, or the guest cannot say."""
    held = host_volumes.holder(volume_store().image(volume_id))
    sv = None if held is None else (
        SandboxVolume.objects.filter(volume_id=volume_id, sandbox_id=held).select_related("sandbox").first()
    )  # fmt: skip
    if sv is None:
        return None
    launcher = launcher_for(sv.sandbox.runtime)
    try:
        r = launcher.exec(
            handle_of(sv.sandbox, launcher), ExecRequest(argv=["df", "-k", sv.mount_path], timeout=10)
        )
        cols = r.stdout.decode().splitlines()[-1].split()
        return VolumeUsage(used_bytes=int(cols[2]) * 1024, total_bytes=int(cols[1]) * 1024)
    except (LauncherError, ValueError, IndexError) as exc:
        log.info("volume %s: its VM could not say its use (%s)", volume_id, exc)
        return None


def volume_op(*, op: str, volume_id: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The node side: JSON in, JSON out. Errors raise locally and come back as ``error``
    through the queue (see the task)."""
    store = volume_store()
    if op == "create":
        store.create(volume_id, int(payload["size_mb"]))
        return {}
    if op == "usage":
        u = _usage_in_vm(volume_id) or store.usage(volume_id)
        return {"used_bytes": u.used_bytes, "total_bytes": u.total_bytes}
    if op == "delete":
        store.delete(volume_id)
        return {}
    raise VolumeError(f"unknown volume op {op!r}")
