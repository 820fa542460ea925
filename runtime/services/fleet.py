"""The fleet: what operators do to nodes (cordon, uncordon, drain, remove), what each node
looks like to them, and the join tokens that let a new machine in (docs/fleet.md).

Every state change is a conditional update recorded in the audit log. Heartbeats and losing
a node are :mod:`runtime.services.nodes`'s.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q, Sum
from django.utils import timezone
from kombu.exceptions import OperationalError

from .. import enqueue
from ..errors import Conflict, Forbidden, InvalidValue, NoCapacity, NotFound, QuotaExceeded
from ..lifecycle import record_event
from ..models import Node, NodeJoinToken, Sandbox
from . import audit, node_redis, node_roles
from .fleet_view import VIEW
from .images import image_resolve
from .nodes import ACTIVE, HELD
from .placement import node_pick
from .sandboxes import PAUSE_MODE_CHECKPOINT, sandbox_delete, sandbox_start_member

N = Node.State
S = Sandbox.Status
JOIN_PREFIX = "hjt_"
NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$")
MAX_JOIN_TOKEN_TTL_S = 30 * 24 * 3600


def node_named(name: str) -> Node:
    node = Node.objects.filter(name=name).first()
    if node is None:
        raise NotFound(f"no node named {name!r}")
    return node


# -- states -----------------------------------------------------------------------------------


def _move(node: Node, *, to: str, frm: list[str], action: str) -> Node:
    """Move ``node`` to ``to`` if it is in one of ``frm`` (a conditional update), with its
    audit record; a node in another state is a 409 that says which."""
    with transaction.atomic():
        if not Node.objects.filter(id=node.id, state__in=frm).update(state=to):
            node.refresh_from_db()
            if node.state == to:
                return node  # already there: asking twice is harmless
            raise Conflict(f"node {node.name} is {node.state}; {action} needs it {' or '.join(frm)}",
                           state=node.state)  # fmt: skip
        audit.record(f"node.{action}", target=node.name, state_from=node.state, state_to=to)
    VIEW.forget()  # this process's placements see the new state at once (others' within a second)
    node.state = to
    return node


def node_cordon(*, name: str) -> Node:
    """No new sandbox is placed on the node; what runs there goes on."""
    return _move(node_named(name), to=N.CORDONED, frm=[N.READY], action="cordon")


def node_uncordon(*, name: str) -> Node:
    """A cordoned or draining node takes new sandboxes again."""
    return _move(node_named(name), to=N.READY, frm=[N.CORDONED, N.DRAINING], action="uncordon")


def node_drain(*, name: str) -> dict[str, Any]:
    """Cordon the node and move off it what can move: its warm pools' unclaimed members are
    replaced by new ones elsewhere (where another node has room), then deleted here; its paused
    sandboxes move, checkpoint and files, to another node (:mod:`runtime.node.moves`: that node
    copies them, in the background). The rest (running sandboxes, paused ones with nowhere to
    go) stays until it ends or reaches its TTL; the node stays ``draining`` and can be removed
    once nothing is left. Returns what it did. Asking again moves what could not move before."""
    node = _move(node_named(name), to=N.DRAINING, frm=[N.READY, N.CORDONED], action="drain")
    moving, staying = _move_paused(node)
    replaced, kept = [], []
    members = Sandbox.objects.filter(
        node=node, pool__isnull=False, claimed_at__isnull=True, status__in=ACTIVE
    )
    for member in members.select_related("pool", "pool__team", "node"):
        try:
            sandbox_start_member(pool=member.pool)  # placed on a ready node
        except (NoCapacity, NotFound, InvalidValue, QuotaExceeded):
            kept.append(member.id)  # nowhere to put it: it ends with the pool, or by hand
            continue
        sandbox_delete(sandbox=member, reason=f"node {node.name} is draining: replaced on another node")
        replaced.append(member.id)
    return {"node": node.name, "state": node.state, "replaced": replaced, "kept": kept, "moving": moving,
            "staying": staying, "remaining": node_holding(node)}  # fmt: skip


def _move_paused(node: Node) -> tuple[dict[str, str], dict[str, str]]:
    """Send each paused sandbox of the draining ``node`` to another node that can take it
    (its runtime moves sandboxes there, checkpoints too if it has one, its image, its
    ``node_selector``; under the placement policy): ({id: node it moves to}, {id: why it stays})."""
    moving: dict[str, str] = {}
    staying: dict[str, str] = {}
    paused = Sandbox.objects.filter(node=node, status=S.PAUSED).annotate(volumes=Count("volume_mounts"))
    for sandbox in paused.order_by("created_at"):
        if sandbox.volumes:
            staying[sandbox.id] = f"its volumes live on node {node.name}"
            continue
        if not node.can(sandbox.runtime, "move"):
            staying[sandbox.id] = f"the {sandbox.runtime} runtime cannot move a sandbox"
            continue
        if not node.tunnel_address:
            staying[sandbox.id] = (
                f"node {node.name} takes no connections from other nodes (no HANGAR_TUNNEL_PORT)"
            )
            continue
        needs = ["move"] + (["checkpoint"] if sandbox.paused_mode == PAUSE_MODE_CHECKPOINT else [])
        try:
            with transaction.atomic():
                to = node_pick(runtime=sandbox.runtime, cpu=0.0, memory_mb=0, image=image_resolve(sandbox.image),
                               needs=needs, node_selector=sandbox.node_selector or None)  # fmt: skip
                record_event(sandbox.id, "moving", f"node {node.name} is draining: moving to node {to.name}",
                             node=node.name, to=to.name)  # fmt: skip
        except (NoCapacity, NotFound, InvalidValue) as exc:
            staying[sandbox.id] = str(exc)
            continue
        try:
            enqueue.send("move_in", [sandbox.id, node.name], queue=to.queue, retry=True,
                         retry_policy=enqueue.RETRY_POLICY)  # fmt: skip
        except OperationalError as exc:
            staying[sandbox.id] = f"the task queue is unreachable: {exc}"
            continue
        moving[sandbox.id] = to.name
    return moving, staying


def node_holding(node: Node) -> int:
    """How many sandboxes the node still holds (running, starting, paused… anything not ended)."""
    return Sandbox.objects.filter(node=node, status__in=HELD).count()


def node_remove(*, name: str) -> Node:
    """Take the node out for good (its row stays, ``removed``, for its sandboxes' history);
    refused while anything is still there: drain it first, or delete what runs."""
    node = node_named(name)
    with transaction.atomic():
        locked = Node.objects.select_for_update().get(id=node.id)
        if locked.state == N.REMOVED:
            return locked
        holding = node_holding(locked)
        if holding:
            raise Conflict(
                f"node {name} still holds {holding} sandbox(es) (running, paused or in between); "
                "drain it and wait, or delete them, then remove it",
                sandboxes=holding,
            )
        Node.objects.filter(id=locked.id).update(state=N.REMOVED, state_before_lost="")
        node_roles.node_role_drop(name)  # its database credentials stop working with the commit
        transaction.on_commit(lambda: node_redis.node_redis_drop(name))  # and its Redis ones
        audit.record("node.remove", target=name, state_from=locked.state, state_to=N.REMOVED)
    locked.state = N.REMOVED
    return locked


# -- what operators see -----------------------------------------------------------------------


def nodes_listed() -> list[dict[str, Any]]:
    """Every node with what the API and the Nodes page show of it: state, runtimes and their
    capabilities, capacity against what its sandboxes take (CPU, memory, disk), labels,
    sandbox count, last heartbeat and version."""
    active, held = Q(sandboxes__status__in=ACTIVE), Q(sandboxes__status__in=HELD)
    rows = Node.objects.annotate(
        cpu_used=Sum("sandboxes__cpu", filter=active),
        memory_used=Sum("sandboxes__memory_mb", filter=active),
        disk_used=Sum("sandboxes__disk_mb", filter=held),
        held=Count("sandboxes", filter=held),
    ).order_by("name")
    listed = []
    for n in rows:
        gpus = sum(1 for caps in (n.launchers or {}).values() if caps.get("gpu"))
        listed.append({
            "name": n.name,
            "state": n.state,
            "runtimes": n.runtimes,
            "capabilities": n.launchers or {},
            "capacity": {
                "cpu": n.cpu_capacity, "memory_mb": n.memory_mb_capacity,
                # Free space now plus what its sandboxes' disks take (they are thin).
                "disk_mb": (n.disk_free_mb or 0) + (n.disk_used or 0) if n.disk_free_mb is not None else None,
                "gpus": gpus,
            },
            "allocated": {"cpu": float(n.cpu_used or 0), "memory_mb": int(n.memory_used or 0),
                          "disk_mb": int(n.disk_used or 0), "gpus": 0},
            "labels": n.labels or {},
            "sandboxes": int(n.held or 0),
            "last_heartbeat_at": n.heartbeat_at,
            "version": n.version,
        })  # fmt: skip
    return listed


# -- joining ----------------------------------------------------------------------------------


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


@dataclass(frozen=True)
class IssuedJoinToken:
    token: NodeJoinToken
    raw: str  # shown once


def join_token_create(*, user: Any, expires_in_s: int | None = None, uses: int = 1) -> IssuedJoinToken:
    """A join token (staff only): good for ``uses`` joins (one by default) until
    ``expires_in_s`` from now (none: until revoked). Only its hash is kept."""
    if user is not None and not user.is_staff:
        raise Forbidden("only site administrators may create join tokens")
    if not 1 <= uses <= 1000:
        raise InvalidValue(f"uses must be between 1 and 1000, got {uses}")
    if expires_in_s is not None and not 1 <= expires_in_s <= MAX_JOIN_TOKEN_TTL_S:
        raise InvalidValue(
            f"expires_in must be between 1 and {MAX_JOIN_TOKEN_TTL_S} seconds, got {expires_in_s}"
        )
    raw = JOIN_PREFIX + secrets.token_urlsafe(32)
    expires = timezone.now() + timedelta(seconds=expires_in_s) if expires_in_s is not None else None
    with transaction.atomic():
        token = NodeJoinToken.objects.create(
            prefix=raw[:12], token_hash=_hash(raw), created_by=user, expires_at=expires, uses=uses
        )
        audit.record("node.join_token.create", target=token.prefix, uses=uses, expires_in_s=expires_in_s)
    return IssuedJoinToken(token=token, raw=raw)


def join_tokens() -> list[NodeJoinToken]:
    return list(NodeJoinToken.objects.select_related("created_by"))


def join_token_revoke(*, token_id: int) -> NodeJoinToken:
    token = NodeJoinToken.objects.filter(id=token_id).first()
    if token is None:
        raise NotFound(f"no join token {token_id}")
    with transaction.atomic():
        if NodeJoinToken.objects.filter(id=token.id, revoked_at__isnull=True).update(
            revoked_at=timezone.now()
        ):
            audit.record("node.join_token.revoke", target=token.prefix)
    # Fetched again with its creator: the API serialises it off the database thread.
    return NodeJoinToken.objects.select_related("created_by").get(id=token.id)


def join_refusal() -> str:
    """Why this control plane cannot take nodes from other machines ("" when it can): its
    database and broker must be reachable from them, which SQLite and the embedded Redis
    (a unix socket in its data dir) are not."""
    if settings.DATABASES["default"]["ENGINE"].endswith("sqlite3"):
        return ("this control plane runs on SQLite (the single-machine default of hangar up); "
                "nodes join a control plane on Postgres and Redis: set DATABASE_URL and REDIS_URL")  # fmt: skip
    if settings.REDIS_URL.startswith("unix:"):
        return ("this control plane runs the embedded Redis on a unix socket (the single-machine default of "
                "hangar up); nodes join a control plane on a Redis they can reach: set REDIS_URL")  # fmt: skip
    return ""


class JoinRefused(Forbidden):
    """A join token that is unknown, used up, expired or revoked (401)."""

    status_code = 401


def node_join(*, raw: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """Spend one use of the join token ``raw`` for a node called ``name``: its row is made
    (or a removed or lost one of that name taken back), with ``labels``, and the answer holds
    what the node needs to run (the database and the broker, as this control plane has them)."""
    if not NAME.match(name):
        raise InvalidValue(f"node name {name!r}: lowercase letters, digits and '-', at most 63 characters")
    for key, value in labels.items():
        if not LABEL_KEY.match(key) or not isinstance(value, str) or len(value) > 63:
            raise InvalidValue(f"label {key}={value!r}: keys of letters, digits, '.', '_', '-', '/'; values of "
                               "at most 63 characters")  # fmt: skip
    refusal = join_refusal()
    if refusal:
        raise Conflict(refusal)
    now = timezone.now()
    with transaction.atomic():
        token = NodeJoinToken.objects.select_for_update().filter(token_hash=_hash(raw or "")).first()
        if token is None:
            raise JoinRefused("unknown join token; ask an administrator for one (hangar node token create)")
        why = ("it was revoked" if token.revoked_at else
               "it has expired" if token.expires_at and token.expires_at <= now else
               f"it has been used ({token.used} of {token.uses} joins)" if token.used >= token.uses else "")  # fmt: skip
        if why:
            raise JoinRefused(f"join token {token.prefix}… is refused: {why}; ask for a new one")
        node = Node.objects.select_for_update().filter(name=name).first()
        if node is not None and node.state not in (N.REMOVED, N.LOST):
            raise Conflict(f"a node named {name} is already registered ({node.state}); "
                           "remove it first or join with another --name", state=node.state)  # fmt: skip
        if node is None:
            node = Node.objects.create(name=name, labels=labels, state=N.READY)
        else:
            Node.objects.filter(id=node.id).update(labels=labels, state=N.READY, state_before_lost="")
        NodeJoinToken.objects.filter(id=token.id).update(
            used=token.used + 1, last_used_at=now, nodes=[*token.nodes, name]
        )
        try:  # in the join's transaction: a role that cannot be made leaves the token unspent
            database_url = node_roles.node_database_url(name)
            redis_urls = node_redis.node_redis_urls(name)
        except (node_roles.NodeRoleRefused, node_redis.NodeRedisRefused) as exc:
            raise Conflict(str(exc)) from None
        audit.record("node.join", target=name, token=token.prefix, labels=labels)
    return {"name": name, "labels": labels, "database_url": database_url, **redis_urls}
