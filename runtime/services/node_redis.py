"""Each joined node's own Redis user: what a node is handed at its join instead of the control
plane's own Redis credentials (docs/fleet.md, "What a compromised node can reach").

A Redis ACL user (Redis 6 and later) per node, with a new password at each join, allowed every
key and channel (Celery's queues and its shared ``unacked`` bookkeeping, and Channels' groups,
are laid out so that a node's worker and bridge touch keys of every node: Redis cannot narrow
that without another layout) but no command of Redis's ``@dangerous`` category, which holds every
``@admin`` one: a node taken over cannot ``CONFIG SET`` Redis into writing files on its host,
``MONITOR`` every other node's traffic, ``FLUSHALL`` the broker, ``KEYS``/``INFO``/``CLIENT
LIST`` its way around, make or read users (``ACL``), ``SHUTDOWN``, ``DEBUG`` or replicate it.
And its credentials can be taken back: ``hangar node remove`` deletes the user, which ends its
open connections at once.

This holds only where a node cannot log in as anyone else: Redis's built-in ``default`` user is
``on`` with no password unless Redis is configured otherwise, and a node that knows the
server's address could use it. A join checks: with ``default`` open, ``on`` refuses it and
``auto`` warns (give Redis a ``requirepass``, or ``ACL SETUSER default off`` with the control
plane on a user of its own).

The user is named from the control plane's database and the node's name (two Hangars on one
Redis never share one). Redis keeps users in memory: the control plane keeps each one's name
and the SHA-256 of its password (:class:`runtime.models.NodeRedisUser`, which nodes' database
roles may not read) and gives Redis any that it lost (a restart without an ACL file) with
beat's node check, every few seconds. ``HANGAR_NODE_REDIS_USERS`` says what a join does where
users cannot be made (a Redis before 6.2, or a control plane whose own Redis user may not run
``ACL``) or would not hold (``default`` open): ``auto`` (the default) hands the node the control plane's own Redis URL, with a
warning in the log; ``on`` refuses the join (409, the token unspent); ``off`` always hands out
the control plane's own."""

from __future__ import annotations

import hashlib
import logging
import secrets
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import redis
from django.conf import settings
from django.db import connection, transaction

from ..models import NodeRedisUser
from ..notify import redis_client

log = logging.getLogger(__name__)

PREFIX = "hangar_node_"
# Every key and channel, every command but the dangerous ones (which hold the admin ones).
RULES = ("~*", "&*", "+@all", "-@dangerous")


class NodeRedisRefused(Exception):
    """Users cannot be made here, and HANGAR_NODE_REDIS_USERS=on."""


def user_name(node_name: str) -> str:
    where = f"{connection.settings_dict['NAME']}:{node_name}"
    return PREFIX + hashlib.sha256(where.encode()).hexdigest()[:16]


def _set_user(client: redis.Redis, username: str, password_sha256: str) -> None:
    # reset: whatever the user had (another password, more rights) goes first.
    client.execute_command("ACL", "SETUSER", username, "reset", "on", f"#{password_sha256}", *RULES)


def _default_open(client: redis.Redis) -> bool:
    """Whether Redis's ``default`` user is on and takes any password (Redis's own default)."""
    user: Any = client.acl_getuser("default") or {}
    flags = [str(f) for f in user.get("flags") or []]
    return "on" in flags and "nopass" in flags


