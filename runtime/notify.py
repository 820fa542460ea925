"""Status-change notifications over Redis pub/sub, so a waiting request wakes at once instead
of polling the database."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import cache

import redis
from django.conf import settings

log = logging.getLogger(__name__)


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=10, socket_connect_timeout=5)


def _channel(sandbox_id: str) -> str:
    return f"hangar:sandbox:{sandbox_id}"


def team_channel(team_id: int) -> str:
    return f"hangar:team:{team_id}"


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


IMAGES_CHANNEL = "hangar:images"


def image_job_channel(job_id: int) -> str:
    return f"hangar:image-job:{job_id}"


def image_job_changed(job_id: int) -> None:
    """An image job moved on (status or progress): its page and the images page update."""
    try:
        pipe = redis_client().pipeline(transaction=False)
        pipe.publish(image_job_channel(job_id), "changed")
        pipe.publish(IMAGES_CHANNEL, str(job_id))
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
