"""Sign-in attempts with a password, throttled per account and per client address.

Every failure is counted in Redis (shared by every server process) for
``HANGAR_LOGIN_WINDOW_S``. Past ``HANGAR_LOGIN_FREE_FAILURES`` failures for an account, or
four times that for an address, each further attempt must wait a delay that doubles with
every failure, up to ``HANGAR_LOGIN_MAX_DELAY_S``; an attempt made sooner is refused without
checking the password at all, so guessing costs time whatever the answer. A success clears the
account's count (the address's keeps counting: one address trying many accounts is a spray).
"""

from __future__ import annotations

import hashlib
import logging
import time

import redis
from django.conf import settings

from ..notify import redis_client

log = logging.getLogger(__name__)
ADDRESS_FACTOR = 4  # an address may fail this many times more than an account before waiting


def _key(kind: str, value: str) -> str:
    digest = hashlib.sha256(value.strip().lower().encode()).hexdigest()[:32]  # no user names in Redis
    return f"hangar:login:{kind}:{digest}"


def _delay(failures: int, free: int) -> float:
    over = failures - free
    if over <= 0:
        return 0.0
    return float(min(settings.HANGAR_LOGIN_MAX_DELAY_S, 2 ** (over - 1)))


def login_wait_s(*, username: str, address: str) -> float:
    """Seconds before the next attempt for this account from this address may be checked
    (0: now)."""
    free = settings.HANGAR_LOGIN_FREE_FAILURES
    try:
        pipe = redis_client().pipeline(transaction=False)
        for kind, value in (("user", username), ("addr", address)):
            pipe.hget(_key(kind, value), "n")
            pipe.hget(_key(kind, value), "at")
        n_user, at_user, n_addr, at_addr = pipe.execute()
    except redis.RedisError as exc:  # fail open: a Redis outage must not lock every user out
        log.warning("login throttle: Redis unavailable (%s); not throttling", exc)
        return 0.0
    now = time.time()
    waits = [0.0]
    for n, at, limit in ((n_user, at_user, free), (n_addr, at_addr, free * ADDRESS_FACTOR)):
        if n is not None and at is not None:
            waits.append(float(at) + _delay(int(n), limit) - now)
    return max(waits)


def login_failed(*, username: str, address: str) -> None:
    window = settings.HANGAR_LOGIN_WINDOW_S
    try:
        pipe = redis_client().pipeline(transaction=False)
        for kind, value in (("user", username), ("addr", address)):
            pipe.hincrby(_key(kind, value), "n", 1)
            pipe.hset(_key(kind, value), "at", repr(time.time()))
            pipe.expire(_key(kind, value), window)
        pipe.execute()
    except redis.RedisError as exc:
        log.warning("login throttle: could not count a failure (%s)", exc)


def login_succeeded(*, username: str) -> None:
    try:
        redis_client().delete(_key("user", username))
    except redis.RedisError:
        pass