def _url_for(url: str, username: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{quote(username, safe='')}:{quote(password, safe='')}@{host}"))


def node_redis_urls(node_name: str) -> dict[str, str]:
    """``redis_url``, ``celery_broker_url`` and ``celery_result_backend`` for a joining node: its
    own user's where one can be made (or given a new password), else the control plane's own
    (``HANGAR_NODE_REDIS_USERS``). A broker or result backend the operator set apart from
    ``REDIS_URL`` is handed out as it is (this module makes users on ``REDIS_URL``'s server)."""
    own = {
        "redis_url": settings.REDIS_URL,
        "celery_broker_url": settings.CELERY_BROKER_URL,
        "celery_result_backend": settings.CELERY_RESULT_BACKEND,
    }
    mode = settings.HANGAR_NODE_REDIS_USERS
    if mode == "off" or settings.REDIS_URL.startswith("unix:"):
        return own
    username, password = user_name(node_name), secrets.token_urlsafe(24)
    digest = hashlib.sha256(password.encode()).hexdigest()
    client = redis_client()
    try:
        open_default = _default_open(client)
        if open_default and mode == "on":
            raise NodeRedisRefused(
                "Redis's default user takes any password, so a node could skip a user of its own: give Redis a "
                "requirepass (or ACL SETUSER default off, with the control plane on a user of its own), "
                "or set HANGAR_NODE_REDIS_USERS=auto"
            )
        _set_user(client, username, digest)
        # A node that joins again: what still talks as it (its old processes) goes now.
        client.execute_command("CLIENT", "KILL", "USER", username)
    except redis.RedisError as exc:
        why = f"the control plane cannot make Redis users for nodes ({exc}; Redis 6.2 or later and ACL rights needed)"
        if mode == "on":
            raise NodeRedisRefused(f"{why}, and HANGAR_NODE_REDIS_USERS=on") from None
        log.warning("%s: node %s gets the control plane's own Redis credentials", why, node_name)
        return own
    if open_default:
        log.warning(
            "Redis's default user takes any password: node %s gets a Redis user of its own, but could log in as "
            "default instead; give Redis a requirepass, or ACL SETUSER default off with the control plane on a "
            "user of its own (docs/fleet.md)", node_name,
        )  # fmt: skip
    NodeRedisUser.objects.update_or_create(
        node_name=node_name, defaults={"username": username, "password_sha256": digest}
    )
    mine = _url_for(settings.REDIS_URL, username, password)
    # (Celery spells a TCP Redis URL as redis-py does; unix sockets are not handed to nodes.)
    return {
        "redis_url": mine,
        "celery_broker_url": mine
        if settings.CELERY_BROKER_URL == settings.REDIS_URL
        else settings.CELERY_BROKER_URL,
        "celery_result_backend": mine
        if settings.CELERY_RESULT_BACKEND == settings.REDIS_URL
        else settings.CELERY_RESULT_BACKEND,
    }


def node_redis_drop(node_name: str) -> None:
    """A removed node's Redis user goes, and with it every connection it has open (unless the
    node has joined again meanwhile: its new user stays)."""
    from ..models import Node

    with transaction.atomic():
        row = NodeRedisUser.objects.select_for_update().filter(node_name=node_name).first()
        if row is None or not Node.objects.filter(name=node_name, state=Node.State.REMOVED).exists():
            return
        try:
            redis_client().execute_command("ACL", "DELUSER", row.username)
        except redis.RedisError:
            log.warning("could not delete node %s's Redis user %s", node_name, row.username, exc_info=True)
            return  # kept: beat's next check tries again (node_redis_users_restore)
        row.delete()


def node_redis_users_restore() -> int:
    """Give Redis the nodes' users it lost (one ``ACL USERS`` when it lost none), and take back
    those of nodes removed while Redis could not be told. Returns how many were put back."""
    from ..models import Node

    rows = list(NodeRedisUser.objects.all())
    if not rows or settings.HANGAR_NODE_REDIS_USERS == "off":
        return 0
    client = redis_client()
    try:
        there = {u.decode() if isinstance(u, bytes) else u for u in client.execute_command("ACL", "USERS")}
    except redis.RedisError:
        return 0
    removed = set(Node.objects.filter(state=Node.State.REMOVED).values_list("name", flat=True))
    restored = 0
    for row in rows:
        if row.node_name in removed:
            node_redis_drop(row.node_name)
        elif row.username not in there:
            with transaction.atomic():
                # Read again under its lock: a remove or a new join meanwhile decides instead.
                fresh = NodeRedisUser.objects.select_for_update().filter(id=row.id).first()
                if fresh is None or fresh.password_sha256 != row.password_sha256:
                    continue
                if Node.objects.filter(name=row.node_name, state=Node.State.REMOVED).exists():
                    continue
                try:
                    _set_user(client, row.username, row.password_sha256)
                except redis.RedisError:
                    log.warning("could not give Redis node %s's user again", row.node_name, exc_info=True)
                    continue
            restored += 1
            log.warning("Redis had lost node %s's user %s: given back", row.node_name, row.username)
    return restored
