"""Live page updates: one Redis subscription per server process, fanned out in memory.

Status changes and new events are published on plain Redis pub/sub channels by
:mod:`runtime.notify` (``hangar:team:<id>``, ``hangar:sandbox:<id>``), new spans by
:mod:`runtime.services.trace_live` (``hangar:trace:<team>:<trace id>``): one PUBLISH costs the
worker a fraction of a millisecond, where a Channels ``group_send`` from sync code would need a
fresh event loop and Redis connection per transition, on the path of every sandbox create. The
page consumers here subscribe through :class:`Hub`, which holds a single pattern subscription
for the whole daphne process and hands each message to the local queues that asked for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TypeVar

import redis.asyncio as aioredis
from django.conf import settings

from runtime.aio import blocking, within
from runtime.notify import pubsub_prefix

log = logging.getLogger(__name__)

T = TypeVar("T")


class Hub:
    def __init__(self) -> None:
        self.subscribers: dict[str, set[asyncio.Queue[str]]] = defaultdict(set)
        self._task: asyncio.Task[None] | None = None
        self._ready: asyncio.Event | None = None

    async def subscribe(self, channel: str) -> asyncio.Queue[str]:
        queue: asyncio.Queue[str] = asyncio.Queue(maxsize=1000)
        self.subscribers[channel].add(queue)
        await self._ensure_running()
        return queue

    def unsubscribe(self, channel: str, queue: asyncio.Queue[str]) -> None:
        subs = self.subscribers.get(channel)
        if subs is not None:
            subs.discard(queue)
            if not subs:
                del self.subscribers[channel]

    async def _ensure_running(self) -> None:
        # One subscription per event loop (daphne has one; each test may bring its own).
        if self._task is None or self._task.done() or self._task.get_loop() is not asyncio.get_running_loop():
            self._ready = asyncio.Event()
            self._task = asyncio.create_task(self._run(self._ready))
        assert self._ready is not None
        with contextlib.suppress(TimeoutError):
            await within(self._ready.wait(), 5)

    async def _run(self, ready: asyncio.Event) -> None:
        while True:
            client = aioredis.Redis.from_url(settings.REDIS_URL)
            try:
                pubsub = client.pubsub(ignore_subscribe_messages=True)
                prefix = pubsub_prefix()
                await pubsub.psubscribe(
                    *(prefix + p for p in ("team:*", "sandbox:*", "images", "image-job:*", "trace:*"))
                )
                ready.set()
                async for message in pubsub.listen():
                    if message.get("type") != "pmessage":
                        continue
                    channel = message["channel"].decode()
                    data = (
                        message["data"].decode()
                        if isinstance(message["data"], bytes)
                        else str(message["data"])
                    )
                    for queue in list(self.subscribers.get(channel, ())):
                        with contextlib.suppress(asyncio.QueueFull):
                            queue.put_nowait(data)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("live updates: Redis subscription lost; reconnecting", exc_info=True)
                await asyncio.sleep(1)
            finally:
                with contextlib.suppress(Exception):
                    await client.aclose()


hub = Hub()


async def wait_for(channel: str, read: Callable[[], T], done: Callable[[T], bool], timeout: float) -> T:
    """Re-read with ``read`` (a blocking call, run on the pool) until ``done`` says so or
    ``timeout`` passes, and return the last read. It wakes on each message on ``channel``
    through the process's one subscription (no Redis connection of its own, no thread held
    while waiting), and re-reads at least every second in case one was lost. Subscribed before
    the first read, so no change is missed."""
    queue = await hub.subscribe(channel)
    try:
        deadline = time.monotonic() + timeout
        while True:
            row = await blocking(read)()
            left = deadline - time.monotonic()
            if done(row) or left <= 0:
                return row
            with contextlib.suppress(TimeoutError):
                await within(queue.get(), min(1.0, left))
    finally:
        hub.unsubscribe(channel, queue)
