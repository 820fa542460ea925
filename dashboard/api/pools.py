"""/api/v1/pools: warm pools. A `POST /sandboxes` whose image, runtime, cpu, memory_mb and disk_mb match
a pool of the team (and that attaches no volumes and is not ephemeral) claims a started member
at once; the pool refills in the background. A create with a network claims from a pool with
``network: true`` (members with a namespace of their own; the claim sets the policy); one with a
``node_selector``, a member on a node that carries its labels (a pool's own ``node_selector``
keeps its members on such nodes)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from django.conf import settings
from ninja import Router, Schema
from pydantic import Field

from runtime.models import Pool
from runtime.services import pools as pool_svc

from .auth import AuthedRequest
from .blocking import blocking
from .schemas import StrictIn, errors

router = Router(tags=["pools"])


PoolSize = Annotated[
    int,
    Field(
        ge=1, le=settings.HANGAR_POOL_MAX_SIZE, description="how many started, unclaimed sandboxes to keep"
    ),
]


class PoolIn(StrictIn):
    image: str = Field(
        min_length=1, max_length=300, examples=["busybox"], description="an image of GET /images"
    )
    runtime: str = Field(
        settings.HANGAR_DEFAULT_RUNTIME, min_length=1, max_length=32,
        description="a launcher this install has (422 lists them); default HANGAR_DEFAULT_RUNTIME",
    )  # fmt: skip
    cpu: float = Field(1.0, ge=0.1, le=settings.HANGAR_SANDBOX_MAX_CPU)
    memory_mb: int = Field(
        512, ge=settings.HANGAR_SANDBOX_MIN_MEMORY_MB, le=settings.HANGAR_SANDBOX_MAX_MEMORY_MB
    )
    disk_mb: int | None = Field(
        None,
        ge=settings.HANGAR_SANDBOX_MIN_DISK_MB,
        le=settings.HANGAR_SANDBOX_MAX_DISK_MB,
        description="members' disk size; default HANGAR_SANDBOX_DISK_MB",
    )
    size: PoolSize
    network: bool = Field(
        default=False,
        description="members start with a network of their own (egress none until claimed); creates that "
        "ask for a network claim from such pools",
    )
    node_selector: dict[str, str] = Field(
        {},
        examples=[{"zone": "a"}],
        description="labels its members' nodes must carry, as a sandbox's node_selector (a 422 when no node "
        "carries them); a create with a node_selector claims only members on nodes that carry its labels",
    )


class PoolResizeIn(StrictIn):
    size: PoolSize


class PoolOut(Schema):
    id: str
    image: str
    runtime: str
    cpu: float
    memory_mb: int
    disk_mb: int
    network: bool
    node_selector: dict[str, str]
    size: int
    ready: int = Field(description="members started and waiting to be claimed")
    starting: int
    last_error: str = Field(description="why the last refill stopped short, if it did")
    created_at: datetime


def _out(pool: Pool) -> PoolOut:
    fill = pool_svc.pool_fill(pool)
    return PoolOut(
        id=pool.id, image=pool.image, runtime=pool.runtime, cpu=pool.cpu, memory_mb=pool.memory_mb,
        disk_mb=pool.disk_mb, network=pool.network, node_selector=pool.node_selector or {}, size=pool.size, ready=fill["ready"], starting=fill["starting"], last_error=pool.last_error,
        created_at=pool.created_at,
    )  # fmt: skip


def _team(request: AuthedRequest):
    return request.auth.team


@router.post("", response={201: PoolOut, **errors(409)})
async def create_pool(request: AuthedRequest, payload: PoolIn):
    def create() -> PoolOut:
        pool = pool_svc.pool_create(
            team=_team(request), user=request.auth.user, image=payload.image, runtime=payload.runtime,
            cpu=payload.cpu, memory_mb=payload.memory_mb, size=payload.size, network=payload.network,
            disk_mb=payload.disk_mb, node_selector=payload.node_selector,
        )  # fmt: skip
        return _out(pool)

    return 201, await blocking(create)()


@router.get("", response=list[PoolOut])
async def list_pools(request: AuthedRequest):
    return await blocking(lambda: [_out(p) for p in pool_svc.pools_for_team(team=_team(request))])()


@router.get("/{pool_id}", response=PoolOut)
async def get_pool(request: AuthedRequest, pool_id: str):
    return await blocking(lambda: _out(pool_svc.pool_get(team=_team(request), pool_id=pool_id)))()


@router.patch("/{pool_id}", response=PoolOut)
async def resize_pool(request: AuthedRequest, pool_id: str, payload: PoolResizeIn):
    def resize() -> PoolOut:
        pool = pool_svc.pool_resize(
            pool=pool_svc.pool_get(team=_team(request), pool_id=pool_id), size=payload.size
        )
        return _out(pool)

    return await blocking(resize)()


@router.delete("/{pool_id}", response={204: None})
async def delete_pool(request: AuthedRequest, pool_id: str):
    """Delete the pool and its unclaimed members (claimed sandboxes stay)."""
    await blocking(
        lambda: pool_svc.pool_delete(pool=pool_svc.pool_get(team=_team(request), pool_id=pool_id))
    )()
    return 204, None
