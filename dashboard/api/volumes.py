"""/api/v1/volumes: a team's persistent filesystems. Attach them when creating a sandbox with
``volumes: [{volume, mount_path, read_only}]``."""

from __future__ import annotations

from datetime import datetime

from django.conf import settings
from ninja import Router, Schema
from pydantic import Field

from runtime.models import Volume
from runtime.services import volumes as volume_svc

from .auth import AuthedRequest
from .blocking import blocking
from .schemas import StrictIn, errors

router = Router(tags=["volumes"])


class VolumeIn(StrictIn):
    name: str = Field(
        min_length=1,
        max_length=64,
        examples=["data"],
        description="unique in the team: 1-64 of a-z 0-9 _ . -",
    )
    size_mb: int = Field(
        ge=volume_svc.MIN_MB,
        le=settings.HANGAR_VOLUME_MAX_MB,
        description="the filesystem's size; a write past it fails with ENOSPC",
    )
    node: str | None = Field(
        None, min_length=1, max_length=100, description="the node to keep it on (default: the API's own)"
    )


class VolumeOut(Schema):
    id: str
    name: str
    size_mb: int
    node: str | None
    used_bytes: int | None = Field(None, description="space in use (only on GET of one volume)")
    attached_to: list[str] = Field(description="the sandboxes (not deleted) that hold it")
    created_at: datetime


def _out(volume: Volume, usage: dict[str, int] | None = None) -> VolumeOut:
    return VolumeOut(
        id=volume.id, name=volume.name, size_mb=volume.size_mb, node=volume.node.name if volume.node else None,
        used_bytes=usage["used_bytes"] if usage else None, attached_to=volume_svc.volume_holders(volume),
        created_at=volume.created_at,
    )  # fmt: skip


def _team(request: AuthedRequest):
    return request.auth.team


@router.post("", response={201: VolumeOut, **errors(404, 409, 429, 502)})
async def create_volume(request: AuthedRequest, payload: VolumeIn):
    """Make a volume: an ext4 filesystem of `size_mb` on a node, empty, owned by root."""

    def create() -> VolumeOut:
        volume = volume_svc.volume_create(
            team=_team(request), name=payload.name, size_mb=payload.size_mb, node_name=payload.node,
            user=request.auth.user,
        )  # fmt: skip
        return _out(volume)

    return 201, await blocking(create)()


@router.get("", response=list[VolumeOut])
async def list_volumes(request: AuthedRequest):
    """The team's volumes by name."""
    return await blocking(lambda: [_out(v) for v in volume_svc.volumes_for_team(team=_team(request))])()


@router.get("/{volume}", response=VolumeOut)
async def get_volume(request: AuthedRequest, volume: str):
    """One volume, by id or name, with the space in use."""

    def get() -> VolumeOut:
        v = volume_svc.volume_get(team=_team(request), volume=volume)
        return _out(v, volume_svc.volume_usage(v))

    return await blocking(get)()


@router.delete("/{volume}", response={204: None, **errors(409, 502)})
async def delete_volume(request: AuthedRequest, volume: str):
    """Delete a volume and its data. Refused (409, with `sandboxes`) while a sandbox that is not
    deleted holds it."""

    def delete() -> None:
        volume_svc.volume_delete(volume=volume_svc.volume_get(team=_team(request), volume=volume))

    await blocking(delete)()
    return 204, None
