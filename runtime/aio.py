"""Run blocking service calls off the event loop, and wait and stop without losing a cancellation.

Django runs plain sync views on one shared thread under ASGI, so a request that waits for a
sandbox to start would hold up every other request. API views, consumers and async services
hand their blocking work to this pool instead; each call closes the connections it used.

A connection's tasks are cancelled when it goes (daphne cancels an application that outlives
its client; ``asyncio.run`` cancels what is left). Two idioms lose that cancellation and leave
a task running for good: Python 3.11's ``asyncio.wait_for``, which returns the result when the
awaited thing finishes as the cancellation arrives (cpython gh-86296; 3.12 rewrote it on
``asyncio.timeout``), and ``suppress(CancelledError)`` around the wait for a task just
cancelled, which also swallows the waiter's own. :func:`within` and :func:`stop` are the two
without the flaw; the code uses them instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.db import close_old_connections

T = TypeVar("T")

_POOL = ThreadPoolExecutor(max_workers=64, thread_name_prefix="hangar-blocking")


def blocking(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return sync_to_async(call, thread_sensitive=False, executor=_POOL)


async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
    """``asyncio.wait_for(awaitable, seconds)`` (``TimeoutError`` after ``seconds``; None: no
    limit) that never loses a cancellation of the caller (see the module's docstring)."""
    async with asyncio.timeout(seconds):
        return await awaitable


async def stop(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel ``tasks`` and wait until they have ended; what they ended with is dropped (they
    were being stopped). The caller's own cancellation, arriving meanwhile, is raised."""
    given = [t for t in tasks if t is not None]
    for t in given:
        t.cancel()  # nothing, for one already done
        t.add_done_callback(_retrieve)  # read also when the caller stops waiting for it
    if running := [t for t in given if not t.done()]:
        await asyncio.wait(running)  # raises CancelledError if the caller is cancelled


def _retrieve(task: asyncio.Future[Any]) -> None:
    """What a stopped task ended with, read: asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()
