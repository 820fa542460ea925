"""Status-change notifications over Redis pub/sub, so a waiting request wakes at once instead
of polling the database."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterable
from functools import cache

import redis
from django.conf import settings
from django.db import transaction
from redis.connection import parse_url

log = logging.getLogger(__name__)


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)


@cache
def _prefix_for(url: str) -> str:
    db = int(parse_url(url).get("db") or 0)  # redis-py's own reading of the URL (path or ?db=)
    return f"hangar:db{db}:" if db else "hangar:"


def pubsub_prefix() -> str:
    """Every channel Hangar publishes on starts with this. Redis's pub/sub ignores the database
    number, so two Hangars that share one Redis server in databases of their own (or the test
    suite's workers) would hear each other's team and job ids: database N's channels carry it."""
    return _prefix_for(settings.REDIS_URL)


def _channel(sandbox_id: str) -> str:
    return f"{pubsub_prefix()}sandbox:{sandbox_id}"


def team_channel(team_id: int) -> str:
    return f"{pubsub_prefix()}team:{team_id}"


def sandbox_channel(sandbox_id: str) -> str:
    return _channel(sandbox_id)


def sandbox_changed(sandbox_id: str, status: str, team_id: int | None = None) -> None:
    """A sandbox's status changed (or, with status ``event``, it has a new event): wake whoever
    waits on it, and the live pages of its team (see :mod:`dashboard.live`)."""
    try:
        pipe = redis_client().pipeline(transaction=False)
        pipe.publish(_channel(sandbox_id), status)
        if team_id is not None:
            pipe.publish(team_channel(team_id), sandbox_id)
        pipe.execute()
    except redis.RedisError:
        # Waiters fall back to re-reading the row; a lost wake-up costs latency, not correctness.
        log.warning("could not publish status of %s", sandbox_id, exc_info=True)


def images_channel() -> str:
    return f"{pubsub_prefix()}images"


def image_job_channel(job_id: int) -> str:
    return f"{pubsub_prefix()}image-job:{job_id}"


def image_job_changed(job_id: int) -> None:
    """An image job moved on (status or progress): its page and the images page update."""
    try:
        pipe = redis_client().pipeline(transaction=False)
        pipe.publish(image_job_channel(job_id), "changed")
        pipe.publish(images_channel(), str(job_id))
        pipe.execute()
    except redis.RedisError:
        log.warning("could not publish image job %s", job_id, exc_info=True)


def wait_for_status(sandbox_id: str, statuses: Iterable[str], timeout: float, read_status) -> str:
    """Block until ``read_status()`` returns one of ``statuses`` or ``timeout`` passes.

    Subscribes before the first read so a change between read and subscribe is never missed.
    """
    wanted = set(statuses)
    deadline = time.monotonic() + timeout
    pubsub = redis_client().pubsub(ignore_subscribe_messages=True)
    try:
        pubsub.subscribe(_channel(sandbox_id))
        status = read_status()
        while status not in wanted:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            # Re-read at least every second in case a notification was lost.
            pubsub.get_message(timeout=min(left, 1.0))
            status = read_status()
        return status
    finally:
        pubsub.close()


# -- who may act ----------------------------------------------------------------------------------

AUTH_CHANGED = "auth.changed"  # the Channels message type (a consumer's handler: auth_changed)


def auth_group(user_id: int) -> str:
    """The Channels group of every open websocket and SSH session acting for this user."""
    return f"hangar.auth.user.{user_id}"


def auth_changed(user_ids: Iterable[int | None]) -> None:
    """Once the current transaction commits, every open websocket and SSH session of these
    users checks again what it may do (a token revoked, a member removed or lowered, a user
    deactivated, a key deleted): it ends, or carries on with less. A lost message only delays
    that to the sockets' own periodic check (``HANGAR_AUTH_RECHECK_S``)."""
    ids = sorted({int(u) for u in user_ids if u is not None})
    if ids:
        transaction.on_commit(lambda: _send_auth_changed(ids))


def _send_auth_changed(user_ids: list[int]) -> None:
    async def send() -> None:
        # A layer of its own on a loop of its own: the process's shared one belongs to whichever
        # event loop used it first, and this runs on a worker thread.
        from channels.layers import DEFAULT_CHANNEL_LAYER, channel_layers

        layer = channel_layers.make_backend(DEFAULT_CHANNEL_LAYER)
        try:
            for user_id in user_ids:
                await layer.group_send(auth_group(user_id), {"type": AUTH_CHANGED})
        finally:
            close = getattr(layer, "close_pools", None)
            if close is not None:
                await close()

    def run() -> None:
        try:
            asyncio.run(send())
        except Exception:
            log.warning("could not announce a change of access for users %s", user_ids, exc_info=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        run()
    else:  # on an event loop's own thread, which must not block: a thread of its own
        threading.Thread(target=run, name="auth-changed", daemon=True).start()
