from __future__ import annotations

from django.db import connection
from django.http import HttpRequest
from ninja import Field, Router, Schema

from runtime.notify import redis_client
from runtime.services.nodes import nodes_with_usage

router = Router(tags=["system"])


class NodeOut(Schema):
    name: str
    state: str = Field(description="ready | cordoned | draining | removed | lost")
    runtimes: list[str]
    launchers: dict[str, dict[str, bool | int | None]] = Field(
        description="each runtime it runs, with what its sandboxes can have (network, checkpoint, kvm, gpu) "
        "and the most bytes a command may take (max_command_bytes)"
    )
    cpu_capacity: float
    memory_mb_capacity: int
    sandboxes: int
    cpu_used: float
    memory_mb_used: int
    disk_free_mb: int | None
    heartbeat_at: str | None


class HealthOut(Schema):
    status: str
    database: str
    redis: str
    nodes: list[NodeOut]


@router.get("/health", response={200: HealthOut, 503: HealthOut}, auth=None)
def health(request: HttpRequest):
    """Liveness of the control plane, its database and Redis, and each node's last heartbeat."""
    db = redis = "ok"
    nodes: list[NodeOut] = []
    try:
        connection.ensure_connection()
        nodes = [
            NodeOut(
                name=n.name,
                state=n.state,
                runtimes=n.runtimes,
                launchers=n.launchers or {},
                cpu_capacity=n.cpu_capacity,
                memory_mb_capacity=n.memory_mb_capacity,
                sandboxes=n.sandbox_count or 0,
                cpu_used=n.cpu_used or 0,
                memory_mb_used=n.memory_used or 0,
                disk_free_mb=n.disk_free_mb,
                heartbeat_at=n.heartbeat_at.isoformat() if n.heartbeat_at else None,
            )  # fmt: skip
            for n in nodes_with_usage()
        ]
    except Exception as exc:  # health must answer, whatever is broken
        db = f"error: {type(exc).__name__}"
    try:
        redis_client().ping()
    except Exception as exc:
        redis = f"error: {type(exc).__name__}"
    ok = db == "ok" and redis == "ok"
    return (200 if ok else 503), HealthOut(
        status="ok" if ok else "degraded", database=db, redis=redis, nodes=nodes
    )
