"""Nodes: the list (everyone sees names and states, staff everything), cordon, uncordon,
drain and remove (staff), join tokens (staff) and the join itself (a join token, no API
token). See docs/fleet.md."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from ninja import Field, Router, Schema

from runtime.services import fleet

from .auth import AuthedRequest
from .blocking import blocking
from .schemas import StrictIn, errors

router = Router(tags=["nodes"])


class FleetNodeOut(Schema):
    name: str
    state: str = Field(description="ready | cordoned | draining | removed | lost")
    runtimes: list[str] | None = None
    capabilities: dict[str, dict[str, Any]] | None = Field(
        None,
        description="each runtime it runs, with what its sandboxes can have (network, checkpoint, kvm, gpu)",
    )
    capacity: dict[str, float | int | None] | None = Field(None, description="cpu, memory_mb, disk_mb, gpus")
    allocated: dict[str, float | int | None] | None = Field(
        None, description="what its sandboxes take of it: cpu, memory_mb, disk_mb, gpus"
    )
    labels: dict[str, str] | None = None
    sandboxes: int | None = Field(None, description="sandboxes it holds (running, paused or in between)")
    last_heartbeat_at: datetime | None = None
    version: str | None = None


class DrainOut(Schema):
    node: str
    state: str
    replaced: list[str] = Field(description="warm-pool members started again elsewhere and deleted here")
    kept: list[str] = Field(description="warm-pool members no other node had room for")
    moving: dict[str, str] = Field(
        description="paused sandboxes on their way to another node (id: that node); each gets a moved or "
        "move_failed event"
    )
    staying: dict[str, str] = Field(description="paused sandboxes that cannot move (id: why)")
    remaining: int = Field(description="sandboxes still there: the node stays draining until they end")


class JoinTokenIn(StrictIn):
    expires_in: int | None = Field(None, ge=1, le=fleet.MAX_JOIN_TOKEN_TTL_S, description="seconds")
    uses: int = Field(1, ge=1, le=1000, description="how many nodes may join with it (default 1)")


class JoinTokenOut(Schema):
    id: int
    prefix: str
    created_by: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    uses: int
    used: int
    nodes: list[str]

    @staticmethod
    def resolve_created_by(obj: Any) -> str | None:
        user = obj["created_by"] if isinstance(obj, dict) else obj.created_by
        return user if user is None or isinstance(user, str) else user.get_username()


class JoinTokenCreatedOut(JoinTokenOut):
    token: str = Field(description="the join token itself: shown this once, stored only hashed")


class JoinIn(StrictIn):
    token: str = Field(max_length=200)
    name: str = Field(max_length=63)
    labels: dict[str, str] = {}


class JoinOut(Schema):
    name: str
    labels: dict[str, str]
    database_url: str
    redis_url: str
    celery_broker_url: str
    celery_result_backend: str


def _visible(node: dict[str, Any], staff: bool) -> dict[str, Any]:
    return node if staff else {"name": node["name"], "state": node["state"]}


@router.get("", response=list[FleetNodeOut], exclude_none=True)
async def list_nodes(request: AuthedRequest):
    """Every node: site staff see its runtimes, capacity and allocation, labels, sandbox count,
    last heartbeat and version; others see names and states."""
    staff = request.auth.user.is_staff
    return [_visible(n, staff) for n in await blocking(fleet.nodes_listed)()]


@router.get("/tokens", response=list[JoinTokenOut])
async def list_join_tokens(request: AuthedRequest):
    """Join tokens, newest first (never the tokens themselves)."""
    return await blocking(fleet.join_tokens)()


@router.post("/tokens", response={201: JoinTokenCreatedOut})
async def create_join_token(request: AuthedRequest, payload: JoinTokenIn):
    """A join token for `hangar node join`: single-use unless `uses`, shown once."""
    issued = await blocking(
        lambda: fleet.join_token_create(
            user=request.auth.user, expires_in_s=payload.expires_in, uses=payload.uses
        )
    )()
    t = issued.token
    return 201, {
        "id": t.id, "prefix": t.prefix, "created_by": request.auth.user.get_username(), "created_at": t.created_at,
        "expires_at": t.expires_at, "revoked_at": t.revoked_at, "uses": t.uses, "used": t.used, "nodes": t.nodes,
        "token": issued.raw,
    }  # fmt: skip


@router.delete("/tokens/{token_id}", response=JoinTokenOut)
async def revoke_join_token(request: AuthedRequest, token_id: int):
    """Revoke a join token: no node joins with it from now on (nodes that joined stay)."""
    return await blocking(lambda: fleet.join_token_revoke(token_id=token_id))()


@router.post("/join", response={200: JoinOut, **errors(401, 409)}, auth=None)
async def join(request: HttpRequest, payload: JoinIn):
    """A new node joins with a join token (no API token): a token that is unknown, used up,
    expired or revoked is a 401. The answer is what the node needs to run: the database and
    broker settings (docs/fleet.md says what a node can reach with them)."""
    return await blocking(
        lambda: fleet.node_join(raw=payload.token, name=payload.name, labels=payload.labels)
    )()


@router.post("/{name}/cordon", response={200: FleetNodeOut, **errors(409)})
async def cordon(request: AuthedRequest, name: str):
    """No new sandbox is placed there; what runs there goes on."""
    await blocking(lambda: fleet.node_cordon(name=name))()
    return await _one(name)


@router.post("/{name}/uncordon", response={200: FleetNodeOut, **errors(409)})
async def uncordon(request: AuthedRequest, name: str):
    """A cordoned or draining node takes new sandboxes again."""
    await blocking(lambda: fleet.node_uncordon(name=name))()
    return await _one(name)


@router.post("/{name}/drain", response={200: DrainOut, **errors(409)})
async def drain(request: AuthedRequest, name: str):
    """Cordon it, replace its warm pools' members on other nodes, and leave the rest to end
    (paused sandboxes stay: docs/fleet.md)."""
    return await blocking(lambda: fleet.node_drain(name=name))()


@router.delete("/{name}", response={200: FleetNodeOut, **errors(409)})
async def remove(request: AuthedRequest, name: str):
    """Take it out for good: a 409 while it still holds sandboxes."""
    await blocking(lambda: fleet.node_remove(name=name))()
    return await _one(name)


async def _one(name: str) -> dict[str, Any]:
    listed = await blocking(fleet.nodes_listed)()
    return next(n for n in listed if n["name"] == name)
